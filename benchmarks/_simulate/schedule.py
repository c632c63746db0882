"""Periodic communication schedules: which payload each method releases in which step of
its period, when in the step, and how many steps of compute may overlap it."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from benchmarks._simulate.comm import ModelComm

METHODS = (
    "data_parallel",
    "diloco",
    "streaming",
    "streaming_overlap",
    "streaming_overlap_fp4",
    "eager",
    "eager_fp4",
    "streaming_eager",
    "streaming_eager_fp4",
)
EAGER_METHODS = ("eager", "eager_fp4", "streaming_eager", "streaming_eager_fp4")


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One payload that leaves a replica.

    - `step`: the step of the period (1..period) during which it is released.
    - `bits`: per-replica payload bits (values times bits per value).
    - `tau`: steps of compute that may overlap it; it must arrive before step t + tau + 1.
    - `release`: fraction of the step's compute done when it is released (1 = end of step).
    """

    step: int
    bits: float
    tau: int = 0
    release: float = 1.0


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A periodic communication schedule: `transfers` repeat every `period` steps."""

    step_s: float
    period: int
    transfers: tuple[Transfer, ...]

    def __post_init__(self):
        if self.step_s <= 0:
            raise ValueError(f"step_s must be > 0, got {self.step_s}")
        for t in self.transfers:
            if not 1 <= t.step <= self.period:
                raise ValueError(f"transfer step {t.step} is outside the period 1..{self.period}")
            if not 0.0 <= t.release <= 1.0 or t.tau < 0 or t.bits < 0:
                raise ValueError(f"bad transfer {t}")

    @property
    def bits_per_period(self) -> float:
        return sum(t.bits for t in self.transfers)


def _release(layer: int | None, num_layers: int, backward_fraction: float) -> float:
    if layer is None or backward_fraction == 0.0:
        return 1.0
    return 1.0 - backward_fraction * layer / num_layers


def _chunk_transfers(chunks, step: int, bits: float, tau: int, num_layers: int, backward_fraction: float):
    """Transfers of some chunks released in `step`, merged where they leave at the same time."""
    by_release: dict[float, float] = defaultdict(float)
    for layer, values in chunks:
        by_release[_release(layer, num_layers, backward_fraction)] += values * bits
    return [Transfer(step, b, tau, r) for r, b in sorted(by_release.items())]


def sync_step(fragment: int, sync_every: int, num_fragments: int) -> int:
    """Step of the period (1..H) at which `fragment` syncs: ceil((p + 1) H / P) (= (p + 1) H / P when P | H)."""
    return -((-(fragment + 1) * sync_every) // num_fragments)


def method_schedule(
    method: str,
    comm: ModelComm,
    *,
    step_s: float,
    sync_every: int,
    tau: int = 1,
    bits: float = 32,
    fp4_bits: float = 4,
    backward_fraction: float = 0.0,
) -> Schedule:
    """The communication schedule of one of `METHODS` for `comm`."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not 0.0 <= backward_fraction <= 1.0:
        raise ValueError(f"backward_fraction must be in [0, 1], got {backward_fraction}")
    L, b = comm.num_layers, backward_fraction
    everything = [c for frag in comm.fragments for c in frag]
    value_bits = fp4_bits if method.endswith("_fp4") else bits
    if method == "data_parallel":
        return Schedule(step_s, 1, tuple(_chunk_transfers(everything, 1, bits, 0, L, b)))
    if method == "diloco":
        return Schedule(step_s, sync_every, tuple(_chunk_transfers(everything, sync_every, bits, 0, L, b)))
    if method in ("eager", "eager_fp4"):
        # 1-outer-step overlap: the exchange of round k is due at the outer step ending round k + 1.
        return Schedule(
            step_s, sync_every, tuple(_chunk_transfers(everything, sync_every, value_bits, sync_every, L, b))
        )
    P = comm.num_fragments
    if P > sync_every:
        raise ValueError(f"{P} fragments cannot each sync once in H={sync_every} steps")
    if method in ("streaming_eager", "streaming_eager_fp4"):
        # Per fragment: due at the fragment's next sync, H steps later (a whole round of that fragment).
        overlap = sync_every
    else:
        overlap = 0 if method == "streaming" else tau
        if overlap >= sync_every / P:
            raise ValueError(f"tau={tau} must be smaller than H/P={sync_every / P:g}")
    transfers = []
    for p, chunks in enumerate(comm.fragments):
        transfers += _chunk_transfers(chunks, sync_step(p, sync_every, P), value_bits, overlap, L, b)
    return Schedule(step_s, sync_every, tuple(transfers))
