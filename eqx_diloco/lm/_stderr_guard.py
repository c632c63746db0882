"""A trainer process's stderr, with the JAX distributed runtime's own reports of a lost peer
turned into one line.

When a process of a multi-process run dies without a launcher to stop the rest (under SLURM,
Open MPI, Kubernetes), the coordination service notices its missing heartbeats and every other
process's runtime logs several multi-line records and then aborts the process from C++: no
Python code runs after that. So the filter runs as a separate process that reads the trainer's
file descriptor 2 through a pipe and outlives it by a moment: it passes everything on except
those records, and at the end, if the runtime stopped the process and the trainer said nothing
itself, it writes the one line.

Run by path (`python -I -S _stderr_guard.py PROCESS_ID NUM_PROCESSES HEARTBEAT_S`), so it
imports nothing of the package (and no JAX); `filter_lines` is the part the tests call.
"""

import re
import signal
import sys
from collections.abc import Iterable, Iterator

# An absl log record's first line: "E1205 10:50:31.111847    9788 coordination_service.cc:1549] ..."
_RECORD = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ ([\w./-]+):\d+\] ")
# The runtime files whose records are about the distributed service (and a lost peer).
_RUNTIME_FILES = ("coordination_service.cc", "coordination_service_agent.cc", "client.h", "client.cc")
# Said by the runtime when it is about to abort the process.
_FATAL = "Terminating process because the JAX distributed service detected fatal errors"
# The abort's native stack trace: a banner, then one line per frame ("    @     0x7f13748eb505  fn()").
# Written while the trainer may be writing its own line, so frames can follow that line, or even
# land at its end.
_NATIVE_TRACE = re.compile(r"\s*(@\s+0x[0-9a-fA-F]+\s.*|\*\*\* Check failure stack trace: \*\*\*)\s*$")


def filter_lines(lines: Iterable[str], process_id: int, num_processes: int, heartbeat_s: int) -> Iterator[str]:
    """`lines` without the distributed runtime's records, then (if it was about to abort the
    process and no line starting with `error: ` came through) one line saying what it reported."""
    swallowing = fatal = said_error = runtime_seen = False
    lost: list[int] = []
    for line in lines:
        if runtime_seen and (trace := _NATIVE_TRACE.search(line)):
            line = line[:trace.start()] + "\n" if line[:trace.start()].strip() else ""
            if not line:
                continue
        record = _RECORD.match(line)
        if record or line.startswith(("error: ", "Traceback")):
            swallowing = bool(record) and record[1] in _RUNTIME_FILES
        if swallowing:
            runtime_seen = True
            fatal = fatal or _FATAL in line
            if line.strip().isdigit() and int(line.strip()) not in lost:
                lost.append(int(line.strip()))  # the task ids listed under "... stopped sending heartbeats):"
            continue
        said_error = said_error or line.startswith("error: ")
        yield line
    if fatal and not said_error:
        yield f"error: {lost_peer_message(process_id, num_processes, heartbeat_s, lost)}\n"


def lost_peer_message(process_id: int, num_processes: int, heartbeat_s: int, lost: list[int]) -> str:
    """What a process says when the distributed runtime stops it because others stopped answering."""
    if lost:
        who = f"process {lost[0]}" if len(lost) == 1 else f"processes {', '.join(map(str, lost))}"
        what = f"{who} sent no heartbeat for {heartbeat_s} s (--dist.heartbeat-timeout-s)"
    else:
        what = f"the coordinator (process 0) or another process stopped answering within {heartbeat_s} s " \
               f"(--dist.heartbeat-timeout-s)"
    return (f"process {process_id} of {num_processes} stopped: {what}; the JAX distributed runtime ends every "
            f"process of the run then (see the other processes' logs for why one died)")


def main() -> None:
    process_id, num_processes, heartbeat_s = (int(a) for a in sys.argv[1:4])
    # Ctrl-C, SIGTERM and SIGHUP go to the whole process group: the trainer handles them, and this
    # process must keep forwarding what the trainer says until it exits (end of input).
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    source = open(sys.stdin.fileno(), encoding="utf-8", errors="replace", newline="", closefd=False)  # noqa: SIM115
    for line in filter_lines(source, process_id, num_processes, heartbeat_s):
        try:
            sys.stdout.write(line)
            sys.stdout.flush()
        except OSError:  # the terminal is gone: keep draining, so the trainer never blocks on a full pipe
            pass


if __name__ == "__main__":
    main()
