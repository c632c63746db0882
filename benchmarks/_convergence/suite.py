"""The runs of the convergence benchmark: model scale per mode, one `RunSpec` per method and
batch, their trainer configs, and the simulated devices they need."""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Scale:
    """Model and budget shared by all runs of one mode."""

    num_layers: int
    dim: int
    num_heads: int
    mlp_ratio: int
    seq_len: int
    batch_size: int  # per replica at R = 2 (halved at R = 4)
    steps: int
    lr: float
    warmup_steps: int
    eval_every: int
    eval_sequences: int
    sync_periods: tuple[int, int]  # (small H, large H); streaming uses the large one
    overlaps: tuple[int, ...]
    max_corpus_bytes: int = 8_000_000
    outer_lr: float = 0.7
    outer_momentum: float = 0.9


SCALES = {
    "smoke": Scale(num_layers=2, dim=16, num_heads=2, mlp_ratio=2, seq_len=16, batch_size=2, steps=6, lr=1e-2,
                   warmup_steps=1, eval_every=3, eval_sequences=4, sync_periods=(2, 6), overlaps=(0, 1),
                   max_corpus_bytes=200_000),
    "quick": Scale(num_layers=4, dim=64, num_heads=4, mlp_ratio=4, seq_len=64, batch_size=8, steps=500, lr=3e-3,
                   warmup_steps=25, eval_every=25, eval_sequences=128, sync_periods=(10, 50), overlaps=(0, 1, 4)),
    "full": Scale(num_layers=4, dim=128, num_heads=4, mlp_ratio=4, seq_len=128, batch_size=8, steps=1000, lr=3e-3,
                  warmup_steps=50, eval_every=50, eval_sequences=256, sync_periods=(10, 50), overlaps=(0, 1, 4)),
}


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One training run of the comparison."""

    method: str  # "ddp", "diloco" or "streaming"
    replicas: int
    batch_size: int
    sync_period: int = 1
    fragments: int = 1
    overlap: int = 0
    alpha: float = 0.0
    quantize: str = "none"
    error_feedback: bool = False
    outer_overlap: str = "none"  # "delayed" / "eager": whole-round overlap (arXiv 2502.12996)

    @property
    def name(self) -> str:
        parts = [self.method, f"R{self.replicas}"]
        if self.method != "ddp":
            parts.append(f"H{self.sync_period}")
        if self.outer_overlap != "none":
            parts.append(self.outer_overlap)
        if self.method == "streaming":
            parts += [f"P{self.fragments}", f"tau{self.overlap}", f"a{self.alpha:g}"]
        if self.quantize != "none":
            parts.append(self.quantize + ("+ef" if self.error_feedback else ""))
        return " ".join(parts)


def suite(scale: Scale, grid: str) -> list[RunSpec]:
    """The runs of one mode. `grid`: "smoke", "quick" (a subset of streaming) or "full"."""
    L = scale.num_layers
    small_h, big_h = scale.sync_periods
    b2, b4 = scale.batch_size, max(1, scale.batch_size // 2)
    stream = lambda R, b, P, tau, alpha=0.0, q="none": RunSpec(
        "streaming", R, b, big_h, P, tau, alpha, q
    )
    if grid == "smoke":
        return [RunSpec("ddp", 2, b2), stream(2, b2, 2, 0, 0.0, "int4")]
    runs = [RunSpec("ddp", 2, b2), RunSpec("diloco", 2, b2, small_h), RunSpec("diloco", 2, b2, big_h)]
    # The whole outer step overlapped with the next round: the naive and the eager variant.
    runs += [RunSpec("diloco", 2, b2, small_h, outer_overlap=mode) for mode in ("delayed", "eager")]
    runs += [RunSpec("diloco", 2, b2, big_h, outer_overlap="eager")]
    if grid == "full":
        for P in (2, L + 1):
            for tau in scale.overlaps:
                for alpha in (0.0, 0.5):
                    runs.append(stream(2, b2, P, tau, alpha))
            runs.append(stream(2, b2, P, 1, 0.0, "int4"))
    else:  # quick: both P without overlap, then tau and alpha at P = L + 1, then int4
        runs += [stream(2, b2, 2, 0), stream(2, b2, L + 1, 0)]
        runs += [stream(2, b2, L + 1, tau) for tau in scale.overlaps if tau > 0]
        runs += [stream(2, b2, L + 1, 1, 0.5), stream(2, b2, L + 1, 1, 0.0, "int4")]
    runs += [RunSpec("ddp", 4, b4), RunSpec("diloco", 4, b4, small_h), RunSpec("diloco", 4, b4, big_h)]
    runs.append(stream(4, b4, L + 1, 1, 0.0, "int4"))
    return runs


def make_config(spec: RunSpec, scale: Scale, run_dir: pathlib.Path, seed: int):
    from eqx_diloco.lm.config import CheckpointConfig, Config, DataConfig, DiLoCoConfig, TrainConfig
    from models import TransformerConfig

    model = TransformerConfig(num_layers=scale.num_layers, dim=scale.dim, num_heads=scale.num_heads,
                              mlp_ratio=scale.mlp_ratio)
    train = TrainConfig(steps=scale.steps, batch_size=spec.batch_size, seq_len=scale.seq_len, lr=scale.lr,
                        warmup_steps=scale.warmup_steps, seed=seed, log_every=1, eval_every=scale.eval_every,
                        eval_sequences=scale.eval_sequences,
                        final_sync=False)  # every method is evaluated at its last scheduled sync
    if spec.method == "ddp":
        diloco = DiLoCoConfig(num_replicas=spec.replicas)
    else:
        diloco = DiLoCoConfig(num_replicas=spec.replicas, sync_period=spec.sync_period, num_fragments=spec.fragments,
                              overlap_steps=spec.overlap, alpha=spec.alpha, quantize=spec.quantize,
                              error_feedback=spec.error_feedback, outer_lr=scale.outer_lr,
                              outer_momentum=scale.outer_momentum, outer_overlap=spec.outer_overlap)
    return Config(algorithm="ddp" if spec.method == "ddp" else "diloco", run_dir=run_dir, model=model, diloco=diloco,
                  train=train, data=DataConfig(source="corpus", max_corpus_bytes=scale.max_corpus_bytes),
                  checkpoint=CheckpointConfig(every=0))


def devices_for(specs: Sequence[RunSpec]) -> int:
    """Replicas, plus one communication device per replica for overlapped syncs."""
    return max(s.replicas * (2 if s.overlap > 0 or s.outer_overlap != "none" else 1) for s in specs)
