"""Devices and the ("diloco", "data") mesh."""

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from .config import Config, ConfigError


def devices_needed(config: Config) -> int:
    """One device per replica on `diloco`, times `--mesh.data` devices per replica."""
    return config.diloco.num_replicas * config.mesh.data


def ensure_cpu_devices(count: int) -> None:
    """On a CPU-only machine, ask XLA for `count` simulated CPU devices.

    Must run before JAX creates its backends; afterwards the device count is fixed and
    `make_mesh` reports a clear error if it is too small.
    """
    if jax.config.jax_num_cpu_devices >= count:
        return
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        pass  # backends already exist (tests, notebooks); make_mesh checks the count


def make_mesh(config: Config) -> Mesh:
    """The ("diloco", "data") mesh: one row of `--mesh.data` devices per replica.

    Axis types are Auto so jit propagates shardings (shard_map then accepts inputs that are
    not already laid out on the mesh).
    """
    R, D = config.diloco.num_replicas, config.mesh.data
    devices = jax.devices()
    if len(devices) < R * D:
        raise ConfigError(
            f"--diloco.num-replicas x --mesh.data needs {R * D} devices, found {len(devices)} "
            f"({devices[0].platform}); on CPU set jax_num_cpu_devices before JAX starts"
        )
    grid = np.asarray(devices[: R * D]).reshape(R, D)
    return Mesh(grid, ("diloco", "data"), axis_types=(AxisType.Auto, AxisType.Auto))
