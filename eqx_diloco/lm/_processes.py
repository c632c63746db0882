"""Process utilities shared by the launchers (`launch` for one run, `elastic` for generations of
islands): spawning a run's processes with a fresh coordinator port and process 0's stderr teed,
the rate-limited link, the failure markers that say which process failed first, signal records,
and stopping process groups. It starts no process and imports nothing heavy, so the trainer imports
`record_failure` from here within a second of starting."""

import collections
import contextlib
import ctypes
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ._compile_cpus import COMPILE_CPUS_ENV


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Set by the launcher for its processes with --bandwidth: the rate, which the trainer's banner shows.
LINK_LIMIT_ENV = "EQX_DILOCO_LINK_LIMIT"
# Set by the elastic launcher: the generation's number (0 for the first), which the trainer's end-of-run
# summary reads: after a re-form its own time and token count cover that generation only, and the
# launcher sums up every generation.
GENERATION_ENV = "EQX_DILOCO_GENERATION"


class LinkLimit:
    """A network namespace whose loopback is shaped to `rate` (e.g. "800mbit"); removed on exit."""

    def __init__(self, rate: str):
        self.rate = rate
        self.name = f"eqxd{os.getpid()}"

    @staticmethod
    def check() -> str | None:
        """Why a limited link can't be set up here, or None if it can."""
        if os.geteuid() != 0:
            return "--bandwidth needs root to create a network namespace (run as root, or drop --bandwidth)"
        missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
        if missing:
            return f"--bandwidth needs the {' and '.join(missing)} command (package iproute2)"
        return None

    def __enter__(self) -> list[str]:
        run = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True, text=True)
        try:
            run("ip", "netns", "add", self.name)
            run("ip", "netns", "exec", self.name, "ip", "link", "set", "lo", "up")
            # A small tbf `limit` makes gloo time out; 64 MB of queue is enough for bursts.
            run("ip", "netns", "exec", self.name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
                "rate", self.rate, "burst", "256kb", "limit", "64mb")
        except subprocess.CalledProcessError as e:
            self.__exit__()
            raise SystemExit(f"error: --bandwidth {self.rate}: could not set up the link: {e.stderr.strip()}")
        return ["ip", "netns", "exec", self.name]

    def __exit__(self, *exc) -> None:
        subprocess.run(["ip", "netns", "delete", self.name], capture_output=True)


# -- failure markers: which process failed first ------------------------------------------
# A process that fails on its own (a disk error, Ctrl-C, a bug) makes the others fail too, a
# moment later, when they lose contact with it. Which one exits first says little: the one that
# failed may still be flushing its output while another already gave up on it. So each process
# writes, at the moment it fails, the time and its one-line error to the file the launcher names
# in this variable; the launcher blames the earliest.

FAILURE_FILE_ENV = "EQX_DILOCO_FAILURE_FILE"


def record_failure(code: int, message: str) -> None:
    """Tell the launcher (if one set `$EQX_DILOCO_FAILURE_FILE`) that this process fails now, and why.

    Only the first failure of a process is kept. Never raises: on a full disk the launcher falls
    back to the order in which the processes exited."""
    path = os.environ.get(FAILURE_FILE_ENV)
    if not path or os.path.exists(path):
        return
    try:
        with open(f"{path}.tmp", "w") as f:
            json.dump({"time": time.time(), "code": code, "error": message}, f)
        os.replace(f"{path}.tmp", path)
    except OSError:
        pass


def read_failure(path: Path) -> dict | None:
    """The marker `record_failure` wrote at `path` ({"time", "code", "error"}), or None."""
    try:
        marker = json.loads(path.read_text())
        return marker if isinstance(marker, dict) and isinstance(marker.get("time"), (int, float)) else None
    except (OSError, ValueError):
        return None


