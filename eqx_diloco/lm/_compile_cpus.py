"""Start-up's compiles on all of the launcher's CPUs, the steps on the process's own share.

A launcher that splits the machine among co-located processes pins each to its share before it
starts, so XLA's CPU client sizes its compute thread pool to the share (`_processes.cpu_shares`).
XLA's compiler sizes its own pool later, at the first compile, from the CPUs the process may use
then. Pinned, a process would compile on its share alone, while in a multi-process CPU run the
other processes wait for process 0's executables (`_compile_share`) and their cores sit idle.

So a process the launcher pinned (it names every CPU in `$EQX_DILOCO_COMPILE_CPUS`) widens every
thread to those CPUs before its first compile, narrows them back to its share once its first step
is dispatched (the start-up compiles done), and widens them again after its last step, for the
final sync's and evaluation's programs; the compute pool keeps the share's size throughout.

Not where the process has more devices than CPUs of its own (a communication device beside the
compute device, on a one-CPU share): XLA's compute pool then has a thread per device, and a compile
that sees more CPUs than the share splits each large loop of the step into that many tasks, which
take turns on the share's CPU at every step. In the overlap benchmark's layout (6 layers x 128, two
processes on one CPU each, each with a communication device), the eager method's step took
0.148 s compiled widened and 0.117 s compiled on the share; compiling on the share made a cold
Streaming run of the 2 x 64 model 1.6 s longer (ad hoc pairs of runs).
"""

from __future__ import annotations

import os

COMPILE_CPUS_ENV = "EQX_DILOCO_COMPILE_CPUS"
_share: set[int] | None = None  # the process's own CPUs while it is widened (affinity is per process)


def keep_to_cpus(cpus: set[int] | list[int]) -> None:
    """Move every thread of this process (XLA's pools included, already started) to `cpus`: start-up's
    widening and narrowing here, and a standby island taking a lost island's share of the CPUs. A no-op
    where this platform has no per-thread CPU affinity."""
    if not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def widen_for_compiles(local_devices: int | None = None) -> bool:
    """Let every thread of this process use the CPUs in `$EQX_DILOCO_COMPILE_CPUS` until
    `narrow_to_share`; False (nothing changed) where the variable is unset, names no CPU beyond the
    process's own, the process has more devices than CPUs of its own (`local_devices`, default JAX's
    local device count: see above), or threads cannot be pinned here. Call once JAX's client exists
    (its compute pool sized to the share) and before the first compile."""
    global _share
    spec = os.environ.get(COMPILE_CPUS_ENV, "")
    if not spec or not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
        return False
    try:
        cpus = {int(c) for c in spec.split(",")} & set(range(os.cpu_count() or 1))
    except ValueError:
        return False
    share = os.sched_getaffinity(0)
    if not cpus or cpus <= share:
        return False
    if local_devices is None:
        import jax  # here, not at the top: the launcher imports this module and never needs JAX

        local_devices = jax.local_device_count()
    if local_devices > len(share):
        return False
    _share = share
    keep_to_cpus(cpus)
    return True


def narrow_to_share() -> None:
    """Put every thread of this process back on the CPUs it had before `widen_for_compiles` (if widened)."""
    global _share
    if _share:
        keep_to_cpus(_share)
    _share = None
