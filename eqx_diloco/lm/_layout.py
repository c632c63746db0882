"""How a CLI run lays out over processes and devices, from its flags and JAX's environment
variables alone: importing it does not start JAX, so the trainer can check and describe a run
within a second of starting."""

import dataclasses
import os
from typing import TYPE_CHECKING

from .._arguments import check_replicas_per_process, processes_per_island
from .._errors import ConfigError
from ._cluster import DetectedCluster, detect_cluster
from ._flags import flag_names

if TYPE_CHECKING:
    from .config import Config


@dataclasses.dataclass(frozen=True)
class ProcessLayout:
    """Where this process stands in its run.

    - `coordinator`: process 0's `host:port` (None for a single process).
    - `num_processes`, `process_id`: the run's process count and this process's index.
    - `cluster`: the cluster manager JAX detected (None when flags or JAX_* variables say it all, or
      there is none).
    - `job`: what tells this run's processes from another run's (the run folder's lock compares it).
    """

    coordinator: str | None
    num_processes: int
    process_id: int
    cluster: DetectedCluster | None = None

    @property
    def job(self) -> str:
        return self.cluster.job if self.cluster is not None else f"coordinator {self.coordinator}"

    def source(self, what: str) -> str:
        """Where `what` (`count`, `id` or `coordinator`) came from, for error messages."""
        flag = {"count": "--dist.num-processes", "id": "--dist.process-id",
                "coordinator": "--dist.coordinator-address"}[what]
        if self.cluster is not None:
            return f"{flag}, here from {self.cluster.name} through JAX's cluster detection"
        return f"{flag} or ${_ENV[what]}"


_ENV = {"count": "JAX_NUM_PROCESSES", "id": "JAX_PROCESS_ID", "coordinator": "JAX_COORDINATOR_ADDRESS"}


def process_layout(config: "Config") -> ProcessLayout:
    """The run's processes from the `--dist.*` flags, else JAX's environment variables, else (with
    `--dist.cluster auto` and none of those set) the cluster manager JAX detects (`_cluster`)."""
    dist = config.dist
    coordinator = dist.coordinator_address or os.environ.get(_ENV["coordinator"])
    count = dist.num_processes or _env_int(_ENV["count"], None, "--dist.num-processes")
    process_id = dist.process_id if dist.process_id is not None else _env_int(_ENV["id"], None, "--dist.process-id")
    if coordinator is None and count is None and process_id is None and dist.cluster == "auto":
        cluster = detect_cluster(dist.init_timeout_s)
        if cluster is not None and cluster.num_processes > 1:
            return ProcessLayout(cluster.coordinator, cluster.num_processes, cluster.process_id, cluster)
    return ProcessLayout(coordinator, count or 1, process_id or 0)


def check_dist(config: "Config") -> None:
    """The `--dist.*` flags `validate` leaves to this module: the start-up timeout, and a coordinator
    address JAX can use (`host:port`; JAX would fail on anything else with a traceback)."""
    if config.dist.init_timeout_s < 1:
        raise ConfigError(f"--dist.init-timeout-s must be >= 1 (got {config.dist.init_timeout_s})")
    layout = process_layout(config)
    coordinator = layout.coordinator
    if layout.num_processes > 1 and coordinator is not None:
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            source = "--dist.coordinator-address" if config.dist.coordinator_address else layout.source("coordinator")
            raise ConfigError(f"{source} must be host:port, with a port in 1-65535 (got {coordinator!r})")


def _env_int(name: str, default: int | None, flag: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"${name} must be an integer (got {value!r}; or set {flag})") from None


def overlapped_syncs(config: "Config") -> bool:
    """Whether the run's syncs overlap compute (`--diloco.overlap-steps` > 0 or an outer overlap)."""
    d = config.diloco
    return config.algorithm == "diloco" and (d.overlap_steps > 0 or d.outer_overlap != "none")


def wants_comm_device(config: "Config") -> bool:
    """Whether syncs run on separate communication devices (only with overlap, tau > 0)."""
    return overlapped_syncs(config) and config.diloco.comm_device != "off"


def devices_needed(config: "Config") -> int:
    """Devices per process: `--mesh.data x --mesh.fsdp x --mesh.tensor` per row of K replicas
    (`--mesh.replicas-per-device`, 1 when automatic), plus `--mesh.fsdp x --mesh.tensor` per row for
    communication; where an island spans S processes, its devices / S. CPU runs simulate this many."""
    layout = process_layout(config)
    num_processes, process_id = layout.num_processes, layout.process_id
    R = config.diloco.num_replicas
    if num_processes < 1 or (R % num_processes and num_processes % R):
        raise ConfigError(
            f"--diloco.num-replicas and the process count {num_processes} (from {layout.source('count')}; got {R} "
            f"replicas) must divide one another: every process holds whole replicas, or every island spans whole "
            f"processes"
        )
    if not 0 <= process_id < num_processes:
        raise ConfigError(f"{layout.source('id')} must be in [0, {num_processes}) (got {process_id})")
    try:  # the core's rule, in this CLI's flags
        check_replicas_per_process(R, num_processes, config.mesh.replicas_per_device or None)
    except ConfigError as e:
        raise ConfigError(flag_names(str(e))) from None
    K = config.mesh.replicas_per_device or 1
    island = config.mesh.data * config.mesh.fsdp * config.mesh.tensor
    if (S := processes_per_island(R, num_processes)) > 1:
        if island % S:
            raise ConfigError(f"an island spanning {S} processes ({R} replicas on {num_processes}) needs --mesh.data x "
                              f"--mesh.fsdp x --mesh.tensor divisible by {S} (got {island})")
        return island // S
    comm = int(wants_comm_device(config)) * config.mesh.fsdp * config.mesh.tensor  # a partner for each shard
    return R // num_processes // K * (island + comm)

