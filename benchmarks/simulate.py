"""Compute-utilization simulator for data parallel, DiLoCo, Streaming DiLoCo and eager updates.

In the style of the Streaming DiLoCo paper's Table 4 (arXiv 2501.18512): for each method,
the bandwidth between replicas needed to keep the accelerators busy 50/80/90/95/99% of
the time.

Model (a per-step timeline, deterministic, no noise):

- Every inner step takes `step_s` seconds of compute. Step k starts when step k-1 has
  finished *and* every transfer due before step k has arrived.
- A sync payload is released while a step computes, by default at the end of it (DDP: the
  full gradient every step; DiLoCo: all params every H steps; Streaming: one fragment
  every H/P steps). With `backward_fraction = b > 0` the payload of layer l (of L, stack
  order) is instead released when its backward pass finishes, at `1 - b * l / L` of the
  step (layers are processed back to front; values outside the layer stack are released
  at the very end). That is the paper's assumption that the reduction is overlapped with
  the backward pass; our own trainer syncs after the step, so the default is b = 0.
- One FIFO network queue per replica. A payload of `bits` (per-replica bits: values times
  bits per value) occupies it for `2 * (R - 1) / R * bits / bandwidth` seconds: the
  traffic each replica sends (and receives) in a bandwidth-optimal ring all-reduce, with
  `bandwidth` the per-replica link in bits/s. For R = 2, the paper's setting, the factor
  is exactly 1, so with and without it the paper tables are identical. A fixed
  `latency_s` may be added to every transfer (0 by default, as in the paper's table).
- Deadline: a payload released in step t must have arrived before step t + tau + 1
  starts (compute stalls until then). tau = 0 for DDP, DiLoCo and streaming without
  overlap; tau steps of compute overlap the transfer for streaming with overlap.
- Eager updates with a 1-outer-step overlap ("Eager Updates For Overlapped Communication
  and Computation in DiLoCo", Kale, Douillard, Donchev 2025, arXiv 2502.12996): the
  replica sends its outer gradient at the end of round k and starts round k + 1 at once;
  the average of round k is needed at the next outer step, at the end of round k + 1.
  In the timeline above that is tau = H: released in step t, due before step t + H + 1.
  `eager` is plain DiLoCo (P = 1); `streaming_eager` does it per fragment, so fragment p
  (syncing at steps s_p + k H) must have its exchange back by its next sync s_p + (k + 1) H,
  also tau = H. The next send is not gated on the previous arrival (the new local outer
  gradient does not depend on the missing average); the FIFO queue serializes them. The
  `_fp4` variants send `fp4_bits` per value. The naive "delayed" variant of the paper has
  the same communication timeline, so the same numbers apply to it.
- Compute utilization = compute time / wall time, measured over whole periods of the
  schedule after warm-up periods (the system is max-plus linear and periodic, so this is
  its steady state). The wall time is floored at the link's busy time for the window's
  payload: in the steady state every period's bits cross the link once per period. That
  floor only matters for long deadlines (eager, tau = H): slightly above saturation the
  queue then falls behind for many periods before the first stall, a transient longer
  than any fixed warm-up. For tau = H every cycle of the timeline (compute, link, deadline
  edges) averages at most max(H * step_s, link time per period) per period at zero
  latency, so compute / max(window wall, link busy time) is the exact steady state.

Required bandwidth: the first point of `numpy.logspace(-1, 3, 50)` Gbit/s whose
utilization reaches the target (the paper's table seems to use that grid); the local
table extends the grid downwards with the same spacing.

Paper models (1B/10B/100B) are parameter counts (1e9, 1e10, 1e11) spread evenly over
their 24/48/108 layers (embeddings folded into the layers: the paper's fragments are
groups of 3 layers, P = L / 3, with no separate embedding fragment), strided fragments.
The local model is a real `models.TransformerConfig` whose exact fragment bytes come from
`eqx_diloco._fragments.Fragmenter.nbytes` on an abstract model (fragment 0 = embeddings,
final norm, head). Non-integer H / P (the paper's H = 100 with P = 8, 16, 36) is rounded
up: fragment p syncs at ceil((p + 1) * H / P) + k * H.

How it compares with the paper (printed next to it, geometric means in the output):

- float32 values released at the end of the step (our trainer's setting, `32:0`): DiLoCo
  and overlapped streaming need ~2.8-3.3x the paper's bandwidth, DDP and non-overlapped
  streaming far more at high targets (the paper hides each step's transfer in the
  backward pass; without that, non-overlapped streaming stalls exactly like DiLoCo).
- 16-bit values released layer by layer over the backward pass (`16:0.667`): every cell
  within 1.5x, most exactly one grid step (1.21x) above the paper. The paper's fp4 column
  is ~4x below its overlapped column (ours: 8x at 32 bits, 4x at 16), which points to
  16-bit (bf16) payloads; the last grid step may come from the paper's models having a
  little under 1e9/1e10/1e11 parameters. The ring factor is 1 at R = 2, so it cannot
  explain any of the gap.

- Eager, 1-outer-step overlap, 4-bit payloads, 99% utilization at H = 100 (`eager_fp4`,
  `streaming_eager_fp4`): the reference folder has no eager figure, so the published
  number printed beside ours is the 0.2-0.4 Gbit/s range quoted in issue 13 (`PAPER_EAGER`),
  not read off the paper. Ours: 1B 0.45, 10B 0.54 (within 1.5x of 0.4), 100B 0.95 Gbit/s
  (2.4x) on the paper's grid. No schedule can do better than the throughput bound
  target * bits per round / (H * step_s): every round's payload must cross the link once
  per round. With the step times of `PAPER_MODELS` that bound is 0.40 / 0.50 / 0.81 Gbit/s;
  eager already sits on it (it is the least a method sending these bits can need), so the
  100B miss comes from the 100B step time (4.9 s for 10x the 10B model's values), not
  from the eager timeline. A published 0.2-0.4 Gbit/s for 100B would need a step time
  about 2-4x longer (or fewer bits per round) than the Streaming DiLoCo table's.

Run `python -m benchmarks.simulate --help`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections import defaultdict
from typing import Literal, Sequence

import numpy as np

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
TARGETS = (0.5, 0.8, 0.9, 0.95, 0.99)
GRID_GBIT = np.logspace(-1, 3, 50)
# Parameter counts behind the paper's names.
PAPER_PARAMS = {"1B": 1e9, "10B": 1e10, "100B": 1e11}
PAPER_MODELS = {  # layers, step time (FLOPs at 60% MFU) and fragments of the Streaming DiLoCo paper's Table 4
    "1B": {"layers": 24, "step_s": 0.1, "fragments": 8},
    "10B": {"layers": 48, "step_s": 0.8, "fragments": 16},
    "100B": {"layers": 108, "step_s": 4.9, "fragments": 36},
}


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


# --------------------------------------------------------------------------------------
# Schedules


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


@dataclasses.dataclass(frozen=True)
class ModelComm:
    """What a replica sends, as chunks `(layer or None, values)` grouped by fragment.

    `layer` is the chunk's index in the layer stack (None: outside the stack); it only
    matters for `backward_fraction > 0`. DDP and DiLoCo send every chunk at once.
    """

    name: str
    num_layers: int
    fragments: tuple[tuple[tuple[int | None, float], ...], ...]

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    @property
    def values(self) -> float:
        return sum(v for frag in self.fragments for _, v in frag)

    def fragment_values(self) -> list[float]:
        return [sum(v for _, v in frag) for frag in self.fragments]


def paper_model(
    name: str, params: float | None = None, layers: int | None = None, fragments: int | None = None
) -> ModelComm:
    """A paper-style model: `params` values spread evenly over `layers`, strided layer fragments."""
    spec = PAPER_MODELS.get(name, {})
    params = PAPER_PARAMS[name] if params is None else params
    layers = spec["layers"] if layers is None else layers
    fragments = spec["fragments"] if fragments is None else fragments
    if layers % fragments:
        raise ValueError(f"layers={layers} is not divisible by fragments={fragments}")
    per_layer = params / layers
    return ModelComm(
        name, layers, tuple(tuple((l, per_layer) for l in range(f, layers, fragments)) for f in range(fragments))
    )


def real_model(
    config, num_fragments: int, pattern: Literal["strided", "sequential"] = "strided", name: str = "local"
) -> ModelComm:
    """Exact per-fragment values of a `models.TransformerConfig`, from an abstract model (no FLOPs, no memory)."""
    import equinox as eqx
    import jax

    import models
    from eqx_diloco._fragments import Fragmenter

    abstract = eqx.filter_eval_shape(models.Transformer, config, key=jax.random.key(0))
    itemsizes = {np.dtype(x.dtype).itemsize for x in jax.tree.leaves(abstract)}
    if len(itemsizes) != 1:
        raise ValueError(f"params of mixed dtype sizes {sorted(itemsizes)}: cannot count values from bytes")
    itemsize = itemsizes.pop()
    frag = Fragmenter.for_model(abstract, lambda m: m.blocks, num_fragments, pattern)
    chunks = []
    for f in range(num_fragments):
        values = frag.nbytes(abstract, f) / itemsize
        layers = frag.layers(f)
        if layers is None:
            chunks.append(((None, values),))
        else:
            chunks.append(tuple((int(l), values / len(layers)) for l in layers))
    total = Fragmenter(config.num_layers, 1, pattern).nbytes(abstract, 0) / itemsize
    comm = ModelComm(name, config.num_layers, tuple(chunks))
    assert abs(comm.values - total) < 0.5, (comm.values, total)
    return comm


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


# --------------------------------------------------------------------------------------
# Simulation


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
    for s in by_step:
        by_step[s].sort(key=lambda t: t.release)
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


# The Streaming DiLoCo paper's Table 4 (Gbit/s per target), arXiv 2501.18512.
PAPER_TABLE4 = {
    "1B": {
        "data_parallel": [86.8, 152.6, 184.2, 222.3, 569.0],
        "diloco": [1.4, 6.2, 13.3, 23.3, 86.8],
        "streaming": [1.4, 5.2, 9.1, 16.0, 28.1],
        "streaming_overlap": [1.4, 4.3, 6.2, 9.1, 11.0],
        "streaming_overlap_fp4": [0.4, 0.9, 1.7, 2.0, 3.0],
    },
    "10B": {
        "data_parallel": [104.8, 222.3, 222.3, 268.3, 471.5],
        "diloco": [1.7, 7.5, 16.0, 33.9, 104.8],
        "streaming": [1.7, 5.2, 9.1, 13.3, 19.3],
        "streaming_overlap": [1.7, 3.6, 5.2, 6.2, 7.5],
        "streaming_overlap_fp4": [0.4, 0.9, 1.4, 1.4, 1.7],
    },
    "100B": {
        "data_parallel": [184.2, 323.8, 390.7, 390.7, 471.5],
        "diloco": [3.0, 11.0, 23.3, 49.4, 184.2],
        "streaming": [2.4, 6.2, 9.1, 11.0, 19.3],
        "streaming_overlap": [1.7, 3.6, 4.3, 5.2, 5.2],
        "streaming_overlap_fp4": [0.5, 0.9, 1.1, 1.1, 1.4],
    },
}


# The published eager figure compared against: the reference folder holds no eager figure, so
# this is the range issue 13 quotes for arXiv 2502.12996, the same for all three models.
PAPER_EAGER = {
    "source": "issue 13's quote of Eager Updates (arXiv 2502.12996): 1-outer-step eager with 4-bit payloads "
    "needs 0.2-0.4 Gbit/s for 99% compute utilization at H = 100 (1B/10B/100B); not read off the paper itself",
    "target": 0.99,
    "bits": 4,
    "sync_every": 100,
    "range_gbit": (0.2, 0.4),
}


def paper_reference() -> tuple[dict[str, dict[str, list[float]]], str]:
    """The paper's Table 4 (model -> method -> Gbit/s per target) and where it came from."""
    return PAPER_TABLE4, "PAPER_TABLE4 in benchmarks/simulate.py: Streaming DiLoCo (arXiv 2501.18512) Table 4"


