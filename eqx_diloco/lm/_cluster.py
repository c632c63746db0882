"""The cluster manager a process runs under, as JAX's own cluster detection sees it.

`jax.distributed.initialize()` without arguments finds SLURM (`srun`), Open MPI (`mpirun`, through
ORTE's `OMPI_MCA_orte_hnp_uri`), Kubernetes (with the `kubernetes` package and API access) and Cloud
TPU pods, and reads the coordinator address, the process count and this process's index from them.
The trainer needs those three before JAX joins (the process count decides how many devices each
process asks for), so it asks the same plugins directly. JAX is imported only when asked.
"""

import dataclasses
import functools
import os
import sys
import warnings

from .._errors import ConfigError


@dataclasses.dataclass(frozen=True)
class DetectedCluster:
    """What JAX's cluster detection found.

    - `name`: the plugin's name (`slurm`, `ompi`, `k8s`, ...).
    - `coordinator`: process 0's `host:port`, the same in every process of the job.
    - `num_processes`, `process_id`: the job's process count and this process's index.
    - `job`: what tells this job from another on the same machines (the scheduler's job and step
      ids where it has them), for the run folder's lock.
    """

    name: str
    coordinator: str
    num_processes: int
    process_id: int
    job: str


# The variables JAX's plugins start from (SLURM, Open MPI, Kubernetes, Cloud TPU). Where none is set,
# no plugin can find a cluster, and JAX is not imported just to say so: a plain run prints its set-up
# before JAX's import (about a second).
_CLUSTER_HINTS = ("SLURM_", "OMPI_", "KUBERNETES_SERVICE_HOST", "TPU_", "MEGASCALE_")


def detect_cluster(timeout_s: int) -> DetectedCluster | None:
    """The cluster this process runs under, or None if JAX knows none here.

    Opt-in plugins (mpi4py) are not asked, as `jax.distributed.initialize()` does not ask them
    unless told to. `timeout_s`: how long a plugin may wait for the scheduler's answer.

    The answer is kept for as long as the variables it starts from stay the same: the trainer's
    checks, device set-up and banner each ask, and a plugin may ask its scheduler over the network
    (Kubernetes)."""
    hints = tuple(sorted((name, value) for name, value in os.environ.items()
                         if name.startswith(_CLUSTER_HINTS) or name == "JAX_COORDINATOR_PORT"))
    if not any(name != "JAX_COORDINATOR_PORT" for name, _ in hints):
        return None
    return _ask_jax(timeout_s, hints)


@functools.cache
def _ask_jax(timeout_s: int, hints: tuple[tuple[str, str], ...]) -> DetectedCluster | None:
    """`detect_cluster`'s question to JAX's plugins (`hints`: the variables they read, the cache key)."""
    try:
        from jax._src.clusters import ClusterEnv
    except ImportError:  # a JAX that moved its plugins: say so once, run as a single process
        print("warning: this JAX has no cluster detection (jax._src.clusters); pass --dist.* flags "
              "or JAX_* variables to run several processes", file=sys.stderr, flush=True)
        return None
    with warnings.catch_warnings():
        # Kubernetes without the `kubernetes` package warns at every start; the JobSet example sets JAX_*.
        warnings.simplefilter("ignore")
        env = next((e for e in ClusterEnv._cluster_types if not e.opt_in_only_method and e.is_env_present()), None)
    if env is None:
        return None
    name = getattr(env, "name", "") or env.__name__
    try:
        coordinator = env.get_coordinator_address(timeout_secs=timeout_s,
                                                  override_coordinator_port=os.environ.get("JAX_COORDINATOR_PORT"))
        num_processes, process_id = env.get_process_count(), env.get_process_id()
    except (ValueError, KeyError, RuntimeError) as e:  # e.g. SLURM_NTASKS=abc: JAX's int() raises
        raise ConfigError(f"JAX's cluster detection found {name}, but cannot read its job ({type(e).__name__}: {e}); "
                          f"pass the --dist.* flags, or --dist.cluster none for a single process") from None
    if not (num_processes >= 1 and 0 <= process_id < num_processes):  # e.g. SLURM_NTASKS=0 ran as one process
        raise ConfigError(f"JAX's cluster detection found {name}, but its job says {num_processes} processes and this "
                          f"is process {process_id} (a job has >= 1 processes, numbered from 0); pass the --dist.* "
                          f"flags, or --dist.cluster none for a single process")
    return DetectedCluster(name=name, coordinator=coordinator, num_processes=num_processes, process_id=process_id,
                           job=_job_id(name, coordinator))


def _job_id(name: str, coordinator: str) -> str:
    """The scheduler's id for this job step where it sets one, else the coordinator address (a port
    only one job can hold at a time)."""
    if name == "slurm" and "SLURM_JOB_ID" in os.environ:
        step = os.environ.get("SLURM_STEP_ID")
        return f"slurm job {os.environ['SLURM_JOB_ID']}" + (f" step {step}" if step else "")
    if name == "ompi" and "OMPI_MCA_orte_hnp_uri" in os.environ:
        return f"ompi job {os.environ['OMPI_MCA_orte_hnp_uri'].split(';', 1)[0]}"
    return f"{name} coordinator {coordinator}"
