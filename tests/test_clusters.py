"""Runs where clusters run: the trainer joins a SLURM or Open MPI job through JAX's cluster
detection, with no --dist flags. The cluster managers are emulated on 127.0.0.1 with the
variables each sets (tests/cluster_jobs.py), and the launch lines are read from `examples/`."""

import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import yaml

from cluster_jobs import ROOT, free_job_id, launch_line, ompi_env, slurm_env, start_tasks, wait_all
from eqx_diloco import ConfigError
from eqx_diloco.lm._banner import island_map
from eqx_diloco.lm._layout import devices_needed, process_layout
from eqx_diloco.lm._preflight import RunDirLock, check_run_dir_free
from eqx_diloco.lm._stderr_guard import filter_lines
from eqx_diloco.lm.config import Config, DiLoCoConfig, DistributedConfig
from eqx_diloco.lm.export import restore_global_model
from test_cli import TINY
from util import read_metrics, train_losses

SBATCH = ROOT / "examples" / "slurm" / "diloco.sbatch"
MPIRUN = ROOT / "examples" / "openmpi" / "run.sh"
JOBSET = ROOT / "examples" / "k8s" / "jobset.yaml"


def _set(monkeypatch, variables: dict[str, str]) -> None:
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_COORDINATOR_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


# -- detection (flags, JAX_* variables, cluster) ------------------------------------------------

def test_slurm_task_joins_its_job(monkeypatch):
    _set(monkeypatch, slurm_env(1234, 4, 2))
    layout = process_layout(Config(diloco=DiLoCoConfig(num_replicas=4)))
    assert (layout.num_processes, layout.process_id) == (4, 2)
    assert layout.coordinator == f"localhost:{61440 + 1234}"  # JAX's own rule: the first node, a port from the id
    assert layout.cluster.name == "slurm" and layout.job == "slurm job 1234 step 0"


def test_open_mpi_rank_joins_its_job(monkeypatch):
    _set(monkeypatch, ompi_env(77, 2, 1))
    layout = process_layout(Config())
    assert (layout.coordinator, layout.num_processes, layout.process_id) == (f"127.0.0.1:{61440 + 77}", 2, 1)
    assert layout.cluster.name == "ompi"


def test_cluster_none_flags_and_jax_variables_come_first(monkeypatch):
    _set(monkeypatch, slurm_env(1234, 4, 2))
    single = process_layout(Config(dist=DistributedConfig(cluster="none")))
    assert (single.coordinator, single.num_processes, single.process_id, single.cluster) == (None, 1, 0, None)
    flags = process_layout(Config(dist=DistributedConfig(coordinator_address="h:1", num_processes=2, process_id=1)))
    assert (flags.coordinator, flags.num_processes, flags.process_id, flags.cluster) == ("h:1", 2, 1, None)
    monkeypatch.setenv("JAX_NUM_PROCESSES", "3")  # any JAX_* variable of the three: the run is described by them
    assert process_layout(Config()).num_processes == 3 and process_layout(Config()).cluster is None


def test_no_cluster_no_flags_is_one_process(monkeypatch):
    _set(monkeypatch, {})
    layout = process_layout(Config())
    assert (layout.coordinator, layout.num_processes, layout.process_id, layout.cluster) == (None, 1, 0, None)


def test_a_one_task_allocation_is_a_single_process_run(monkeypatch):
    _set(monkeypatch, slurm_env(1234, 1, 0))  # sbatch without srun, or srun -n 1
    assert process_layout(Config()).cluster is None


def test_replicas_that_do_not_split_over_the_tasks_name_the_cluster(monkeypatch):
    _set(monkeypatch, slurm_env(1234, 3, 0))
    with pytest.raises(ConfigError, match=r"--diloco.num-replicas and the process count 3 \(from --dist.num-processes, "
                                          r"here from slurm through JAX's cluster detection; got 2 replicas\) must "
                                          r"divide one another"):
        devices_needed(Config())


def test_islands_over_several_tasks_take_an_equal_share_of_their_devices(monkeypatch):
    from eqx_diloco.lm.config import MeshConfig

    _set(monkeypatch, slurm_env(1234, 4, 1))  # 4 tasks, 2 islands: each island over 2 tasks
    assert devices_needed(Config(mesh=MeshConfig(fsdp=2, tensor=2))) == 2
    assert island_map(2, 4) == "replica 0 on processes 0-1, replica 1 on processes 2-3"
    with pytest.raises(ConfigError, match=r"^an island spanning 2 processes \(2 replicas on 4\) needs --mesh.data x "
                                          r"--mesh.fsdp x --mesh.tensor divisible by 2 \(got 1\)$"):
        devices_needed(Config())