def range_ratio(x: float, lo: float, hi: float) -> float:
    """How far `x` is outside [lo, hi] as a factor (1.0 inside)."""
    return max(x / hi, lo / x, 1.0)


def eager_vs_paper(
    *, bits: float, backward_fraction: float, replicas: int = 2, latency_s: float = 0.0, fp4_bits: float | None = None
) -> dict[str, dict]:
    """Per paper model: Gbit/s for the published eager target (grid and exact) next to `PAPER_EAGER`."""
    target, H = PAPER_EAGER["target"], PAPER_EAGER["sync_every"]
    fp4 = PAPER_EAGER["bits"] if fp4_bits is None else fp4_bits
    lo, hi = PAPER_EAGER["range_gbit"]
    out = {}
    for name, spec in PAPER_MODELS.items():
        comm = paper_model(name)
        row = {}
        for method in ("eager_fp4", "streaming_eager_fp4"):
            s = method_schedule(
                method, comm, step_s=spec["step_s"], sync_every=H, bits=bits, fp4_bits=fp4,
                backward_fraction=backward_fraction,
            )  # fmt: skip
            grid = required_bandwidth(s, [target], replicas=replicas, latency_s=latency_s)[0]
            exact = bandwidth_for(s, target, replicas=replicas, latency_s=latency_s)
            row[method] = {
                "grid_gbit": grid,
                "exact_gbit": exact,
                "grid_over_range": None if grid is None else range_ratio(grid, lo, hi),
            }
            row["throughput_bound_gbit"] = throughput_bound_gbit(s, target, replicas)
        out[name] = row
    return out


