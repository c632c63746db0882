"""The launcher's supervision, with a stand-in child (`launch_child.py`) so no JAX program runs:
signals are forwarded and nothing is left running, the first real failure is blamed, and a
default log folder lives only as long as it explains something."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).parent

pytestmark = pytest.mark.slow  # every test here starts processes
_launchers: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _stop_launchers_left_running():
    """A failed test leaves its launcher (and the launcher's children) running and its pipes open, which
    shows up as a warning in whichever test runs next: stop it here (SIGTERM reaches its children)."""
    yield
    while _launchers:
        proc = _launchers.pop()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def _alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped does not count)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _start(tmp_path, modes: list[str], *launcher_flags: str) -> tuple[subprocess.Popen, Path]:
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    env = dict(os.environ, LAUNCH_CHILD_DIR=str(pid_dir), LAUNCH_CHILD_MODES=",".join(modes),
               PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]), TMPDIR=str(tmp_path))
    cmd = [sys.executable, "-m", "eqx_diloco.launch", "--num-processes", str(len(modes)), "--module", "launch_child",
           *launcher_flags]
    _launchers.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return _launchers[-1], pid_dir


def _child_pids(proc: subprocess.Popen, pid_dir: Path, n: int, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while not all((pid_dir / f"pid_{i}").exists() for i in range(n)):  # not pid_<i>.tmp: it is renamed when written
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the children did not start"
        time.sleep(0.05)
    return [int((pid_dir / f"pid_{i}").read_text()) for i in range(n)]


def _assert_gone(pids: list[int], within: float) -> None:
    deadline = time.monotonic() + within
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, f"still running: {[p for p in pids if _alive(p)]}"
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda s: s.name)
def test_signal_to_the_launcher_reaches_every_process_and_leaves_none(tmp_path, sig):
    proc, pid_dir = _start(tmp_path, ["sleep", "sleep"])
    pids = _child_pids(proc, pid_dir, 2)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 128 + sig, err
    _assert_gone(pids, within=5)
    assert f"got {sig.name}" in err


def test_processes_that_ignore_sigterm_are_killed_after_the_grace_period(tmp_path):
    proc, pid_dir = _start(tmp_path, ["ignore", "ignore"], "--grace-s", "1")
    pids = _child_pids(proc, pid_dir, 2)
    time.sleep(0.3)  # let them install their handlers
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=20)
    assert proc.returncode == 128 + signal.SIGTERM
    _assert_gone(pids, within=5)
    assert time.monotonic() - sent < 10


def test_processes_die_with_a_killed_launcher(tmp_path):
    proc, pid_dir = _start(tmp_path, ["ignore", "ignore"])
    pids = _child_pids(proc, pid_dir, 2)
    proc.kill()  # the launcher gets no chance to clean up: PR_SET_PDEATHSIG must do it
    proc.communicate(timeout=10)
    _assert_gone(pids, within=10)


def test_a_frozen_process_is_blamed_not_the_one_that_gave_up_on_it(tmp_path):
    proc, pid_dir = _start(tmp_path, ["fail", "freeze"], "--grace-s", "2")
    pids = _child_pids(proc, pid_dir, 2)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1, err
    assert "process 1 of 2 was stopped (frozen); process 0 exited with code 3" in err, err
    _assert_gone(pids, within=5)


def test_the_process_jax_reports_as_silent_is_blamed(tmp_path):
    proc, pid_dir = _start(tmp_path, ["gave-up-on-1", "sleep"])
    pids = _child_pids(proc, pid_dir, 2)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1, err
    assert "process 1 of 2 stopped sending heartbeats" in err, err
    _assert_gone(pids, within=5)


def test_a_failing_process_is_blamed_and_its_logs_are_kept(tmp_path):
    proc, pid_dir = _start(tmp_path, ["sleep", "fail"])
    _child_pids(proc, pid_dir, 2)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1, err
    assert "process 1 of 2 exited with code 3" in err, err
    kept = list(tmp_path.glob("eqx_diloco_launch_*"))
    assert len(kept) == 1 and f"logs are in {kept[0]}" in err
    assert sorted(p.name for p in kept[0].iterdir()) == ["process_0.log", "process_1.log"]


def test_default_log_folder_is_removed_after_success(tmp_path):
    proc, pid_dir = _start(tmp_path, ["ok", "ok", "ok"])
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert len(list(pid_dir.glob("pid_[0-9]*"))) == 3
    assert not list(tmp_path.glob("eqx_diloco_launch_*"))


def test_a_given_log_folder_is_kept_after_success(tmp_path):
    proc, _ = _start(tmp_path, ["ok", "ok"], "--log-dir", str(tmp_path / "logs"))
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert (tmp_path / "logs" / "process_1.log").exists()


def test_elastic_stops_with_one_line_below_min_replicas_and_leaves_nothing_running(tmp_path):
    proc, pid_dir = _start(tmp_path, ["sleep", "fail"], "--", "--elastic.enabled", "--elastic.min-replicas", "2",
                           "--run-dir", str(tmp_path / "run"))
    pids = _child_pids(proc, pid_dir, 2)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    lines = [line for line in err.splitlines() if line.startswith("launcher: error")]
    assert len(lines) == 1 and "island 1 exited with code 3" in lines[0], err
    assert "below --elastic.min-replicas 2" in lines[0]
    assert not any(_alive(pid) for pid in pids)


def test_elastic_run_fails_when_every_island_fails_alike(tmp_path):
    """A refused flag or a divergence fails every island the same way: the run's failure, not a loss."""
    proc, pid_dir = _start(tmp_path, ["fail", "fail", "fail"], "--max-restarts", "2", "--",
                           "--elastic.enabled", "--run-dir", str(tmp_path / "run"))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    assert "every island exited with code 3" in err and "re-forming" not in err, err


def test_elastic_loss_reforms_with_the_others(tmp_path):
    """Island 1 fails; the launcher starts a generation of islands 0 and 2 (their pid files are rewritten)."""
    proc, pid_dir = _start(tmp_path, ["sleep", "fail", "sleep"], "--grace-s", "5", "--",
                           "--elastic.enabled", "--run-dir", str(tmp_path / "run"))
    first = _child_pids(proc, pid_dir, 3)
    deadline = time.monotonic() + 60
    while not all((pid_dir / f"pid_{i}").read_text() != str(first[i]) for i in (0, 2)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    second = [int((pid_dir / f"pid_{i}").read_text()) for i in (0, 2)]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert "island 1 exited with code 3" in err and "re-forming with islands [0, 2]" in err, err
    assert proc.returncode == 128 + signal.SIGTERM
    assert not any(_alive(pid) for pid in first + second)


# -- who failed first: the failure markers (`launch_marker_child.py`) -----------------------------

def _start_marked(tmp_path, plan: list[str], *launcher_flags: str) -> subprocess.Popen:
    """Processes that record failure times (relative to a moment 4 s ahead, time to start) and exit as `plan`
    says (see launch_marker_child.py)."""
    env = dict(os.environ, MARKER_CHILD_PLAN=";".join(plan), MARKER_CHILD_T0=str(time.time() + 4),
               PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]), TMPDIR=str(tmp_path))
    cmd = [sys.executable, "-m", "eqx_diloco.launch", "--num-processes", str(len(plan)), "--module",
           "launch_marker_child", *launcher_flags]
    _launchers.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return _launchers[-1]


