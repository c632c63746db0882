"""gloo's network thread at idle priority, so that it never holds a CPU the process's other threads want.

Between CPU processes, XLA's collectives go through gloo, whose TCP transport runs one event loop
thread per process (`epoll_wait(fd, events, 64, 10)` in gloo's `tcp::Loop`). During a collective that
loop polls its socket in a tight loop: `epoll_wait` returns the same readable socket again and again
until XLA's thread, the one running the collective, has taken its turn. Where the two share a core
(the launcher pins each process to its own CPUs), the poll keeps that core until the kernel's next
timer tick, 4 ms at 250 Hz, and only then does XLA's thread run. Measured here
(`benchmarks/psum_floor.py`): a psum of 131,393 float32 values between two pinned processes took
4.00 ms at the median, and 0.31 ms with the loop thread at `SCHED_IDLE`.

At `SCHED_IDLE` the loop runs whenever no other thread of its CPUs is runnable, which is exactly when
a blocking collective waits for it. A sync that overlaps compute needs the loop beside the compute
instead: at idle priority it moves bytes only in the gaps between programs. On a 60 Mbit/s link
(`benchmarks/overlap.py --quick --only streaming_overlap_tau3`, one paired repeat each, run back to
back), Streaming with tau = 3 took 0.180 s per step with the loop idle and 0.155 s without, against
0.15 s for its compute alone. So the trainer idles the loop only in runs whose syncs all block
(`eqx_diloco.lm._layout.overlapped_syncs`).
"""

from __future__ import annotations

import os
import platform
import time

# How the loop thread is found: it is the thread blocked in this call (the syscall number, and
# epoll's maxevents and timeout in milliseconds, gloo's constants). glibc's `epoll_wait` is the
# epoll_wait system call on x86_64 or epoll_pwait (same first four arguments) where there is no
# epoll_wait; both are accepted.
_EPOLL_CALLS = {"x86_64": {"232", "281"}, "aarch64": {"22"}}
_GLOO_MAX_EVENTS = 64
_GLOO_TIMEOUT_MS = 10
# The loop sleeps in epoll_wait between its 10 ms timeouts when the process is not communicating (as
# it is while a run sets up), so a handful of looks finds it; this bounds the search where there is none.
_LOOKS = 50
_LOOK_INTERVAL_S = 0.001
_idled: int | None = None  # what `idle_gloo_loop` changed in this process; None before it ran


def gloo_loop_threads(*, looks: int = _LOOKS) -> set[int]:
    """The ids of this process's threads found waiting in gloo's event loop call, over `looks`
    looks 1 ms apart (stopping at the first look that finds one). Empty where `/proc` cannot tell."""
    calls = _EPOLL_CALLS.get(platform.machine())
    if calls is None or not os.path.isdir("/proc/self/task"):
        return set()
    for look in range(looks):
        found = set()
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/syscall") as f:
                    fields = f.read().split()
            except OSError:  # a thread that ended, or a kernel that does not show system calls
                continue
            if (len(fields) >= 5 and fields[0] in calls and int(fields[3], 16) == _GLOO_MAX_EVENTS
                    and int(fields[4], 16) == _GLOO_TIMEOUT_MS):
                found.add(int(tid))
        if found:
            return found
        if look + 1 < looks:
            time.sleep(_LOOK_INTERVAL_S)
    return set()


def idle_gloo_loop() -> int:
    """Put gloo's event loop thread(s) of this process at `SCHED_IDLE`. Call once JAX's CPU client
    exists in a process of a multi-process run (the loop starts with the client). Returns how many
    threads were changed: 0 where there is none, or this platform has no `SCHED_IDLE`."""
    global _idled
    changed = 0
    for tid in gloo_loop_threads() if hasattr(os, "SCHED_IDLE") else ():
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            changed += 1
        except (ProcessLookupError, PermissionError):  # ended meanwhile; a sandbox that forbids it
            pass
    _idled = changed
    return changed


def idled_gloo_threads() -> int | None:
    """How many threads `idle_gloo_loop` put at idle priority in this process (None: it has not run)."""
    return _idled