def first_failure(procs: list[subprocess.Popen], exited_at: dict[int, float], markers: list[Path],
                  frozen: Sequence[int] = (), ok: tuple[int, ...] = (0,)) -> int | None:
    """The index of the process that failed first, or None if none failed.

    In order: a frozen process (the others gave up waiting on it); one killed by a signal from
    outside (SIGABRT is JAX giving up on a lost peer, so it does not count); then the earliest time
    of failure, from the process's marker if it wrote one (it may still be running), else from
    when its exit with a code not in `ok` was seen (`exited_at`, wall-clock times).
    """
    if frozen:
        return frozen[0]
    codes = [p.poll() for p in procs]
    killed = [i for i, c in enumerate(codes) if c is not None and c < 0 and c != -signal.SIGABRT]
    if killed:
        return min(killed, key=lambda i: exited_at.get(i, math.inf))
    times = {i: m["time"] for i, path in enumerate(markers) if (m := read_failure(path)) is not None}
    for i, c in enumerate(codes):
        if c is not None and c not in ok and i not in times:
            times[i] = exited_at.get(i, time.time())
    return min(times, key=lambda i: (times[i], i)) if times else None


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


PR_SET_PDEATHSIG = 1


def _die_with_launcher() -> Callable[[], None] | None:
    """A `preexec_fn` that makes the child get SIGKILL when the launcher dies (Linux only).

    Covers the one case the launcher cannot handle itself: being killed with SIGKILL.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child only calls it
    except (OSError, AttributeError):
        return None
    launcher = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != launcher:  # the launcher died before prctl took effect
            os._exit(1)

    return preexec


def cpu_shares(num_processes: int) -> list[list[int]] | None:
    """This machine's CPUs (those the launcher may use) cut into `num_processes` contiguous shares,
    as equal as possible; with fewer CPUs than processes, one CPU each, taken in turn (process i on
    CPU i mod C). None for one process, or where this platform has no CPU affinity.

    Co-located processes that each size their thread pools to the whole machine oversubscribe it:
    XLA's CPU client starts a pool as large as the CPUs a process may use, so N processes on C cores
    run N x C compute threads. With a share each, a process's pools match its share and its threads
    stay on its cores. Where processes outnumber the cores this matters most: a step's work is split
    over the pool's threads and waits for the last of them, and with every core oversubscribed one
    of them is often descheduled, which stretched a step of decoupled islands sharing two cores to
    ten times its median and more (`benchmarks/decoupled.py`)."""
    if num_processes < 2 or not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < num_processes:
        return [[cpus[i % len(cpus)]] for i in range(num_processes)]
    base, extra = divmod(len(cpus), num_processes)
    bounds = [i * base + min(i, extra) for i in range(num_processes + 1)]
    return [cpus[bounds[i]:bounds[i + 1]] for i in range(num_processes)]


def _pinned(preexec: Callable[[], None] | None, cpus: list[int] | None) -> Callable[[], None] | None:
    """`preexec`, then (in the child, before it starts a thread) keep it on `cpus`."""
    if cpus is None:
        return preexec

    def pin() -> None:
        if preexec is not None:
            preexec()
        os.sched_setaffinity(0, cpus)

    return pin


def signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_all(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """SIGTERM every running process group, SIGKILL what is left after `grace_s`, reap all."""
    for p in procs:
        if p.poll() is None:
            signal_group(p, signal.SIGTERM)
            signal_group(p, signal.SIGCONT)  # a stopped process acts on SIGTERM only once continued
    wait_or_kill(procs, grace_s)


def wait_or_kill(procs: list[subprocess.Popen], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            signal_group(p, signal.SIGKILL)
            p.wait()


def is_stopped(pid: int) -> bool:
    """Whether `pid` is stopped (SIGSTOP, a debugger): alive but frozen."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("T", "t")


class Tee(threading.Thread):
    """Copies a child's stderr to ours and to its log file, keeping the last lines."""

    def __init__(self, pipe, log: Path, mode: str = "w"):
        super().__init__(daemon=True)
        self.pipe, self.log, self.mode = pipe, log, mode
        self.lines: collections.deque[str] = collections.deque(maxlen=400)

    def run(self) -> None:
        with self.log.open(self.mode) as f:
            for line in iter(self.pipe.readline, ""):
                sys.stderr.write(line)
                sys.stderr.flush()
                f.write(line)
                f.flush()
                self.lines.append(line)

    def text(self) -> str:
        return "".join(self.lines)


