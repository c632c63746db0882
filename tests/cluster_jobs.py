"""Cluster managers emulated on 127.0.0.1: the variables `srun` and Open MPI's `mpirun` set in each
task, and the launch lines of `examples/` read back from their files, so tests run what the
examples show."""

import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# JAX's SLURM and Open MPI plugins put the coordinator on a port in [61440, 65535] derived from the job id.
_PORT_BASE, _PORTS = 65535 - 2**12 + 1, 2**12
# Variables that would make a task skip cluster detection (the tests' own environment may have them).
_DIST_VARIABLES = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_COORDINATOR_PORT")


def free_job_id(start: int = 1000) -> int:
    """A job id whose coordinator port (as JAX derives it) is free on 127.0.0.1 now."""
    for job in range(start, start + _PORTS):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", _PORT_BASE + job % _PORTS))
            except OSError:
                continue
        return job
    raise RuntimeError("no free port in JAX's cluster port range")


def slurm_env(job_id: int, num_tasks: int, task: int) -> dict[str, str]:
    """What `srun` sets in task `task` of a `num_tasks`-task step, one task per (emulated) node."""
    return {"SLURM_JOB_ID": str(job_id), "SLURM_STEP_ID": "0", "SLURM_JOB_NAME": "eqx-diloco",
            "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": str(num_tasks), "SLURM_PROCID": str(task),
            "SLURM_LOCALID": "0", "SLURM_STEP_NUM_NODES": str(num_tasks), "SLURM_JOB_NUM_NODES": str(num_tasks),
            "SLURM_NNODES": str(num_tasks)}


def ompi_env(job_id: int, size: int, rank: int) -> dict[str, str]:
    """What Open MPI 4's `mpirun` sets in rank `rank` of `size` (ORTE's job ids are multiples of 2^12)."""
    return {"OMPI_MCA_orte_hnp_uri": f"{job_id * _PORTS}.0;tcp://127.0.0.1:4242", "OMPI_COMM_WORLD_SIZE": str(size),
            "OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_RANK": "0",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}


def launch_line(path: Path, launcher: str, variables: dict[str, str]) -> list[str]:
    """The trainer command on the `launcher` (`srun`, `mpirun`) line of the script at `path`, with
    `$NAME` / `"$NAME"` replaced from `variables` (`@` for `"$@"`, a list joined by spaces) and the
    launcher and its options dropped: what runs in each task."""
    line = next(line for line in path.read_text().splitlines() if line.startswith(launcher + " "))
    words = []
    for word in shlex.split(line):
        if word == "$@":
            words.extend(variables["@"])
        else:
            words.append(re.sub(r"\$(\w+)", lambda m: variables[m[1]], word))
    command = words[words.index("python"):]
    return [sys.executable, *command[1:]]


def start_tasks(command: list[str], task_envs: list[dict[str, str]], logs: Path) -> list[subprocess.Popen]:
    """Start one process per entry of `task_envs` (each task's cluster variables), output in `logs`/task<i>.log."""
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for i, extra in enumerate(task_envs):
        env = {k: v for k, v in os.environ.items() if k not in _DIST_VARIABLES}
        env.update(extra, PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), PYTHONUNBUFFERED="1")
        with (logs / f"task{i}.out").open("w") as out, (logs / f"task{i}.err").open("w") as err:
            procs.append(subprocess.Popen(command, stdout=out, stderr=err, env=env, cwd=ROOT))
    return procs


def wait_all(procs: list[subprocess.Popen], logs: Path, timeout: float = 600) -> list[int]:
    """Exit codes of `procs`; kills them all if one has not exited within `timeout` seconds."""
    try:
        return [p.wait(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError("a task hung:\n" + "\n".join(f.read_text()[-2000:] for f in sorted(logs.glob("*.err"))))
