"""`python -m eqx_diloco.launch`: start N local processes of one multi-process run.

    python -m eqx_diloco.launch --num-processes 2 -- --diloco.num-replicas 2
    python -m eqx_diloco.launch --num-processes 2 --bandwidth 800mbit -- --diloco.num-fragments 4

Every process runs `python -m eqx_diloco.train <flags>` (or `--module`) with the standard
JAX variables (coordinator 127.0.0.1:<port>, process count, process id). Process 0's
output streams to this terminal (its stderr is also logged); the others write to log files.
If any process dies, the launcher stops the rest and exits non-zero naming the process that
failed first (a frozen process rather than the one that gave up waiting on it; each trainer
records when it failed, see `record_failure`), so nothing hangs. Ctrl-C is forwarded as SIGINT,
SIGTERM and SIGHUP as SIGTERM; whatever still runs `--grace-s` seconds later is killed, and the
processes die with the launcher if it is killed outright. A default (temporary) log folder is
removed when the run succeeds, and named otherwise.

With `--elastic.enabled` among the trainer flags (one process per island), a lost island does not
stop the run: the others are re-formed into a run of their own from their newest sync boundary,
and with `--max-restarts` the island rejoins later (see `_elastic_launch`):

    python -m eqx_diloco.launch --num-processes 3 --max-restarts 2 -- --elastic.enabled

With `--bandwidth`, all processes run inside a fresh network namespace whose loopback is
rate-limited with a token bucket (`tc qdisc ... tbf`), so they talk over a slow link.
That needs root (to create the namespace); without it the launcher says so and stops.
"""

import argparse
import collections
import contextlib
import ctypes
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path


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
        run = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True, text=True)  # noqa: E731
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


def _tail(path: Path, lines: int = 15) -> str:
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


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """SIGTERM every running process group, SIGKILL what is left after `grace_s`, reap all."""
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGTERM)
            _signal_group(p, signal.SIGCONT)  # a stopped process acts on SIGTERM only once continued
    _wait_or_kill(procs, grace_s)


def _wait_or_kill(procs: list[subprocess.Popen], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()


def _stopped(pid: int) -> bool:
    """Whether `pid` is stopped (SIGSTOP, a debugger): alive but frozen."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("T", "t")


_UNHEALTHY = re.compile(r"stopped sending heartbeats\):\s*([\d,\s]+)")
_TASK = re.compile(r"Task (\d+) heartbeat timeout")


def _blamed_tasks(output: str) -> set[int]:
    """Processes that JAX's coordination service says stopped sending heartbeats, from a process's output."""
    found = set()
    for m in _UNHEALTHY.finditer(output):
        found.update(int(x) for x in re.findall(r"\d+", m.group(1)))
    found.update(int(x) for x in _TASK.findall(output))
    return found


class _Tee(threading.Thread):
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


class _Signals:
    """Records SIGINT, SIGTERM and SIGHUP for the launcher's loop (restores the old handlers on exit)."""

    HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self):
        self.received: list[int] = []

    def __enter__(self) -> "_Signals":
        self._old = {s: signal.signal(s, lambda signum, frame: self.received.append(signum)) for s in self.HANDLED}
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)


def launch(
    num_processes: int,
    flags: list[str],
    *,
    module: str,
    bandwidth: str | None,
    log_dir: Path,
    grace_s: float = 30.0,
) -> int:
    """Run the processes to the end. Returns the exit code for the launcher.

    SIGINT is forwarded as SIGINT; SIGTERM and SIGHUP are forwarded as SIGTERM (the signal
    the trainer answers by saving and stopping). Processes still running `grace_s` seconds
    later, or at a second signal, are killed. The children also die with the launcher if it
    is killed outright (PR_SET_PDEATHSIG), so none is ever left running unsupervised.
    """
    if bandwidth and (problem := LinkLimit.check()):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    with _link(bandwidth) as prefix:
        return _launch(num_processes, flags, module=module, prefix=prefix, log_dir=log_dir, grace_s=grace_s,
                       env=_link_env(bandwidth))


def _link(bandwidth: str | None) -> contextlib.AbstractContextManager[list[str]]:
    """The command prefix that runs a process on the rate-limited link (none without `bandwidth`)."""
    return LinkLimit(bandwidth) if bandwidth else contextlib.nullcontext([])


