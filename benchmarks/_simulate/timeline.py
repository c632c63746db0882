"""The per-step timeline: steady-state compute utilization of a schedule at a bandwidth,
and the bandwidth a utilization target needs (on the paper's grid or exactly)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from benchmarks._simulate.comm import ModelComm
from benchmarks._simulate.schedule import METHODS, Schedule, Transfer, method_schedule

TARGETS = (0.5, 0.8, 0.9, 0.95, 0.99)
GRID_GBIT = np.logspace(-1, 3, 50)


def ring_factor(replicas: int) -> float:
    """Bits each replica puts on the wire per payload bit in a ring all-reduce: 2 (R - 1) / R."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    return 2.0 * (replicas - 1) / replicas


def bandwidth_grid(min_gbit: float = 0.1) -> np.ndarray:
    """`numpy.logspace(-1, 3, 50)` Gbit/s, extended below 0.1 with the same spacing down to `min_gbit`."""
    step = 4.0 / 49.0
    below = max(0, math.ceil((-1.0 - math.log10(min_gbit)) / step - 1e-9))
    return 10.0 ** (-1.0 + step * np.arange(-below, 50))


def utilization(
    schedule: Schedule,
    bandwidth_bits_per_s,
    *,
    replicas: int = 2,
    latency_s: float = 0.0,
    warmup_periods: int = 3,
    periods: int = 4,
    min_steps: int = 40,
):
    """Steady-state compute utilization of `schedule` at the given bandwidth(s) in bits/s.

    Returns a float for a scalar bandwidth, an array for an array of bandwidths (all
    simulated at once). `inf` bandwidth and zero latency give exactly 1.0.
    """
    bw = np.atleast_1d(np.asarray(bandwidth_bits_per_s, dtype=np.float64))
    if np.any(bw <= 0):
        raise ValueError("bandwidth must be > 0")
    factor = ring_factor(replicas)
    step_s = schedule.step_s
    # Repeat short periods (DDP) so that the measured window spans at least min_steps steps.
    reps = max(1, math.ceil(min_steps / (schedule.period * periods)))
    period = schedule.period
    by_step: dict[int, list[Transfer]] = defaultdict(list)
    for t in schedule.transfers:
        by_step[t.step].append(t)
    for released in by_step.values():
        released.sort(key=lambda t: t.release)
    durations = {id(t): factor * t.bits / bw for t in schedule.transfers}

    first = warmup_periods * period * reps + 1
    last = (warmup_periods + periods) * period * reps
    start = np.zeros_like(bw)  # start time of the current step
    link_free = np.zeros_like(bw)  # when the queue has sent everything released so far
    due: dict[int, np.ndarray] = {}  # step -> latest arrival it must wait for
    stall = np.zeros_like(bw)  # waiting inside the measured window (summed, not differenced: exact 1.0)
    for k in range(1, last + 2):
        if k in due:
            wait = np.maximum(due.pop(k) - start, 0.0)
            start = start + wait
            if k > first:
                stall = stall + wait
        if k == last + 1:
            break
        for t in by_step.get((k - 1) % period + 1, ()):
            link_free = np.maximum(link_free, start + t.release * step_s) + durations[id(t)]
            deadline = k + t.tau + 1
            arrive = link_free + latency_s
            due[deadline] = np.maximum(due[deadline], arrive) if deadline in due else arrive
        start = start + step_s
    compute = (last - first + 1) * step_s
    # A long deadline (eager: tau = H) lets the queue fall behind for many periods before the
    # first stall, so near saturation the window may still be in that transient. In the steady
    # state the link carries every period's bits, so the wall time is at least that busy time.
    link_busy = factor * schedule.bits_per_period * (last - first + 1) / period / bw
    util = compute / np.maximum(compute + stall, link_busy)
    return float(util[0]) if np.ndim(bandwidth_bits_per_s) == 0 else util


def required_bandwidth(
    schedule: Schedule,
    targets: Sequence[float] = TARGETS,
    *,
    grid_gbit: np.ndarray = GRID_GBIT,
    replicas: int = 2,
    latency_s: float = 0.0,
) -> list[float | None]:
    """First grid bandwidth (Gbit/s) whose utilization reaches each target; None if none does."""
    util = utilization(schedule, np.asarray(grid_gbit) * 1e9, replicas=replicas, latency_s=latency_s)
    out = []
    for target in targets:
        hit = np.nonzero(util >= target - 1e-12)[0]
        out.append(float(grid_gbit[hit[0]]) if len(hit) else None)
    return out


def bandwidth_for(
    schedule: Schedule,
    target: float,
    *,
    replicas: int = 2,
    latency_s: float = 0.0,
    lo_gbit: float = 1e-6,
    hi_gbit: float = 1e6,
    rel: float = 1e-6,
) -> float | None:
    """Least bandwidth (Gbit/s, off any grid, to `rel`) whose utilization reaches `target`; None above `hi_gbit`.

    Bisection in log space; utilization is non-decreasing in bandwidth.
    """

    def ok(gbit: float) -> bool:
        return utilization(schedule, gbit * 1e9, replicas=replicas, latency_s=latency_s) >= target - 1e-12

    if not ok(hi_gbit):
        return None
    if ok(lo_gbit):
        return lo_gbit
    lo, hi = lo_gbit, hi_gbit
    while hi / lo > 1 + rel:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def throughput_bound_gbit(schedule: Schedule, target: float, replicas: int = 2) -> float:
    """Bandwidth below which no timeline reaches `target`: a period's bits must cross the link once per period.

    Utilization <= period compute / (ring_factor * bits per period / bandwidth).
    """
    return target * ring_factor(replicas) * schedule.bits_per_period / (schedule.period * schedule.step_s) / 1e9


def method_table(
    comm: ModelComm,
    *,
    step_s: float,
    sync_every: int,
    tau: int,
    bits: float,
    fp4_bits: float,
    backward_fraction: float,
    replicas: int,
    latency_s: float = 0.0,
    grid_gbit: np.ndarray = GRID_GBIT,
    targets: Sequence[float] = TARGETS,
) -> dict[str, list[float | None]]:
    """Required bandwidth per method (Gbit/s per target)."""
    return {
        m: required_bandwidth(
            method_schedule(
                m,
                comm,
                step_s=step_s,
                sync_every=sync_every,
                tau=tau,
                bits=bits,
                fp4_bits=fp4_bits,
                backward_fraction=backward_fraction,
            ),
            targets,
            grid_gbit=grid_gbit,
            replicas=replicas,
            latency_s=latency_s,
        )
        for m in METHODS
    }