def test_the_process_that_failed_first_is_blamed_not_the_first_to_exit(tmp_path):
    """Process 1 fails first (its marker says when) and is still on its way out when process 0, which ran
    into that failure a second later, exits. Blaming the first exit named the healthy process 0."""
    proc = _start_marked(tmp_path, ["1,1,lost contact with process 1", "0,30,No space left on device: run/x"],
                         "--log-dir", str(tmp_path / "logs"))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert "error: process 1 of 2 failed first (No space left on device: run/x); stopped the other" in err, err
    assert not list((tmp_path / "logs").glob("*.failed"))  # read, then removed: the logs say the same


def test_elastic_drops_the_island_that_failed_first(tmp_path):
    """The same under the elastic launcher: island 1, not island 0 (the first to exit), is the one lost."""
    proc = _start_marked(tmp_path, ["1,1,lost contact with process 1", "0,30,Permission denied: island-1/x"],
                         "--grace-s", "5", "--", "--elastic.enabled", "--elastic.min-replicas", "2",
                         "--run-dir", str(tmp_path / "run"))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert "launcher: error: island 1 failed (Permission denied: island-1/x)" in err, err
    assert "below --elastic.min-replicas 2" in err


@pytest.mark.parametrize("alike", [True, False], ids=["same-error", "different-errors"])
def test_elastic_islands_failing_alike_end_the_run_others_are_a_loss(tmp_path, alike):
    """Every island exits 1. With the same error (up to the numbers each names: its own folder) it is the run's
    failure; when one island's error is what the other ran into, it is a loss and the run re-forms."""
    other = "Permission denied: island-0/x" if alike else "lost contact with process 1"
    proc = _start_marked(tmp_path, [f"0.5,0.5,{other}", "0,0.5,Permission denied: island-1/x"],
                         "--grace-s", "5", "--", "--elastic.enabled", "--run-dir", str(tmp_path / "run"))
    _, err = proc.communicate(timeout=90)
    if alike:
        assert proc.returncode == 1 and "every island exited with code 1" in err, err
    else:
        assert "island 1 exited with code 1 at step -1; re-forming with islands [0]" in err, err


