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
and with `--max-restarts` the island rejoins later (see `elastic`):

    python -m eqx_diloco.launch --num-processes 3 --max-restarts 2 -- --elastic.enabled

With `--decoupled`, the islands share no JAX world at all: a syncer and N independent islands, a
lost island restarted while the others train on (see `decoupled`, docs/decoupled.md):

    python -m eqx_diloco.launch --decoupled --num-processes 4 --max-restarts 2 -- --diloco.quantize int4

With `--bandwidth`, all processes run inside a fresh network namespace whose loopback is
rate-limited with a token bucket (`tc qdisc ... tbf`), so they talk over a slow link.
That needs root (to create the namespace); without it the launcher says so and stops.
"""

import argparse
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ._processes import (
    FAILURE_FILE_ENV,
    GENERATION_ENV,
    LINK_LIMIT_ENV,
    LauncherSignals,
    LinkLimit,
    failure_markers,
    first_failure,
    flag_value,
    free_port,
    is_stopped,
    link,
    link_env,
    read_failure,
    record_failure,
    signal_group,
    spawn,
    stop_all,
    tail,
    wait_or_kill,
)

_UNHEALTHY = re.compile(r"stopped sending heartbeats\):\s*([\d,\s]+)")
_TASK = re.compile(r"Task (\d+) heartbeat timeout")


def _blamed_tasks(output: str) -> set[int]:
    """Processes that JAX's coordination service says stopped sending heartbeats, from a process's output."""
    found = set()
    for m in _UNHEALTHY.finditer(output):
        found.update(int(x) for x in re.findall(r"\d+", m.group(1)))
    found.update(int(x) for x in _TASK.findall(output))
    return found


def launch(
    num_processes: int,
    flags: list[str],
    *,
    module: str,
    bandwidth: str | None,
    log_dir: Path,
    grace_s: float = 30.0,
    split_cpus: bool = True,
) -> int:
    """Run the processes to the end. Returns the exit code for the launcher.

    With `split_cpus` each process gets its own share of this machine's CPUs (see
    `_processes.cpu_shares`; off where there are fewer CPUs than processes).

    SIGINT is forwarded as SIGINT; SIGTERM and SIGHUP are forwarded as SIGTERM (the signal
    the trainer answers by saving and stopping). Processes still running `grace_s` seconds
    later, or at a second signal, are killed. The children also die with the launcher if it
    is killed outright (PR_SET_PDEATHSIG), so none is ever left running unsupervised.
    """
    if bandwidth and (problem := LinkLimit.check()):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    with link(bandwidth) as prefix:
        return _launch(num_processes, flags, module=module, prefix=prefix, log_dir=log_dir, grace_s=grace_s,
                       env=link_env(bandwidth), split_cpus=split_cpus)


def _launch(num_processes: int, flags: list[str], *, module: str, prefix: list[str], log_dir: Path,
            grace_s: float, env: dict[str, str], split_cpus: bool) -> int:
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    logs = [log_dir / f"process_{i}.log" for i in range(num_processes)]
    markers = failure_markers(log_dir, "process", range(num_processes))
    env = [{**env, FAILURE_FILE_ENV: str(marker)} for marker in markers]
    tee = None
    try:
        with LauncherSignals() as signals:
            procs, tee = spawn(num_processes, flags, module=module, prefix=prefix, logs=logs, env=env,
                               split_cpus=split_cpus)
            return _supervise(procs, logs, markers, tee, signals, grace_s)
    finally:
        stop_all(procs)
        if tee is not None:
            tee.join(timeout=5)
        for marker in markers:  # read by now; the logs say the same
            marker.unlink(missing_ok=True)


def _supervise(procs, logs, markers: list[Path], tee, signals: LauncherSignals, grace_s: float) -> int:
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
                        signal_group(p, forward)
                forwarded_at = now
                print(f"launcher: got {signal.Signals(sig).name}, sent {forward.name} to the {n} processes "
                      f"(killing them after {grace_s:g}s)", file=sys.stderr)
            if len(signals.received) > 1 or now - forwarded_at > grace_s:
                for p in procs:
                    if p.poll() is None:
                        signal_group(p, signal.SIGKILL)
            if all(p.poll() is not None for p in procs):
                wait_or_kill(procs, 0)
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
    frozen = [i for i, p in enumerate(procs) if p.poll() is None and is_stopped(p.pid)]
    first = first_failure(procs, exited_at, markers)
    code = procs[first].poll()
    stop_all([p for p in procs if p.poll() is None])
    tee.join(timeout=5)

    def output(i: int) -> str:
        return tee.text() if i == 0 else tail(logs[i], 400)

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
    if culprit != 0 and tail(logs[culprit]):
        print(f"--- last lines of {logs[culprit]} ---\n{tail(logs[culprit])}", file=sys.stderr)
    if code == 2:
        return 2  # a refused flag: every process refuses it alike
    return 1 if code > 0 else 128 - code


def _num_replicas(flags: list[str]) -> int:
    """`--diloco.num-replicas` among the trainer flags (the trainer's default if absent)."""
    value = flag_value(flags, "--diloco.num-replicas")
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
    parser.add_argument("--cpus", choices=["split", "shared"], default="split",
                        help="split: each process runs on its own contiguous share of this machine's CPUs, so "
                             "their compute thread pools do not oversubscribe the cores (with more processes than "
                             "CPUs, one CPU each, in turn; before its first step and after its last, where it "
                             "compiles, a process of a synchronous run uses them all; decoupled islands keep to "
                             "their own, the syncer uses every CPU); shared: every process may use every CPU")
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
    decoupled = parser.add_argument_group(
        "decoupled islands (independent programs that sync through a syncer service: no global barrier)")
    decoupled.add_argument("--decoupled", action="store_true",
                           help="start a syncer and --num-processes islands; a lost island is restarted "
                                "(--max-restarts) while the others train on")
    decoupled.add_argument("--processes-per-island", type=int, default=1,
                           help="processes of each decoupled island: a JAX world of their own over the island's "
                                "--mesh.* devices, restarted together")
    decoupled.add_argument("--spares", type=int, default=0,
                           help="standby islands kept started and compiled (--decoupled.standby): a lost island's "
                                "restart is a spare taking its place at once (a new spare starts behind it)")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="-- then the flags for every process")
    args = parser.parse_args(argv)
    if args.num_processes < 1:
        print(f"error: --num-processes must be >= 1 (got {args.num_processes})", file=sys.stderr)
        return 2
    if not args.grace_s >= 0:
        print(f"error: --grace-s must be >= 0 (got {args.grace_s})", file=sys.stderr)
        return 2
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    for flag, value, default in [("--processes-per-island", args.processes_per_island, 1), ("--spares", args.spares, 0)]:
        if value != default and not args.decoupled:
            print(f"error: {flag} needs --decoupled (got {value})", file=sys.stderr)
            return 2
    if args.decoupled:
        return _decoupled(args, flags)
    elastic = _elastic(flags)
    replicas = _num_replicas(flags)
    if elastic and flag_value(flags, "--diloco.num-replicas") is None:
        replicas = args.num_processes  # each generation is told its live island count
    if elastic and replicas != args.num_processes:
        print(f"error: --elastic.enabled needs one island per process: --num-processes must equal "
              f"--diloco.num-replicas (got {args.num_processes} processes for {replicas} replicas)", file=sys.stderr)
        return 2
    if (args.module == "eqx_diloco.train" and replicas >= 1 and replicas % args.num_processes
            and args.num_processes % replicas):
        print(f"error: --num-processes and --diloco.num-replicas must divide one another: every process trains "
              f"whole replicas, or every island spans whole processes (got {args.num_processes} processes for "
              f"{replicas} replicas)", file=sys.stderr)
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
    min_replicas = flag_value(flags, "--elastic.min-replicas")
    min_replicas = int(min_replicas) if min_replicas is not None and min_replicas.lstrip("-").isdigit() else 1
    if elastic and min_replicas > args.num_processes:
        print(f"error: --elastic.min-replicas must be <= the {args.num_processes} islands (got {min_replicas})",
              file=sys.stderr)
        return 2
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="eqx_diloco_launch_"))
    if elastic:
        from .elastic import launch_elastic  # it imports JAX, which a plain launch never needs

        code = launch_elastic(args.num_processes, flags, module=args.module, bandwidth=args.bandwidth,
                              log_dir=log_dir, grace_s=args.grace_s, max_restarts=args.max_restarts,
                              rejoin_after_s=args.rejoin_after_s, drain_s=args.drain_s, min_replicas=min_replicas,
                              split_cpus=args.cpus == "split")
    else:
        code = launch(args.num_processes, flags, module=args.module, bandwidth=args.bandwidth, log_dir=log_dir,
                      grace_s=args.grace_s, split_cpus=args.cpus == "split")
    if args.log_dir is None and (code == 0 or not any(log_dir.iterdir())):
        shutil.rmtree(log_dir, ignore_errors=True)  # a default folder is only kept to explain a failure
    elif code != 0:
        print(f"launcher: the processes' logs are in {log_dir}", file=sys.stderr)
    return code