def test_unreadable_cluster_variables_are_one_line_naming_the_flags(monkeypatch):
    _set(monkeypatch, {**slurm_env(1234, 2, 0), "SLURM_NTASKS": "two"})
    with pytest.raises(ConfigError, match=r"^JAX's cluster detection found slurm, but cannot read its job "
                                          r"\(ValueError: .*\); pass the --dist.\* flags, or --dist.cluster none"):
        process_layout(Config())


@pytest.mark.parametrize(("variable", "value", "says"), [
    ("SLURM_NTASKS", "0", "0 processes and this is process 0"),  # CL04: ran as a single process
    ("SLURM_NTASKS", "-3", "-3 processes and this is process 0"),  # CL05
    ("SLURM_PROCID", "5", "2 processes and this is process 5"),
])
def test_a_job_of_no_processes_or_an_id_outside_it_is_one_line(monkeypatch, variable, value, says):
    _set(monkeypatch, {**slurm_env(1234, 2, 0), variable: value})
    with pytest.raises(ConfigError) as error:
        process_layout(Config())
    assert str(error.value) == (f"JAX's cluster detection found slurm, but its job says {says} (a job has >= 1 "
                                f"processes, numbered from 0); pass the --dist.* flags, or --dist.cluster none for a "
                                f"single process")


def test_the_island_map_is_contiguous():
    assert island_map(4, 2) == "replicas 0-1 on process 0, replicas 2-3 on process 1"
    assert island_map(2, 2) == "replica 0 on process 0, replica 1 on process 1"


# What a surviving process's runtime wrote when its peer was SIGKILLed (the kill test below, before the guard).
RUNTIME_REPORT = """\
E1205 10:50:31.111847    9788 coordination_service.cc:1549] [6339535226869522165] Use error polling to propagate \
the following error to all tasks: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):
1
The tasks have crashed. Check the task logs for an earlier error. [type.googleapis.com/tensorflow.CoordinationServiceError='']
E1205 10:50:31.112559    9799 coordination_service_agent.cc:289] Polled an error from coordination service.
F1205 10:50:31.112663    9799 client.h:80] Terminating process because the JAX distributed service detected fatal \
errors. This most likely indicates that another task died. absl::Status: UNAVAILABLE: The following tasks are \
unhealthy (stopped sending heartbeats):
1
The tasks have crashed. Check the task logs for an earlier error.

RPC: /xla.coordination.CoordinationService/PollForError [type.googleapis.com/tensorflow.CoordinationServiceError='']
"""


def test_the_runtimes_report_of_a_lost_peer_becomes_one_line():
    lines = RUNTIME_REPORT.splitlines(keepends=True)
    assert list(filter_lines(lines, 0, 2, 10)) == [
        "error: process 0 of 2 stopped: process 1 sent no heartbeat for 10 s (--dist.heartbeat-timeout-s); the JAX "
        "distributed runtime ends every process of the run then (see the other processes' logs for why one died)\n"]
    # The trainer's own line, before or after the report, is the one line; other output passes untouched.
    ours = "error: saving checkpoint 4 failed (JaxRuntimeError: INTERNAL: Barrier failed)\n"
    other = ["W1205 10:50:30.000000    9788 cpu_client.cc:12] not the distributed runtime\n", "some output\n"]
    assert list(filter_lines([*other, *lines, ours], 0, 2, 10)) == [*other, ours]
    assert list(filter_lines([ours, *lines], 0, 2, 10)) == [ours]
    assert list(filter_lines(lines[:4], 1, 2, 10)) == []  # reports without the abort: dropped, nothing added
    # The abort's native stack trace, written while the trainer wrote its line: frames after that line,
    # or one at its very end, are the runtime's too.
    trace = ["*** Check failure stack trace: ***\n", "    @     0x7f13748eb505  std::_Function_handler<>::_M_invoke()\n",
             "    @     0x7f137489a82e  absl::log_internal::LogMessageFatal::~LogMessageFatal()\n"]
    assert list(filter_lines([*lines, ours, *trace], 0, 2, 10)) == [ours]
    assert list(filter_lines([*lines, ours.rstrip("\n") + trace[1], *trace[2:]], 0, 2, 10)) == [ours]
    assert list(filter_lines([*trace, "some output\n"], 0, 2, 10)) == [*trace, "some output\n"]  # no runtime record


# -- the run folder -------------------------------------------------------------------------------