def _link_env(bandwidth: str | None) -> dict[str, str]:
    """The variables that tell the processes about the limited link (none without `bandwidth`)."""
    return {LINK_LIMIT_ENV: bandwidth} if bandwidth else {}


def _launch(num_processes: int, flags: list[str], *, module: str, prefix: list[str], log_dir: Path,
            grace_s: float, env: dict[str, str]) -> int:
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    logs = [log_dir / f"process_{i}.log" for i in range(num_processes)]
    markers = failure_markers(log_dir, "process", range(num_processes))
    env = [{**env, FAILURE_FILE_ENV: str(marker)} for marker in markers]
    tee = None
    try:
        with _Signals() as signals:
            procs, tee = spawn(num_processes, flags, module=module, prefix=prefix, logs=logs, env=env)
            return _supervise(procs, logs, markers, tee, signals, grace_s)
    finally:
        _stop(procs)
        if tee is not None:
            tee.join(timeout=5)
        for marker in markers:  # read by now; the logs say the same
            marker.unlink(missing_ok=True)


def failure_markers(log_dir: Path, name: str, indices) -> list[Path]:
    """Where each process writes its failure marker (`record_failure`); any left by an earlier run
    in the same log folder are removed, so they cannot be taken for this run's."""
    markers = [log_dir / f"{name}_{i}.failed" for i in indices]
    for marker in markers:
        marker.unlink(missing_ok=True)
    return markers


def launch_elastic(num_islands: int, flags: list[str], *, module: str, bandwidth: str | None, log_dir: Path,
                   grace_s: float, max_restarts: int, rejoin_after_s: float, drain_s: float, min_replicas: int) -> int:
    """Run one island per process; a lost island re-forms the run with the others (see `_elastic_launch`)."""
    from ._elastic_launch import ElasticLauncher, ElasticPolicy

    policy = ElasticPolicy(max_restarts=max_restarts, rejoin_after_s=rejoin_after_s, drain_s=drain_s,
                           min_replicas=min_replicas)
    run_dir = Path(_flag_value(flags, "--run-dir") or "runs/default")
    if bandwidth and (problem := LinkLimit.check()):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    log_dir.mkdir(parents=True, exist_ok=True)
    with _link(bandwidth) as prefix:
        return ElasticLauncher(num_islands, flags, module=module, prefix=prefix, log_dir=log_dir, run_dir=run_dir,
                               policy=policy, grace_s=grace_s, env=_link_env(bandwidth)).run()


def spawn(
    num_processes: int,
    flags: list[str],
    *,
    module: str,
    prefix: list[str],
    logs: list[Path],
    env: list[dict[str, str]] | None = None,
    log_mode: str = "w",
) -> tuple[list[subprocess.Popen], _Tee]:
    """Start the processes of one multi-process run (a fresh coordinator port) and tee process 0's stderr.

    `env` adds variables per process; `log_mode` "a" appends to the logs (elastic generations).
    """
    port = free_port()
    preexec = _die_with_launcher()
    procs = []
    for i in range(num_processes):
        variables = dict(os.environ, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(num_processes),
                         JAX_PROCESS_ID=str(i), PYTHONUNBUFFERED="1", **(env[i] if env else {}))
        # Process 0's stdout is this terminal (progress bar); its stderr is copied here
        # and to its log, so the launcher can read why it failed. The others log to files.
        out = None if i == 0 else logs[i].open(log_mode)
        cmd = [*prefix, sys.executable, "-m", module, *flags]
        procs.append(subprocess.Popen(
            cmd, env=variables, stdout=out, stderr=subprocess.PIPE if i == 0 else subprocess.STDOUT,
            start_new_session=True, preexec_fn=preexec, text=i == 0, errors="replace" if i == 0 else None,
        ))
        if out is not None:
            out.close()
    # Threads only after the last fork: preexec_fn is not safe while other threads run.
    tee = _Tee(procs[0].stderr, logs[0], log_mode)
    tee.start()
    return procs, tee