def _can_make_network_namespaces() -> bool:
    from eqx_diloco.lm.launch import LinkLimit

    if LinkLimit.check() is not None:
        return False
    name = f"eqxdprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, check=False).returncode == 0
    subprocess.run(["ip", "netns", "delete", name], capture_output=True, check=False)
    return made


@pytest.mark.skipif(not _can_make_network_namespaces(), reason="--bandwidth needs root, ip, tc and network namespaces")
def test_the_processes_learn_the_link_limit(tmp_path):
    """--bandwidth used to leave no trace on screen: the processes now get the rate (for the setup lines)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "eqx_diloco.launch", "--num-processes", "1", "--bandwidth", "800mbit",
                           "--module", "launch_env_child"], env=env, capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 0 and "link=800mbit" in proc.stderr, proc.stderr


def _child_cpus(tmp_path, *launcher_flags: str) -> list[tuple[set[int], str]]:
    """Each process's CPUs, and what it was told in $EQX_DILOCO_COMPILE_CPUS (one is already set here)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
               EQX_DILOCO_COMPILE_CPUS="7")
    logs = tmp_path / "logs"
    proc = subprocess.run([sys.executable, "-m", "eqx_diloco.launch", "--num-processes", "2", "--log-dir", str(logs),
                           *launcher_flags, "--module", "launch_env_child"], env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    found = []
    for i in range(2):
        lines = (logs / f"process_{i}.log").read_text().splitlines()
        cpus = next(line for line in lines if line.startswith("cpus=")).removeprefix("cpus=")
        found.append((set(map(int, cpus.split(","))),
                      next(line for line in lines if line.startswith("compile_cpus=")).removeprefix("compile_cpus=")))
    return found


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and two CPUs")
def test_co_located_processes_get_their_own_cpus_unless_told_to_share(tmp_path):
    mine = os.sched_getaffinity(0)
    every = ",".join(map(str, sorted(mine)))
    (first, told_first), (second, told_second) = _child_cpus(tmp_path / "split")
    assert first and second and not first & second and first | second == mine
    assert told_first == told_second == every  # they compile on every CPU until their first step
    assert _child_cpus(tmp_path / "shared", "--cpus", "shared") == [(mine, "None"), (mine, "None")]


def test_cpu_shares_are_contiguous_and_as_equal_as_possible(monkeypatch):
    from eqx_diloco.lm import _processes

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11}, raising=False)
    assert _processes.cpu_shares(3) == [[0, 1, 2, 3], [4, 5, 6, 8], [9, 10, 11]]
    assert _processes.cpu_shares(11) == [[c] for c in [0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11]]
    # Fewer CPUs than processes: one CPU each, in turn (several processes on one core, one thread pool each).
    assert _processes.cpu_shares(12) == [[c] for c in [0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 0]]
    assert _processes.cpu_shares(24)[10:13] == [[11], [0], [1]]
    assert _processes.cpu_shares(1) is None