def paper_tables(
    *,
    bits: float,
    fp4_bits: float = 4,
    backward_fraction: float,
    sync_every: int = 100,
    tau: int = 1,
    replicas: int = 2,
    latency_s: float = 0.0,
) -> dict[str, dict[str, list[float | None]]]:
    """Our Table 4 for the paper's 1B/10B/100B settings."""
    return {
        name: method_table(
            paper_model(name),
            step_s=spec["step_s"],
            sync_every=sync_every,
            tau=tau,
            bits=bits,
            fp4_bits=fp4_bits,
            backward_fraction=backward_fraction,
            replicas=replicas,
            latency_s=latency_s,
        )
        for name, spec in PAPER_MODELS.items()
    }


# --------------------------------------------------------------------------------------
# Output


def _fmt(x: float | None, grid_max: float) -> str:
    if x is None:
        return f">{grid_max:g}"
    return f"{x:.1f}" if x >= 0.95 else f"{x:.3g}"


def markdown_table(
    ours: dict[str, list[float | None]],
    paper: dict[str, list[float]] | None = None,
    targets: Sequence[float] = TARGETS,
    grid_max: float = 1000.0,
) -> str:
    """Rows = methods, columns = targets; cells `ours (paper)` when the paper's numbers are given."""
    head = "| method | " + " | ".join(f"{t:.0%}" for t in targets) + " |"
    lines = [head, "|---" * (len(targets) + 1) + "|"]
    for method, row in ours.items():
        cells = []
        for i, x in enumerate(row):
            cell = _fmt(x, grid_max)
            if paper and method in paper:
                cell += f" ({paper[method][i]:g})"
            cells.append(cell)
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratio_summary(ours: dict, paper: dict) -> dict[str, float]:
    """Per method: geometric mean of ours / paper over the targets both report (off-grid values skipped)."""
    out = {}
    for method, row in ours.items():
        logs = [math.log(o / p) for o, p in zip(row, paper.get(method, [])) if o is not None and p]
        if logs:
            out[method] = math.exp(sum(logs) / len(logs))
    return out