def _decoupled(args: argparse.Namespace, flags: list[str]) -> int:
    replicas = flag_value(flags, "--diloco.num-replicas")
    for flag, value, rule in [
        ("--diloco.num-replicas", replicas, replicas is None or replicas == str(args.num_processes)),
        ("--decoupled.role", flag_value(flags, "--decoupled.role"), flag_value(flags, "--decoupled.role") is None),
        ("--decoupled.island", flag_value(flags, "--decoupled.island"), flag_value(flags, "--decoupled.island") is None),
        ("--decoupled.standby", "on", "--decoupled.standby" not in flags),
        ("--bandwidth", args.bandwidth, args.bandwidth is None),
        *[(flag, flag_value(flags, flag), flag_value(flags, flag) is None)
          for flag in ("--dist.num-processes", "--dist.process-id", "--dist.coordinator-address")],
    ]:
        if not rule:
            why = (f"must equal --num-processes {args.num_processes} (one per island)"
                   if flag == "--diloco.num-replicas" else "is set by the launcher per process" if flag != "--bandwidth"
                   else "applies to one multi-process run, not to decoupled islands")
            print(f"error: with --decoupled, {flag} {why} (got {value})", file=sys.stderr)
            return 2
    if _elastic(flags):
        print("error: --decoupled and --elastic.enabled exclude each other: decoupled islands are elastic by "
              "themselves", file=sys.stderr)
        return 2
    for flag, value in [("--max-restarts", args.max_restarts), ("--rejoin-after-s", args.rejoin_after_s)]:
        if not value >= 0:
            print(f"error: {flag} must be >= 0 (got {value})", file=sys.stderr)
            return 2
    if args.processes_per_island < 1:
        print(f"error: --processes-per-island must be >= 1 (got {args.processes_per_island})", file=sys.stderr)
        return 2
    if args.spares < 0 or args.spares and not args.max_restarts:
        print(f"error: --spares must be >= 0, and needs --max-restarts >= 1 (a spare taking a lost island's place "
              f"is its restart; got --spares {args.spares}, --max-restarts {args.max_restarts})", file=sys.stderr)
        return 2
    if args.log_dir is not None and args.log_dir.exists() and not args.log_dir.is_dir():
        print(f"error: --log-dir is not a folder: {args.log_dir}", file=sys.stderr)
        return 2
    from .decoupled import launch_decoupled

    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="eqx_diloco_decoupled_"))
    code = launch_decoupled(args.num_processes, flags, module=args.module, log_dir=log_dir, grace_s=args.grace_s,
                            max_restarts=args.max_restarts, rejoin_after_s=args.rejoin_after_s,
                            processes_per_island=args.processes_per_island, split_cpus=args.cpus == "split",
                            spares=args.spares)
    if args.log_dir is None and code == 0:
        shutil.rmtree(log_dir, ignore_errors=True)
    elif code != 0:
        print(f"launcher: the processes' logs are in {log_dir}", file=sys.stderr)
    return code


# Imported from here by the trainer, the tests and the benchmarks.
__all__ = ["GENERATION_ENV", "LINK_LIMIT_ENV", "LinkLimit", "free_port", "launch", "main", "record_failure"]


if __name__ == "__main__":
    sys.exit(main())
