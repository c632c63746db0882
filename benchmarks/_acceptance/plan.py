"""What the acceptance benchmark runs: its modes, the runs and the comparisons between
them, their trainer configs, and the id of the settings a run was made with."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
from typing import Any

from benchmarks import _common as common
from benchmarks import convergence

NAME = "acceptance"
REPO = common.REPO
NUM_DEVICES = 4  # 2 replicas + 2 communication devices (tau > 0); the same in every mode


@dataclasses.dataclass(frozen=True)
class Mode:
    """What a mode changes in the convergence benchmark's scale of the same name."""

    sync_period: int  # H of every DiLoCo / streaming run
    fragments: int  # P of the streaming runs
    overlap: int  # tau of the streaming runs
    eval_every: int  # only the curves; the final evaluation is at the last step in every mode
    seeds: tuple[int, ...]
    steps: int | None = None  # None: the convergence scale's steps


MODES = {
    "smoke": Mode(sync_period=6, fragments=3, overlap=1, eval_every=6, seeds=(0, 1), steps=12),
    "quick": Mode(sync_period=20, fragments=5, overlap=1, eval_every=50, seeds=(0, 1, 2)),
    "full": Mode(sync_period=20, fragments=5, overlap=1, eval_every=100, seeds=(0, 1, 2)),
}


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    label: str
    spec: convergence.RunSpec


@dataclasses.dataclass(frozen=True)
class Comparison:
    name: str
    label: str
    run: str
    reference: str
    requirement: str
    threshold_pct: float | None  # None: "not worse beyond seed noise"


COMPARISONS = (
    Comparison("diloco_vs_ddp", "DiLoCo R = 2 vs DDP R = 2", "diloco_r2", "ddp_r2", "within 4% of DDP", 4.0),
    Comparison("streaming_vs_diloco", "Streaming vs DiLoCo (R = 2)", "streaming_r2", "diloco_r2",
               "within 1% of DiLoCo", 1.0),
    Comparison("int4_vs_float32", "int4 + error feedback vs float32 (Streaming R = 2)", "streaming_r2_int4_ef",
               "streaming_r2", "within 1% of float32", 1.0),
    Comparison("r1_vs_plain", "DiLoCo R = 1 vs plain training", "diloco_r1", "plain_r1",
               "not worse than plain training beyond seed noise", None),
)


def default_outer() -> dict[str, Any]:
    """The CLI's default outer optimizer (the library's `DiLoCoConfig` defaults)."""
    from eqx_diloco.lm.config import DiLoCoConfig

    d = DiLoCoConfig()
    return {"outer_lr": d.outer_lr, "outer_momentum": d.outer_momentum, "nesterov": d.nesterov}


def scale_for(mode: str, steps: int | None = None) -> convergence.Scale:
    m, outer = MODES[mode], default_outer()
    return dataclasses.replace(convergence.SCALES[mode], steps=steps or m.steps or convergence.SCALES[mode].steps,
                               eval_every=m.eval_every, outer_lr=outer["outer_lr"],
                               outer_momentum=outer["outer_momentum"])


def runs_for(mode: str, scale: convergence.Scale) -> list[Run]:
    m, b = MODES[mode], scale.batch_size
    H, P, tau = m.sync_period, m.fragments, m.overlap
    stream = f"Streaming R = 2, H = {H}, P = {P}, tau = {tau}"
    RunSpec = convergence.RunSpec
    return [
        Run("ddp_r2", "DDP R = 2", RunSpec("ddp", 2, b)),
        Run("diloco_r2", f"DiLoCo R = 2, H = {H}", RunSpec("diloco", 2, b, H)),
        Run("streaming_r2", stream, RunSpec("streaming", 2, b, H, P, tau)),
        Run("streaming_r2_int4_ef", stream + ", int4 + error feedback",
            RunSpec("streaming", 2, b, H, P, tau, 0.0, "int4", True)),
        Run("plain_r1", "plain training (DDP R = 1)", RunSpec("ddp", 1, b)),
        Run("diloco_r1", f"DiLoCo R = 1, H = {H}", RunSpec("diloco", 1, b, H)),
    ]


def make_config(run: Run, scale: convergence.Scale, run_dir: pathlib.Path, seed: int):
    """The convergence benchmark's config of this spec, with the trainer's default final sync."""
    from eqx_diloco.lm.config import TrainConfig

    config = convergence.make_config(run.spec, scale, run_dir, seed)
    train = dataclasses.replace(config.train, final_sync=TrainConfig().final_sync, log_every=10)
    return dataclasses.replace(config, train=train)


def settings(mode: str, scale: convergence.Scale) -> dict[str, Any]:
    m = MODES[mode]
    return {"scale": dataclasses.asdict(scale), "sync_period": m.sync_period, "fragments": m.fragments,
            "overlap": m.overlap, **default_outer(), "num_devices": NUM_DEVICES}


def settings_id(s: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(s, sort_keys=True).encode()).hexdigest()[:12]