@dataclasses.dataclass
class Args:
    """Bandwidth needed for a compute utilization, per method (Streaming DiLoCo Table 4 style)."""

    paper_variants: tuple[str, ...] = ("32:0", "16:0.667")
    """Paper tables to print, each BITS:BACKWARD_FRACTION. BITS: bits per value of gradients / outer gradients
    (fp4 column: --fp4-bits). BACKWARD_FRACTION 0: payload released at the end of the step (our trainer);
    0.667: released layer by layer over the backward pass, taken as 2/3 of the step (the paper's assumption).
    "32:0" is float32 with end-of-step release; "16:0.667" (bf16, overlapped with backward) fits the paper."""
    fp4_bits: float = 4
    """Bits per value of the *_fp4 columns (streaming_overlap_fp4, eager_fp4, streaming_eager_fp4)."""
    paper_tau: int = 1
    """Overlap steps of streaming_overlap in the paper tables."""
    replicas: int = 2
    """Replicas R (ring all-reduce factor 2 (R - 1) / R)."""
    latency_s: float = 0.0
    """Fixed latency added to every transfer."""
    local: bool = True
    """Also simulate the local model."""
    local_config: "LocalModel" = dataclasses.field(default_factory=lambda: LocalModel())
    local_step_s: float = 0.15
    """Step time of the local model."""
    local_sync_every: int = 20
    """H of the local model."""
    local_fragments: int = 4
    """P of the local model (fragment 0 = embeddings, final norm, head)."""
    local_tau: int = 1
    """tau of the local model's streaming_overlap."""
    local_bits: float = 32
    """Bits per value of the local model (float32 params)."""
    local_backward_fraction: float = 0.0
    """Backward release fraction of the local model (0: our trainer syncs after the step)."""
    local_params: float | None = None
    """Use this parameter count instead of the real config: spread evenly over --local-config.num-layers,
    cut into --local-fragments strided layer groups (no separate embedding fragment, as the paper tables)."""
    json: pathlib.Path | None = None
    """Write all results here."""


