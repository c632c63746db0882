"""Hooks that tests and benchmarks set through the environment; never set in a real run.

`$EQX_DILOCO_TEST_FAIL_AT_STEP` (tests only) fails one process at one step. Benchmarks emulate islands
of other speeds on one machine with two knobs, read by the synchronous trainer and by decoupled
islands alike, each `K:SECONDS,...` by island:

- `$EQX_DILOCO_SLOW_ISLANDS`: island K sleeps SECONDS after each computed step. On a machine whose
  cores the islands share, a sleeping island frees its share for the others, so this slows island K
  and speeds up the rest.
- `$EQX_DILOCO_STEP_PERIODS`: island K's steps are paced to one per SECONDS (from the end of one
  step to the end of the next, so what the island does between steps, a sync for instance, counts
  in it). With every island paced at a period longer than its step takes on the shared cores, each
  runs at the speed it would have on hardware of its own, whatever the others do: a slower island
  is then one with a longer period.
"""

import functools
import os
import time

import jax

# "P:T" makes the process with JAX process index P raise at step T, as a failure that process alone sees
# would (a bug, a disk error): tests/test_multiprocess.py checks that it leaves at once and is blamed.
TEST_FAIL_ENV = "EQX_DILOCO_TEST_FAIL_AT_STEP"
SLOW_ISLANDS_ENV = "EQX_DILOCO_SLOW_ISLANDS"
STEP_PERIODS_ENV = "EQX_DILOCO_STEP_PERIODS"


def _seconds_for(env: str, islands: tuple[int, ...]) -> float:
    """The largest SECONDS that `$env` (`K:SECONDS,...`) gives one of `islands`; 0 when none."""
    spec = os.environ.get(env, "")
    seconds = 0.0
    for item in filter(None, spec.split(",")):
        island, _, value = item.partition(":")
        try:
            if int(island) in islands:
                seconds = max(seconds, float(value))
        except ValueError:
            raise ValueError(f"${env} must be K:SECONDS,... (got {spec!r})") from None
    return seconds


class IslandSpeed:
    """How long this process holds after each step (see the module's docstring).

    **Arguments:**

    - `extra_s`: seconds slept after each computed step (`$EQX_DILOCO_SLOW_ISLANDS`).
    - `period_s`: the pace, seconds from one step's end to the next's (`$EQX_DILOCO_STEP_PERIODS`).
    """

    def __init__(self, extra_s: float = 0.0, period_s: float = 0.0):
        self.extra_s, self.period_s = extra_s, period_s
        self._last_end: float | None = None

    def hold(self, value) -> None:
        """Once `value` (the step's loss) is computed, sleep as the knobs say; nothing when both are 0."""
        if not (self.extra_s or self.period_s):
            return
        jax.block_until_ready(value)
        time.sleep(self.extra_s)
        if self.period_s and self._last_end is not None:
            time.sleep(max(0.0, self._last_end + self.period_s - time.perf_counter()))
        self._last_end = time.perf_counter()


@functools.cache
def island_speed(islands: tuple[int, ...], *, all_processes: bool = False) -> IslandSpeed:
    """This process's `IslandSpeed` (one per process and islands: a pace goes on from step to step).

    `islands`: this process's islands, or with `all_processes` every replica's island of a
    multi-process run (this process holds its equal share of them)."""
    if all_processes:
        R, P = len(islands), jax.process_count()
        # This process's block of R / P replicas, or the one island it is a part of (R < P).
        islands = islands[jax.process_index() * R // P:][:max(1, R // P)]
    return IslandSpeed(_seconds_for(SLOW_ISLANDS_ENV, islands), _seconds_for(STEP_PERIODS_ENV, islands))


def fail_for_test(step: int) -> None:
    """Raise at step `step` in the process `$EQX_DILOCO_TEST_FAIL_AT_STEP` names (tests only)."""
    spec = os.environ.get(TEST_FAIL_ENV)
    if spec and spec == f"{jax.process_index()}:{step}":
        raise RuntimeError(f"${TEST_FAIL_ENV}={spec}: process {jax.process_index()} fails at step {step} (test hook)")
