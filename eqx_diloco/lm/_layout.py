"""How a CLI run lays out over processes and devices, from its flags and JAX's environment
variables alone: importing it does not start JAX, so the trainer can check and describe a run
within a second of starting."""

import os
from typing import TYPE_CHECKING

from .._errors import ConfigError

if TYPE_CHECKING:
    from .config import Config


def process_layout(config: "Config") -> tuple[str | None, int, int]:
    """(coordinator address, process count, process id) from flags, else JAX's environment variables."""
    dist = config.dist
    coordinator = dist.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    num_processes = dist.num_processes or _env_int("JAX_NUM_PROCESSES", 1, "--dist.num-processes")
    process_id = dist.process_id if dist.process_id is not None else _env_int("JAX_PROCESS_ID", 0, "--dist.process-id")
    return coordinator, num_processes, process_id


def check_dist(config: "Config") -> None:
    """The `--dist.*` flags `validate` leaves to this module: the start-up timeout, and a coordinator
    address JAX can use (`host:port`; JAX would fail on anything else with a traceback)."""
    if config.dist.init_timeout_s < 1:
        raise ConfigError(f"--dist.init-timeout-s must be >= 1 (got {config.dist.init_timeout_s})")
    coordinator, num_processes, _ = process_layout(config)
    if num_processes > 1 and coordinator is not None:
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            source = "--dist.coordinator-address" if config.dist.coordinator_address else "$JAX_COORDINATOR_ADDRESS"
            raise ConfigError(f"{source} must be host:port, with a port in 1-65535 (got {coordinator!r})")


def _env_int(name: str, default: int, flag: str) -> int:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"${name} must be an integer (got {value!r}; or set {flag})") from None


def wants_comm_device(config: "Config") -> bool:
    """Whether syncs run on separate communication devices (only with overlap, tau > 0)."""
    d = config.diloco
    overlapped = d.overlap_steps > 0 or d.outer_overlap != "none"
    return config.algorithm == "diloco" and overlapped and d.comm_device != "off"


def devices_needed(config: "Config") -> int:
    """Devices per process: `--mesh.data` per local replica, plus one per replica for communication."""
    _, num_processes, process_id = process_layout(config)
    R = config.diloco.num_replicas
    source = "--dist.num-processes" if config.dist.num_processes else "$JAX_NUM_PROCESSES"
    if num_processes < 1 or R % num_processes:
        raise ConfigError(
            f"--diloco.num-replicas must be a multiple of the process count {num_processes} (from {source}; got {R}): "
            f"every process needs whole replicas"
        )
    if not 0 <= process_id < num_processes:
        raise ConfigError(f"--dist.process-id (or $JAX_PROCESS_ID) must be in [0, {num_processes}) (got {process_id})")
    local_replicas = R // num_processes
    return local_replicas * (config.mesh.data + int(wants_comm_device(config)))