def test_the_processes_of_the_locking_job_pass_and_another_jobs_are_refused(tmp_path):
    run = tmp_path / "run"
    with RunDirLock(run, job="slurm job 1 step 0"):
        check_run_dir_free(run, job="slurm job 1 step 0")
        with pytest.raises(ConfigError, match=rf"^--run-dir {run} is in use by another trainer \(pid {os.getpid()} "):
            check_run_dir_free(run, job="slurm job 2 step 0")
    check_run_dir_free(run, job="slurm job 2 step 0")  # released: free for anyone
    with RunDirLock(run, job="slurm job 2 step 0"):  # and check_run_dir_free left no lock behind
        pass


# -- examples -------------------------------------------------------------------------------------

def test_jobset_sets_what_the_trainer_reads():
    """The JobSet's pods name process 0 by the DNS name JobSet gives it, count as many processes as the
    Job runs pods, take their id from the completion index, and share one mounted run folder."""
    jobset = yaml.safe_load(JOBSET.read_text())
    assert jobset["apiVersion"].startswith("jobset.x-k8s.io/") and jobset["kind"] == "JobSet"
    name, network = jobset["metadata"]["name"], jobset["spec"]["network"]
    assert network["enableDNSHostnames"] is True
    (replicated,) = jobset["spec"]["replicatedJobs"]
    assert replicated["replicas"] == 1
    job = replicated["template"]["spec"]
    assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"]
    pod = job["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    host, port = env["JAX_COORDINATOR_ADDRESS"]["value"].rsplit(":", 1)
    assert host == f"{name}-{replicated['name']}-0-0.{network.get('subdomain', name)}"
    assert int(port) in [p["containerPort"] for p in container["ports"]]
    assert int(env["JAX_NUM_PROCESSES"]["value"]) == job["parallelism"]
    assert env["JAX_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    command = container["command"]
    assert command[:3] == ["python", "-m", "eqx_diloco.train"]
    replicas = int(command[command.index("--diloco.num-replicas") + 1])
    assert replicas % job["parallelism"] == 0
    run_dir = command[command.index("--run-dir") + 1]
    mounts = [m["mountPath"] for m in container["volumeMounts"]]
    assert any(run_dir.startswith(m.rstrip("/") + "/") for m in mounts)
    claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert claims
    from eqx_diloco.lm.train import main  # the command's flags parse (a bad one exits 2 before anything runs)

    with pytest.raises(SystemExit) as exit_:
        main([*command[3:], "--help"])
    assert exit_.value.code == 0


# -- emulated jobs (subprocesses) -----------------------------------------------------------------

STEPS = 12
FLAGS = [*TINY, "--train.steps", str(STEPS), "--train.log-every", "1", "--diloco.sync-period", "3",
         "--checkpoint.every", "4", "--train.eval-every", "6"]
# The kill test's heartbeat timeout (the default is 30 s). Not used elsewhere: 4 processes compiling on 2 busy cores
# (another test file on the other xdist worker) can miss 10 s of heartbeats, and the runtime then ends the run.
HEARTBEAT_S = 10


def _launcher_run(run_dir, num_processes: int) -> None:
    cmd = [sys.executable, "-m", "eqx_diloco.launch", "--num-processes", str(num_processes), "--",
           *FLAGS, "--diloco.num-replicas", str(num_processes), "--run-dir", str(run_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def launcher_runs(tmp_path_factory):
    """{process count: run folder} of the local launcher with the same flags, made when first asked for."""
    runs = {}

    def get(num_processes: int):
        if num_processes not in runs:
            runs[num_processes] = tmp_path_factory.mktemp(f"launcher{num_processes}") / "run"
            _launcher_run(runs[num_processes], num_processes)
        return runs[num_processes]

    return get


def _job(kind: str, num_processes: int, run_dir, logs):
    job = free_job_id()
    if kind == "slurm":
        variables = {"RUN_DIR": str(run_dir), "SLURM_JOB_NUM_NODES": str(num_processes), "@": FLAGS}
        envs = [slurm_env(job, num_processes, i) for i in range(num_processes)]
        return start_tasks(launch_line(SBATCH, "srun", variables), envs, logs)
    variables = {"RUN_DIR": str(run_dir), "NP": str(num_processes), "@": FLAGS}
    envs = [ompi_env(job, num_processes, i) for i in range(num_processes)]
    return start_tasks(launch_line(MPIRUN, "mpirun", variables), envs, logs)


def _assert_same_run(got, expected) -> None:
    steps = [r["step"] for r in read_metrics(got) if "loss" in r]
    assert steps == list(range(1, STEPS + 1))  # each step logged once
    np.testing.assert_allclose(train_losses(got), train_losses(expected), rtol=1e-6)
    got_model, _, got_step = restore_global_model(got)
    expected_model, _, expected_step = restore_global_model(expected)
    assert got_step == expected_step == STEPS
    for a, b in zip(jax.tree.leaves(got_model), jax.tree.leaves(expected_model), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # 2 tasks each: a 4-process run is test_multiprocess's (the launcher's), and a job's tasks differ
@pytest.mark.parametrize(("kind", "num_processes"), [("slurm", 2), ("ompi", 2)])  # only in their own variables
def test_the_examples_launch_line_runs_one_job_equal_to_the_launcher(tmp_path, launcher_runs, kind, num_processes):
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    codes = wait_all(_job(kind, num_processes, run_dir, logs), logs)
    assert codes == [0] * num_processes, [(logs / f"task{i}.err").read_text()[-2000:] for i in range(num_processes)]
    banner = (logs / "task0.out").read_text()
    assert f"{num_processes} processes ({kind} job " in banner and "found by JAX's cluster detection" in banner
    assert f"replica {num_processes - 1} on process {num_processes - 1}" in banner
    assert all(not (logs / f"task{i}.out").read_text().strip() for i in range(1, num_processes))  # process 0 speaks
    _assert_same_run(run_dir, launcher_runs(num_processes))


def _checkpoints(run_dir) -> list[int]:
    folder = run_dir / "checkpoints"
    return sorted(int(p.name) for p in folder.glob("*") if p.name.isdigit()) if folder.exists() else []


@pytest.mark.slow
def test_a_killed_task_stops_the_job_with_one_line_and_a_rerun_resumes_to_the_same_end(tmp_path, launcher_runs):
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    slow = ["--train.steps", "100000", "--dist.heartbeat-timeout-s", str(HEARTBEAT_S)]  # stopped by the kill
    job = free_job_id()
    variables = {"RUN_DIR": str(run_dir), "SLURM_JOB_NUM_NODES": "2", "@": [*FLAGS, *slow]}
    tasks = start_tasks(launch_line(SBATCH, "srun", variables), [slurm_env(job, 2, i) for i in range(2)], logs)
    try:
        deadline = time.monotonic() + 300
        while not _checkpoints(run_dir):
            assert all(t.poll() is None for t in tasks) and time.monotonic() < deadline, \
                (logs / "task0.err").read_text()[-2000:]
            time.sleep(0.01)
        tasks[1].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        code = tasks[0].wait(timeout=HEARTBEAT_S + 10 + 30)
        took = time.monotonic() - killed_at
    finally:
        for t in tasks:
            t.kill()
            t.wait()
    err = (logs / "task0.err").read_text().strip().splitlines()
    assert code != 0 and took < HEARTBEAT_S + 10, (code, took, err[-5:])
    assert len(err) == 1 and err[0].startswith("error: "), err
    saved = _checkpoints(run_dir)
    assert saved

    # Resubmitted (a requeue runs the same script again, with the same job id): it resumes from the last
    # checkpoint, and its end equals an uninterrupted run's.
    variables["@"] = FLAGS
    codes = wait_all(start_tasks(launch_line(SBATCH, "srun", variables), [slurm_env(job, 2, i) for i in range(2)],
                                 logs / "rerun"), logs / "rerun")
    assert codes == [0, 0], (logs / "rerun" / "task0.err").read_text()[-3000:]
    out = (logs / "rerun" / "task0.out").read_text()
    assert f"resumed from checkpoint at step {saved[-1]}" in out, out[-2000:]
    _assert_same_run(run_dir, launcher_runs(2))


@pytest.mark.slow
def test_a_second_job_on_a_folder_in_use_is_refused_and_the_first_is_untouched(tmp_path):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", ("import time; from eqx_diloco.lm._preflight import RunDirLock\n"
                                f"with RunDirLock({str(run_dir)!r}, job='slurm job 1 step 0'):\n "
                                "print('locked', flush=True); time.sleep(600)")],
        stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "locked"
        (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
        before = sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in run_dir.iterdir())
        logs = tmp_path / "logs"
        job = free_job_id()
        variables = {"RUN_DIR": str(run_dir), "SLURM_JOB_NUM_NODES": "2", "@": FLAGS}
        tasks = start_tasks(launch_line(SBATCH, "srun", variables), [slurm_env(job, 2, i) for i in range(2)], logs)
        assert wait_all(tasks, logs, timeout=60) == [2, 2]
        for i in range(2):
            assert (logs / f"task{i}.err").read_text().strip().splitlines() == [
                f"error: --run-dir {run_dir} is in use by another trainer (pid {holder.pid} on {os.uname().nodename})"]
        assert sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in run_dir.iterdir()) == before
    finally:
        holder.kill()
        holder.communicate(timeout=10)