@dataclasses.dataclass
class LocalModel:
    """Shape of the local model (fields of models.TransformerConfig)."""

    vocab_size: int = 256
    num_layers: int = 6
    dim: int = 128
    num_heads: int = 4
    mlp_ratio: int = 4
    tie_embeddings: bool = False
    kind: Literal["dense", "moe"] = "dense"
    num_experts: int = 4
    top_k: int = 2


def local_comm(args: Args) -> ModelComm:
    cfg = args.local_config
    if args.local_params is not None:
        if cfg.num_layers % (args.local_fragments):
            raise ValueError(f"--local-config.num-layers {cfg.num_layers} not divisible by --local-fragments")
        return paper_model("local", params=args.local_params, layers=cfg.num_layers, fragments=args.local_fragments)
    import models

    config = models.TransformerConfig(**dataclasses.asdict(cfg))
    return real_model(config, args.local_fragments)


def _parse_variant(text: str) -> tuple[float, float]:
    try:
        bits, backward = (float(x) for x in text.split(":"))
    except ValueError:
        raise SystemExit(f"--paper-variants: expected BITS:BACKWARD_FRACTION such as 16:0.667, got {text!r}") from None
    if bits <= 0 or not 0.0 <= backward <= 1.0:
        raise SystemExit(f"--paper-variants: need BITS > 0 and 0 <= BACKWARD_FRACTION <= 1, got {text!r}")
    return bits, backward


