"""The outer-optimizer study's grid: outer settings, the scale of each mode, the cells
(one `Spec` per grid point) in the order they run, and the id of a scale's settings."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
from collections.abc import Sequence
from typing import Any

NAME = "outer_sweep"  # the study's name: its JSONL, JSON, markdown and plots start with it
NUM_CPU_DEVICES = 2  # simulated CPU devices, the same in every mode (R <= 2 everywhere)


@dataclasses.dataclass(frozen=True)
class Outer:
    """One outer SGD setting."""

    lr: float
    momentum: float
    nesterov: bool

    @property
    def label(self) -> str:
        if self.momentum == 0:
            return f"lr {self.lr:g}, no momentum" + (" (plain averaging)" if self.lr == 1 else "")
        return f"lr {self.lr:g}, {'Nesterov' if self.nesterov else 'momentum'} {self.momentum:g}"

    @property
    def tag(self) -> str:
        return f"lr{self.lr:g}_m{self.momentum:g}{'n' if self.nesterov and self.momentum else ''}"


def parse_outer(text: str) -> Outer:
    """`LR:MOMENTUM` (Nesterov) or `LR:MOMENTUM:plain` (heavy-ball momentum)."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("nesterov", "plain")):
        raise argparse.ArgumentTypeError(f"--outer wants LR:MOMENTUM or LR:MOMENTUM:plain (got {text})")
    return Outer(float(parts[0]), float(parts[1]), len(parts) == 2 or parts[2] == "nesterov")


@dataclasses.dataclass(frozen=True)
class Scale:
    """Model, budget and grid of one mode."""

    num_layers: int
    dim: int
    num_heads: int
    mlp_ratio: int
    seq_len: int
    steps: int
    lr: float
    warmup_steps: int
    eval_every: int
    eval_sequences: int
    batch_sizes: tuple[int, ...]  # sequences per replica per step
    sync_periods: tuple[int, ...]
    outers: tuple[Outer, ...]  # in priority order: runs of the first setting come first
    r1_batch_sizes: tuple[int, ...]  # batches with R = 1 rows (plain training vs DiLoCo R = 1)
    split: str = "contiguous"
    max_corpus_bytes: int = 8_000_000

    def batch_tokens(self, batch_size: int) -> int:
        return batch_size * self.seq_len


DEFAULT_OUTERS = (Outer(1.0, 0.0, False), Outer(0.7, 0.9, True), Outer(1.0, 0.3, True))

_TINY = {"num_layers": 2, "dim": 16, "num_heads": 2, "mlp_ratio": 2, "seq_len": 16, "lr": 1e-2,
         "eval_sequences": 8, "sync_periods": (5,), "max_corpus_bytes": 200_000}
_BASE = {"num_layers": 4, "dim": 64, "num_heads": 4, "mlp_ratio": 4, "seq_len": 64, "lr": 3e-3,
         "eval_sequences": 256, "sync_periods": (10,), "outers": DEFAULT_OUTERS}
# Each mode is one or more sub-studies, run one after the other into the same JSONL and JSON.
STUDIES = {
    "quick": {
        "default_regime": Scale(**_TINY, steps=10, warmup_steps=2, eval_every=5, batch_sizes=(),
                                outers=(Outer(1.0, 0.0, False), Outer(0.7, 0.9, True)), r1_batch_sizes=(2,)),
        "batch": Scale(**_TINY, steps=10, warmup_steps=2, eval_every=5, batch_sizes=(2, 4),
                       outers=(Outer(0.7, 0.9, True),), r1_batch_sizes=()),
    },
    "full": {
        # The batch trend: 512 to 8192 tokens per replica step, the same 100 steps for every batch,
        # with the R = 1 rows at 512 tokens.
        "batch": Scale(**_BASE, steps=100, warmup_steps=10, eval_every=25, batch_sizes=(8, 32, 128),
                       r1_batch_sizes=(8,)),
        # Only with `--study default_regime`: 512 tokens per replica step for 500 steps (the
        # convergence benchmark's quick scale), R = 1 and R = 2.
        "default_regime": Scale(**_BASE, steps=500, warmup_steps=25, eval_every=50, batch_sizes=(8,),
                                r1_batch_sizes=(8,)),
    },
}
DEFAULT_STUDIES = {"quick": ("default_regime", "batch"), "full": ("batch",)}
DEFAULT_SEEDS = {"quick": (0, 1), "full": (0, 1, 2)}