def _supervise(procs, logs, markers: list[Path], tee, signals: _Signals, grace_s: float) -> int:
    n = len(procs)
    exited_at: dict[int, float] = {}  # wall-clock times, comparable with the failure markers'
    forwarded_at = None
    while True:
        now = time.monotonic()
        for i, p in enumerate(procs):
            if i not in exited_at and p.poll() is not None:
                exited_at[i] = time.time()
        if signals.received:
            sig = signals.received[0]
            if forwarded_at is None:
                forward = signal.SIGINT if sig == signal.SIGINT else signal.SIGTERM
                for p in procs:
                    if p.poll() is None:
                        _signal_group(p, forward)
                forwarded_at = now
                print(f"launcher: got {signal.Signals(sig).name}, sent {forward.name} to the {n} processes "
                      f"(killing them after {grace_s:g}s)", file=sys.stderr)
            if len(signals.received) > 1 or now - forwarded_at > grace_s:
                for p in procs:
                    if p.poll() is None:
                        _signal_group(p, signal.SIGKILL)
            if all(p.poll() is not None for p in procs):
                _wait_or_kill(procs, 0)
                print("interrupted" if sig == signal.SIGINT else f"stopped by {signal.Signals(sig).name}",
                      file=sys.stderr)
                return 128 + sig
            time.sleep(0.05)
            continue
        if any(procs[i].returncode != 0 for i in exited_at):
            return _report_failure(procs, logs, markers, exited_at, tee)
        if len(exited_at) == n:
            return 0
        time.sleep(0.05)


def _report_failure(procs, logs, markers: list[Path], exited_at: dict[int, float], tee) -> int:
    """Stop everything and say which process failed first, with its last lines. Returns the exit code."""
    n = len(procs)
    # Before stopping the others (which makes them exit too): a frozen process is the cause, not
    # the one that gave up on it; else the earliest failure (see `first_failure`).
    frozen = [i for i, p in enumerate(procs) if p.poll() is None and _stopped(p.pid)]
    first = first_failure(procs, exited_at, markers)
    code = procs[first].poll()
    _stop([p for p in procs if p.poll() is None])
    tee.join(timeout=5)

    def output(i: int) -> str:
        return tee.text() if i == 0 else _tail(logs[i], 400)

    blamed = sorted(_blamed_tasks(output(first)) - {first})
    if code is None:  # its marker says it failed first, though it had not exited yet
        marker = read_failure(markers[first]) or {}
        code = marker.get("code") if isinstance(marker.get("code"), int) else 1
        how = f"failed first ({marker.get('error', 'no reason given')})"
    else:
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    if frozen or blamed:
        culprit = (frozen or blamed)[0]
        why = "was stopped (frozen)" if frozen else "stopped sending heartbeats (frozen or hung)"
        print(f"error: process {culprit} of {n} {why}; process {first} {how} because of it; "
              f"stopped the other processes", file=sys.stderr)
    else:
        culprit = first
        print(f"error: process {first} of {n} {how}; stopped the other processes", file=sys.stderr)
    if culprit != 0 and _tail(logs[culprit]):
        print(f"--- last lines of {logs[culprit]} ---\n{_tail(logs[culprit])}", file=sys.stderr)
    if code == 2:
        return 2  # a refused flag: every process refuses it alike
    return 1 if code > 0 else 128 - code


def _flag_value(flags: list[str], name: str) -> str | None:
    """The value of trainer flag `name` (`--x.y v` or `--x.y=v`) among `flags`, or None."""
    value = None
    for i, flag in enumerate(flags):
        key, eq, inline = flag.partition("=")
        if key.replace("_", "-") == name:
            value = inline if eq else (flags[i + 1] if i + 1 < len(flags) else None)
    return value


def _num_replicas(flags: list[str]) -> int:
    """`--diloco.num-replicas` among the trainer flags (the trainer's default if absent)."""
    value = _flag_value(flags, "--diloco.num-replicas")
    if value is None:
        from .config import DiLoCoConfig

        return DiLoCoConfig().num_replicas
    try:
        return int(value)
    except ValueError:
        return 0