def main(args: Args) -> dict:
    ref_tables, ref_source = paper_reference()
    results: dict = {
        "assumptions": {
            "transfer_s": "ring_factor(R) * per_replica_bits / bandwidth, ring_factor = 2 (R - 1) / R (1 for R = 2)",
            "release": "end of the step, or layer l at 1 - b * l / L of the step with backward fraction b",
            "deadline": "payload released in step t arrives before step t + tau + 1 starts",
            "grid_gbit": "numpy.logspace(-1, 3, 50), first point reaching the target",
            "paper_models": "1e9/1e10/1e11 values spread evenly over 24/48/108 layers; fragments of 3 layers, strided",
            "paper_schedule": "H = 100, fragment p syncs at ceil((p + 1) H / P), streaming_overlap tau = paper_tau",
            "eager": "1-outer-step overlap: released at the outer step ending round k (per fragment for "
            "streaming_eager), due before the step after the next outer step of the same fragment, i.e. tau = H",
            "replicas": args.replicas,
            "latency_s": args.latency_s,
        },
        "paper_source": ref_source,
        "targets": list(TARGETS),
        "paper": {},
    }
    for text in args.paper_variants:
        bits, bf = _parse_variant(text)
        key = f"bits{bits:g}_backward{bf:.3g}"
        tables = paper_tables(
            bits=bits,
            fp4_bits=args.fp4_bits,
            backward_fraction=bf,
            tau=args.paper_tau,
            replicas=args.replicas,
            latency_s=args.latency_s,
        )
        release = "at the end of the step"
        if bf:
            release = f"layer by layer over the backward pass ({bf:.3g} of the step)"
        print(
            f"\n## Paper settings, {bits:g}-bit values (fp4 column {args.fp4_bits:g}-bit), payload released {release}; "
            f"H=100, tau={args.paper_tau}, R={args.replicas}"
        )
        print("Gbit/s needed for a compute utilization; cells: ours (paper Table 4).")
        results["paper"][key] = {"bits": bits, "backward_fraction": bf, "models": {}}
        for name, ours in tables.items():
            paper = ref_tables.get(name)
            spec = PAPER_MODELS[name]
            print(f"\n### {name} ({spec['layers']} layers, step {spec['step_s']} s, P={spec['fragments']})\n")
            print(markdown_table(ours, paper))
            entry = {"ours": ours, "paper": paper}
            if paper:
                ratios = ratio_summary(ours, paper)
                entry["ours_over_paper_geomean"] = ratios
                summary = ", ".join(f"{m} {r:.2f}" for m, r in ratios.items())
                print(f"\nours / paper (geometric mean over targets): {summary}")
            results["paper"][key]["models"][name] = entry
        eager = eager_vs_paper(
            bits=bits, backward_fraction=bf, replicas=args.replicas, latency_s=args.latency_s, fp4_bits=args.fp4_bits
        )
        lo, hi = PAPER_EAGER["range_gbit"]
        print(
            f"\n### Eager, 1-outer-step overlap, {args.fp4_bits:g}-bit payloads: Gbit/s for "
            f"{PAPER_EAGER['target']:.0%} utilization at H={PAPER_EAGER['sync_every']}, vs published {lo:g}-{hi:g}\n"
        )
        print(f"Published figure: {PAPER_EAGER['source']}.\n")
        print(
            "| model | eager_fp4 grid (exact) | streaming_eager_fp4 grid (exact) | throughput bound | published "
            "| grid / published range |"
        )
        print("|---|---|---|---|---|---|")
        for name, row in eager.items():
            e, se = row["eager_fp4"], row["streaming_eager_fp4"]
            print(
                f"| {name} | {_fmt(e['grid_gbit'], 1000.0)} ({e['exact_gbit']:.3g}) "
                f"| {_fmt(se['grid_gbit'], 1000.0)} ({se['exact_gbit']:.3g}) | {row['throughput_bound_gbit']:.3g} "
                f"| {lo:g}-{hi:g} | {e['grid_over_range']:.2f}x |"
            )
        results["paper"][key]["eager_vs_published"] = {"published": PAPER_EAGER, "models": eager}
    if args.local:
        comm = local_comm(args)
        grid = bandwidth_grid(1e-4)
        ours = method_table(
            comm,
            step_s=args.local_step_s,
            sync_every=args.local_sync_every,
            tau=args.local_tau,
            bits=args.local_bits,
            fp4_bits=args.fp4_bits,
            backward_fraction=args.local_backward_fraction,
            replicas=args.replicas,
            latency_s=args.latency_s,
            grid_gbit=grid,
        )
        frag_mb = [v * args.local_bits / 8 / 1e6 for v in comm.fragment_values()]
        print(
            f"\n## Local model: {comm.values:,.0f} values ({comm.values * args.local_bits / 8 / 1e6:.2f} MB at "
            f"{args.local_bits:g} bits), fragments MB {[round(m, 3) for m in frag_mb]}, step {args.local_step_s} s, "
            f"H={args.local_sync_every}, P={args.local_fragments}, tau={args.local_tau}, R={args.replicas}\n"
        )
        print("Gbit/s for a compute utilization (grid extended down to 1e-4 Gbit/s with the same spacing).\n")
        print(markdown_table(ours, grid_max=float(grid[-1])))
        results["local"] = {
            "config": dataclasses.asdict(args.local_config),
            "params": comm.values,
            "fragment_values": comm.fragment_values(),
            "step_s": args.local_step_s,
            "sync_every": args.local_sync_every,
            "fragments": args.local_fragments,
            "tau": args.local_tau,
            "bits": args.local_bits,
            "backward_fraction": args.local_backward_fraction,
            "gbit_s": ours,
        }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"\nwrote {args.json}")
    return results


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Args))
