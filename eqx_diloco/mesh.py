"""Devices, processes and the ("diloco", "data") meshes.

Replica r owns `--mesh.data` compute devices (row r of the compute mesh) and, when syncs
overlap compute, one extra *communication device* (row r of the communication mesh). On
CPU hosts a collective inside the compute program, or a second program on the same
device, blocks compute; a program on a second local device runs beside it. All devices
of a replica live in one process, so moving data between its compute and communication
devices is a local copy.
"""

from typing import TYPE_CHECKING, Literal

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from ._errors import ConfigError
from ._layout import devices_needed, process_layout, wants_comm_device  # noqa: F401 (re-exported)

if TYPE_CHECKING:  # the CLI's config; the library core never needs it at run time
    from .config import Config

AXES = ("diloco", "data")


def ensure_cpu_devices(count: int) -> None:
    """On a CPU-only machine, ask XLA for `count` simulated CPU devices.

    Must run before JAX creates its backends; afterwards the device count is fixed and
    `make_meshes` reports a clear error if it is too small.
    """
    if jax.config.jax_num_cpu_devices >= count:
        return
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        pass  # backends already exist (tests, notebooks); make_meshes checks the count


def setup_devices(config: "Config") -> None:
    """Set the local device count and, for several processes, join the distributed runtime."""
    coordinator, num_processes, process_id = process_layout(config)
    ensure_cpu_devices(devices_needed(config))
    if num_processes > 1:
        if coordinator is None:
            raise ConfigError("--dist.coordinator-address (or $JAX_COORDINATOR_ADDRESS) is required with several processes")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator,
            num_processes,
            process_id,
            heartbeat_timeout_seconds=config.dist.heartbeat_timeout_s,
            initialization_timeout=120,
        )


def make_meshes(config: "Config") -> tuple[Mesh, Mesh | None]:
    """The CLI's meshes: `build_meshes` from the config's flags."""
    d = config.diloco
    overlapped = config.algorithm == "diloco" and (d.overlap_steps > 0 or d.outer_overlap != "none")
    return build_meshes(d.num_replicas, config.mesh.data, comm_device=d.comm_device if overlapped else "off")


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
        raise ConfigError(f"--diloco.num-replicas must be divisible by the process count (got {R} and {num_processes})")
    local_replicas = R // num_processes
    comm = comm_device == "on" or (comm_device == "auto" and jax.default_backend() == "cpu")
    per_process = local_replicas * (D + int(comm))
    compute_rows, comm_rows = [], []
    for p in range(num_processes):
        devices = sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
        if len(devices) < per_process:
            raise ConfigError(
                f"--diloco.num-replicas x (--mesh.data{' + 1 communication device' if comm else ''}) needs "
                f"{per_process} devices per process, process {p} has {len(devices)} ({devices[0].platform}); "
                f"on CPU call jax.config.update('jax_num_cpu_devices', {per_process}) before JAX starts"
            )
        compute_rows.append(np.asarray(devices[: local_replicas * D]).reshape(local_replicas, D))
        comm_rows.append(np.asarray(devices[local_replicas * D : per_process]).reshape(local_replicas, int(comm)))
    auto = (AxisType.Auto, AxisType.Auto)
    mesh = Mesh(np.concatenate(compute_rows), AXES, axis_types=auto)
    comm_mesh = Mesh(np.concatenate(comm_rows), AXES, axis_types=auto) if comm else None
    return mesh, comm_mesh
