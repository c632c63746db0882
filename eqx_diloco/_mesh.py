"""Devices, processes and the ("diloco", "data") meshes.

Replica r owns `--mesh.data` compute devices (row r of the compute mesh) and, when syncs
overlap compute, one extra *communication device* (row r of the communication mesh). On
CPU hosts a collective inside the compute program, or a second program on the same
device, blocks compute; a program on a second local device runs beside it. All devices
of a replica live in one process, so moving data between its compute and communication
devices is a local copy.
"""

from typing import Literal

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from ._errors import ConfigError

AXES = ("diloco", "data")


def use_cpu_devices(count: int) -> None:
    """Ask XLA for `count` simulated CPU devices; call it before any JAX computation.

    A CPU-only machine has one device by default, and `DiLoCo` needs R x `data_parallel`
    devices (plus one communication device per replica when syncs overlap compute). This sets JAX's global `jax_num_cpu_devices`, which can only
    change before JAX creates its backends: `DiLoCo` never calls it for you.

    **Arguments:**

    - `count`: the number of CPU devices this process should have (a smaller request than the
      current setting changes nothing).

    Raises `ConfigError` if JAX has already started with fewer devices.
    """
    if jax.config.jax_num_cpu_devices >= count:
        return
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        raise ConfigError(
            f"use_cpu_devices({count}) must run before JAX starts (it already has {jax.config.jax_num_cpu_devices} "
            f"CPU devices); call it first thing, or set XLA_FLAGS=--xla_force_host_platform_device_count={count}"
        ) from None


def ensure_cpu_devices(count: int) -> None:
    """`use_cpu_devices` where JAX may have started already (tests, the CLI): then a later
    mesh check reports what is missing instead."""
    try:
        use_cpu_devices(count)
    except ConfigError:
        pass


def build_meshes(
    num_replicas: int, data: int = 1, *, comm_device: Literal["auto", "on", "off"] = "off"
) -> tuple[Mesh, Mesh | None]:
    """The compute mesh (R, data) and, if asked for, the communication mesh (R, 1).

    **Arguments:**

    - `num_replicas`: R, the size of the `diloco` axis; must be divisible by the process count.
    - `data`: devices per replica on the `data` axis.
    - `comm_device`: `on` gives every replica one extra communication device; `auto` does
      so on CPU only (where a second program on the same device would not overlap); `off`.

    Axis types are Auto so jit propagates shardings (shard_map then accepts inputs that are
    not already laid out on the mesh).
    """
    R, D = num_replicas, data
    num_processes = jax.process_count()
    if R % num_processes:
        raise ConfigError(f"num_replicas must be divisible by the process count (got {R} and {num_processes})")
    local_replicas = R // num_processes
    comm = comm_device == "on" or (comm_device == "auto" and jax.default_backend() == "cpu")
    per_process = local_replicas * (D + int(comm))
    compute_rows, comm_rows = [], []
    for p in range(num_processes):
        devices = sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
        if len(devices) < per_process:
            raise ConfigError(
                f"num_replicas x (data_parallel{' + 1 communication device' if comm else ''}) needs "
                f"{per_process} devices per process, process {p} has {len(devices)} ({devices[0].platform}); "
                f"on CPU call eqx_diloco.use_cpu_devices({per_process}) before JAX starts"
            )
        compute_rows.append(np.asarray(devices[: local_replicas * D]).reshape(local_replicas, D))
        comm_rows.append(np.asarray(devices[local_replicas * D : per_process]).reshape(local_replicas, int(comm)))
    auto = (AxisType.Auto, AxisType.Auto)
    mesh = Mesh(np.concatenate(compute_rows), AXES, axis_types=auto)
    comm_mesh = Mesh(np.concatenate(comm_rows), AXES, axis_types=auto) if comm else None
    return mesh, comm_mesh
