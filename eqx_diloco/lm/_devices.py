"""The CLI's devices and meshes from its flags: CPU device count, `jax.distributed`, `build_meshes`."""

import os
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


# A test hook, read here only: "P:T" makes the process with JAX process index P raise at step T, as a
# failure that process alone sees would (a bug, a disk error). Never set outside tests:
# tests/test_multiprocess.py uses it to check that such a process leaves at once and is the one blamed.
TEST_FAIL_ENV = "EQX_DILOCO_TEST_FAIL_AT_STEP"


def fail_for_test(step: int) -> None:
    """Raise at step `step` in the process `$EQX_DILOCO_TEST_FAIL_AT_STEP` names (tests only)."""
    spec = os.environ.get(TEST_FAIL_ENV)
    if spec and spec == f"{jax.process_index()}:{step}":
        raise RuntimeError(f"${TEST_FAIL_ENV}={spec}: process {jax.process_index()} fails at step {step} (test hook)")