class LauncherSignals:
    """Records SIGINT, SIGTERM and SIGHUP for the launcher's loop (restores the old handlers on exit)."""

    HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self):
        self.received: list[int] = []

    def __enter__(self) -> "LauncherSignals":
        self._old = {s: signal.signal(s, lambda signum, frame: self.received.append(signum)) for s in self.HANDLED}
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)


def link(bandwidth: str | None) -> contextlib.AbstractContextManager[list[str]]:
    """The command prefix that runs a process on the rate-limited link (none without `bandwidth`)."""
    return LinkLimit(bandwidth) if bandwidth else contextlib.nullcontext([])


def link_env(bandwidth: str | None) -> dict[str, str]:
    """The variables that tell the processes about the limited link (none without `bandwidth`)."""
    return {LINK_LIMIT_ENV: bandwidth} if bandwidth else {}


def failure_markers(log_dir: Path, name: str, indices) -> list[Path]:
    """Where each process writes its failure marker (`record_failure`); any left by an earlier run
    in the same log folder are removed, so they cannot be taken for this run's."""
    markers = [log_dir / f"{name}_{i}.failed" for i in indices]
    for marker in markers:
        marker.unlink(missing_ok=True)
    return markers


def spawn(
    num_processes: int,
    flags: list[str],
    *,
    module: str,
    prefix: list[str],
    logs: list[Path],
    env: list[dict[str, str]] | None = None,
    log_mode: str = "w",
    split_cpus: bool = False,
) -> tuple[list[subprocess.Popen], Tee]:
    """Start the processes of one multi-process run (a fresh coordinator port) and tee process 0's stderr.

    `env` adds variables per process; `log_mode` "a" appends to the logs (elastic generations);
    `split_cpus` gives each process its own share of the CPUs (`cpu_shares`), where they split.
    """
    port = free_port()
    preexec = _die_with_launcher()
    shares = cpu_shares(num_processes) if split_cpus else None
    # Pinned processes compile on all of these CPUs before their first step (see _compile_cpus).
    widen = {COMPILE_CPUS_ENV: ",".join(str(c) for c in sorted({c for share in shares for c in share}))} if shares else {}
    procs = []
    for i in range(num_processes):
        # Process 0's coordination service (no authentication) listens on the loopback interface only.
        variables = dict(os.environ, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                         JAX_COORDINATOR_BIND_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(num_processes),
                         JAX_PROCESS_ID=str(i), PYTHONUNBUFFERED="1", **widen, **(env[i] if env else {}))
        if not shares:
            variables.pop(COMPILE_CPUS_ENV, None)  # not pinned here: nothing to widen
        # Process 0's stdout is this terminal (progress bar); its stderr is copied here
        # and to its log, so the launcher can read why it failed. The others log to files.
        out = None if i == 0 else logs[i].open(log_mode)
        cmd = [*prefix, sys.executable, "-m", module, *flags]
        procs.append(subprocess.Popen(
            cmd, env=variables, stdout=out, stderr=subprocess.PIPE if i == 0 else subprocess.STDOUT,
            start_new_session=True, preexec_fn=_pinned(preexec, shares[i] if shares else None), text=i == 0,
            errors="replace" if i == 0 else None,
        ))
        if out is not None:
            out.close()
    # Threads only after the last fork: preexec_fn is not safe while other threads run.
    tee = Tee(procs[0].stderr, logs[0], log_mode)
    tee.start()
    return procs, tee


def flag_value(flags: list[str], name: str) -> str | None:
    """The value of trainer flag `name` (`--x.y v` or `--x.y=v`) among `flags`, or None."""
    value = None
    for i, flag in enumerate(flags):
        key, eq, inline = flag.partition("=")
        if key.replace("_", "-") == name:
            value = inline if eq else (flags[i + 1] if i + 1 < len(flags) else None)
    return value
