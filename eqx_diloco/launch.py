"""`python -m eqx_diloco.launch`: start N local processes of one multi-process run.

    python -m eqx_diloco.launch --num-processes 2 -- --diloco.num-replicas 2
    python -m eqx_diloco.launch --num-processes 2 --bandwidth 800mbit -- --diloco.num-fragments 4

Every process runs `python -m eqx_diloco.train <flags>` (or `--module`) with the standard
JAX variables (coordinator 127.0.0.1:<port>, process count, process id). Process 0's
output streams to this terminal; the others write to log files. If any process dies,
the launcher stops the rest and exits non-zero with its last lines, so nothing hangs.
Ctrl-C is forwarded to every process.

With `--bandwidth`, all processes run inside a fresh network namespace whose loopback is
rate-limited with a token bucket (`tc qdisc ... tbf`), so they talk over a slow link.
That needs root (to create the namespace); without it the launcher says so and stops.
"""

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _stop(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def launch(num_processes: int, flags: list[str], *, module: str, bandwidth: str | None, log_dir: Path) -> int:
    """Run the processes to the end. Returns the exit code for the launcher."""
    prefix: list[str] = []
    limit = None
    if bandwidth:
        problem = LinkLimit.check()
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
        limit = LinkLimit(bandwidth)
        prefix = limit.__enter__()
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs, logs = [], []
    try:
        for i in range(num_processes):
            env = dict(os.environ, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                       JAX_NUM_PROCESSES=str(num_processes), JAX_PROCESS_ID=str(i), PYTHONUNBUFFERED="1")
            log = log_dir / f"process_{i}.log"
            logs.append(log)
            out = None if i == 0 else log.open("w")
            cmd = [*prefix, sys.executable, "-m", module, *flags]
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                          start_new_session=True))
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, code = failed[0]
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                others = [p for p in procs if p.poll() is None]
                _stop(others)
                print(f"error: process {i} of {num_processes} {how}; stopped the other processes", file=sys.stderr)
                if i != 0 and _tail(logs[i]):
                    print(f"--- last lines of {logs[i]} ---\n{_tail(logs[i])}", file=sys.stderr)
                return 1 if code > 0 else 128 - code
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)
    except KeyboardInterrupt:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT)
        _stop(procs, grace_s=10.0)
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        _stop(procs)
        if limit is not None:
            limit.__exit__()


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
                        help="where processes 1..N-1 write their output (default: a temporary folder)")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="-- then the flags for every process")
    args = parser.parse_args(argv)
    if args.num_processes < 1:
        print(f"error: --num-processes must be >= 1 (got {args.num_processes})", file=sys.stderr)
        return 2
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="eqx_diloco_launch_"))
    return launch(args.num_processes, flags, module=args.module, bandwidth=args.bandwidth, log_dir=log_dir)


if __name__ == "__main__":
    sys.exit(main())