@dataclasses.dataclass(frozen=True)
class Spec:
    """One cell of the grid (all seeds of it share this)."""

    algorithm: str  # "ddp" or "diloco"
    replicas: int
    batch_size: int
    sync_period: int = 0
    outer_lr: float = 0.0
    outer_momentum: float = 0.0
    nesterov: bool = False

    @property
    def outer(self) -> Outer | None:
        return None if self.algorithm == "ddp" else Outer(self.outer_lr, self.outer_momentum, self.nesterov)

    @property
    def cell(self) -> str:
        key = f"{self.algorithm}_R{self.replicas}_b{self.batch_size}"
        if self.algorithm == "diloco":
            key += f"_H{self.sync_period}_{self.outer.tag}"
        return key

    @property
    def reference(self) -> str:
        """The cell this one is compared with: DDP with the same R and batch (R = 1: plain training)."""
        return f"ddp_R{self.replicas}_b{self.batch_size}"

    def label(self) -> str:
        if self.algorithm == "ddp":
            return "DDP" if self.replicas > 1 else "plain training"
        return f"DiLoCo H={self.sync_period}, {self.outer.label}"


def plan(scale: Scale) -> list[Spec]:
    """Every cell, most important first, so that a study cut short loses the least: R = 1
    rows (cheap), then outer setting by outer setting (in `scale.outers` order) the smallest
    batch, the largest, then the ones between (DDP before the first DiLoCo cell of its batch).

    R = 1 DiLoCo with outer lr 1 and no momentum is plain training exactly (the outer step
    copies the replica), so that cell is not run."""
    specs: list[Spec] = []
    diloco = lambda R, b, H, o: Spec("diloco", R, b, H, o.lr, o.momentum, o.nesterov)
    for b in scale.r1_batch_sizes:
        specs.append(Spec("ddp", 1, b))
        specs += [diloco(1, b, scale.sync_periods[0], o) for o in scale.outers if (o.lr, o.momentum) != (1.0, 0.0)]
    ordered = sorted(scale.batch_sizes)
    ordered = ordered[:1] + ordered[-1:] + ordered[1:-1] if len(ordered) > 2 else ordered
    for i, outer in enumerate(scale.outers):
        for b in ordered:
            if i == 0:
                specs.append(Spec("ddp", 2, b))
            specs += [diloco(2, b, H, outer) for H in scale.sync_periods]
    return specs


def scale_id(scale: Scale) -> str:
    """Identifies the settings a run was made with (everything but the grid lists)."""
    fixed = {k: v for k, v in dataclasses.asdict(scale).items()
             if k not in ("batch_sizes", "sync_periods", "outers", "r1_batch_sizes")}
    fixed["num_cpu_devices"] = NUM_CPU_DEVICES
    return hashlib.sha1(json.dumps(fixed, sort_keys=True).encode()).hexdigest()[:12]


def widen(scale: Scale, records: Sequence[dict[str, Any]]) -> Scale:
    """`scale` with its grid lists grown to hold every cell in `records` (runs made with the
    same settings by invocations with narrower grids, e.g. `--batch-sizes 32` to finish a cell)."""
    specs = [Spec(**r["spec"]) for r in records]
    outers = list(scale.outers) + [o for o in dict.fromkeys(s.outer for s in specs if s.outer)
                                   if o not in scale.outers]
    return dataclasses.replace(
        scale,
        batch_sizes=tuple(sorted({*scale.batch_sizes, *(s.batch_size for s in specs if s.replicas == 2)})),
        r1_batch_sizes=tuple(sorted({*scale.r1_batch_sizes, *(s.batch_size for s in specs if s.replicas == 1)})),
        sync_periods=tuple(sorted({*scale.sync_periods, *(s.sync_period for s in specs if s.sync_period)})),
        outers=tuple(outers),
    )


def scale_from_dict(d: dict[str, Any]) -> Scale:
    d = dict(d)
    d["outers"] = tuple(Outer(**o) for o in d["outers"])
    for k in ("batch_sizes", "sync_periods", "r1_batch_sizes"):
        d[k] = tuple(d[k])
    return Scale(**d)