def _elastic(flags: list[str]) -> bool:
    """Whether the trainer flags turn on `--elastic.enabled` (tyro's boolean flag: the last one wins)."""
    on = False
    for flag in flags:
        name = flag.replace("_", "-")
        if name in ("--elastic.enabled", "--elastic.enabled=True"):
            on = True
        elif name in ("--elastic.no-enabled", "--elastic.enabled=False"):
            on = False
    return on


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m eqx_diloco.launch",
        description="Start N local processes of one eqx_diloco run (flags after -- go to every process).",
    )
    parser.add_argument("--num-processes", type=int, required=True, help="processes to start (>= 1)")
    parser.add_argument("--bandwidth", default=None,
                        help="rate-limit the processes' link, in tc units (e.g. 800mbit); needs root")
    parser.add_argument("--module", default="eqx_diloco.train", help="module each process runs")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="where the processes' output is logged (default: a temporary folder, removed "
                             "when the run succeeds)")
    parser.add_argument("--grace-s", type=float, default=30.0,
                        help="after forwarding SIGTERM/SIGHUP/SIGINT, seconds to wait before killing the processes")
    elastic = parser.add_argument_group(
        "elastic islands (with --elastic.enabled among the trainer flags: one process per island; a lost island "
        "re-forms the run with the others from their newest sync boundary)")
    elastic.add_argument("--max-restarts", type=int, default=0,
                         help="times each island is restarted after it was lost; it rejoins at a sync boundary")
    elastic.add_argument("--rejoin-after-s", type=float, default=0.0,
                         help="seconds between losing an island and restarting it")
    elastic.add_argument("--drain-s", type=float, default=3.0,
                         help="seconds the survivors get to finish writing their newest snapshot before they are "
                              "stopped and re-formed")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="-- then the flags for every process")
    args = parser.parse_args(argv)
    if args.num_processes < 1:
        print(f"error: --num-processes must be >= 1 (got {args.num_processes})", file=sys.stderr)
        return 2
    if not args.grace_s >= 0:
        print(f"error: --grace-s must be >= 0 (got {args.grace_s})", file=sys.stderr)
        return 2
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    elastic = _elastic(flags)
    replicas = _num_replicas(flags)
    if elastic and _flag_value(flags, "--diloco.num-replicas") is None:
        replicas = args.num_processes  # each generation is told its live island count
    if elastic and replicas != args.num_processes:
        print(f"error: --elastic.enabled needs one island per process: --num-processes must equal "
              f"--diloco.num-replicas (got {args.num_processes} processes for {replicas} replicas)", file=sys.stderr)
        return 2
    if args.module == "eqx_diloco.train" and replicas >= 1 and replicas % args.num_processes:
        print(f"error: --num-processes must divide --diloco.num-replicas: every process trains whole replicas "
              f"(got {args.num_processes} processes for {replicas} replicas)", file=sys.stderr)
        return 2
    if args.log_dir is not None and args.log_dir.exists() and not args.log_dir.is_dir():
        print(f"error: --log-dir is not a folder: {args.log_dir}", file=sys.stderr)
        return 2
    for flag, value in [("--max-restarts", args.max_restarts), ("--rejoin-after-s", args.rejoin_after_s),
                        ("--drain-s", args.drain_s)]:
        if not value >= 0:
            print(f"error: {flag} must be >= 0 (got {value})", file=sys.stderr)
            return 2
    if args.max_restarts and not elastic:
        print("error: --max-restarts needs --elastic.enabled among the trainer flags (islands rejoin from "
              "their snapshots)", file=sys.stderr)
        return 2
    min_replicas = _flag_value(flags, "--elastic.min-replicas")
    min_replicas = int(min_replicas) if min_replicas is not None and min_replicas.lstrip("-").isdigit() else 1
    if elastic and min_replicas > args.num_processes:
        print(f"error: --elastic.min-replicas must be <= the {args.num_processes} islands (got {min_replicas})",
              file=sys.stderr)
        return 2
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="eqx_diloco_launch_"))
    if elastic:
        code = launch_elastic(args.num_processes, flags, module=args.module, bandwidth=args.bandwidth,
                              log_dir=log_dir, grace_s=args.grace_s, max_restarts=args.max_restarts,
                              rejoin_after_s=args.rejoin_after_s, drain_s=args.drain_s, min_replicas=min_replicas)
    else:
        code = launch(args.num_processes, flags, module=args.module, bandwidth=args.bandwidth, log_dir=log_dir,
                      grace_s=args.grace_s)
    if args.log_dir is None and (code == 0 or not any(log_dir.iterdir())):
        shutil.rmtree(log_dir, ignore_errors=True)  # a default folder is only kept to explain a failure
    elif code != 0:
        print(f"launcher: the processes' logs are in {log_dir}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
