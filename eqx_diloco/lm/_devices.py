"""The CLI's devices and meshes from its flags: CPU device count, `jax.distributed`, `build_meshes`."""

from typing import TYPE_CHECKING

import jax
from jax.sharding import Mesh

from .._errors import ConfigError
from .._mesh import build_meshes, ensure_cpu_devices
from ._layout import devices_needed, process_layout

if TYPE_CHECKING:
    from .config import Config


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
