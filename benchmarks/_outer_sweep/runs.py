"""Training the study's runs: one config per (cell, seed), the JSONL log of finished runs
that makes a study resumable, and the remaining-time estimate."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import statistics
import time
from collections.abc import Sequence
from typing import Any

from benchmarks import _common as common
from benchmarks._outer_sweep.grid import NAME, NUM_CPU_DEVICES, Scale, Spec, plan, scale_id


def make_config(spec: Spec, scale: Scale, run_dir: pathlib.Path, seed: int):
    from eqx_diloco.lm import CheckpointConfig, Config, DataConfig, DiLoCoConfig, TrainConfig
    from models import TransformerConfig

    model = TransformerConfig(num_layers=scale.num_layers, dim=scale.dim, num_heads=scale.num_heads,
                              mlp_ratio=scale.mlp_ratio)
    train = TrainConfig(steps=scale.steps, batch_size=spec.batch_size, seq_len=scale.seq_len, lr=scale.lr,
                        warmup_steps=scale.warmup_steps, seed=seed, log_every=10, eval_every=scale.eval_every,
                        eval_sequences=scale.eval_sequences)
    if spec.algorithm == "ddp":
        diloco = DiLoCoConfig(num_replicas=spec.replicas)
    else:
        diloco = DiLoCoConfig(num_replicas=spec.replicas, sync_period=spec.sync_period, outer_lr=spec.outer_lr,
                              outer_momentum=spec.outer_momentum, nesterov=spec.nesterov)
    data = DataConfig(source="corpus", max_corpus_bytes=scale.max_corpus_bytes, split=scale.split)
    return Config(algorithm=spec.algorithm, run_dir=run_dir, model=model, diloco=diloco, train=train, data=data,
                  checkpoint=CheckpointConfig(every=0))


def check_split_honoured(scale: Scale, tmp: pathlib.Path) -> None:
    """Refuse a non-default split the trainer would silently ignore."""
    if scale.split == "contiguous":
        return
    from eqx_diloco.lm import Trainer

    trainer = Trainer(make_config(Spec("ddp", 2, scale.batch_sizes[0]), scale, tmp / "split_check", 0), verbose=False)
    batches = getattr(trainer, "batches", None)
    if batches is None:
        print(f"warning: cannot check that the trainer honours --split {scale.split}", flush=True)
    elif getattr(batches, "split", "contiguous") != scale.split:
        raise SystemExit(f"--split {scale.split}: this trainer does not pass DataConfig.split to its batches")


def run_one(study: str, spec: Spec, scale: Scale, seed: int, run_dir: pathlib.Path) -> dict[str, Any]:
    """Train one run through the public API; read its final numbers and curve from metrics.jsonl."""
    from eqx_diloco.lm.trainer import train

    if run_dir.exists():  # a run killed half-way: start it again from scratch
        shutil.rmtree(run_dir)
    start = time.perf_counter()
    train(make_config(spec, scale, run_dir, seed), verbose=False)
    elapsed = time.perf_counter() - start
    steps, evals = common.read_metrics(run_dir)
    if not evals or evals[-1]["step"] != scale.steps:
        raise RuntimeError(f"{run_dir}: no final evaluation in metrics.jsonl")
    tail = [s["loss"] for s in steps[-max(1, len(steps) // 10):]]
    return {
        "key": run_key(study, spec, seed),
        "study": study,
        "cell": spec.cell,
        "spec": dataclasses.asdict(spec),
        "seed": seed,
        "scale_id": scale_id(scale),
        "eval_loss": evals[-1]["eval_loss"],
        "final_train_loss": statistics.fmean(tail) if tail else None,
        "curve": [[e["step"], e["eval_loss"]] for e in evals],
        "elapsed_s": elapsed,
    }


def run_key(study: str, spec: Spec, seed: int) -> str:
    return f"{study}/{spec.cell}_s{seed}"


def load_records(path: pathlib.Path) -> list[dict[str, Any]]:
    """Finished runs in a JSONL log (a line cut short by a kill is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def matching(records: Sequence[dict[str, Any]], study: str, scale: Scale, seeds: Sequence[int]) -> list[dict]:
    """The records of `study` made with `scale`'s settings, for cells of its grid and `seeds`."""
    sid, cells = scale_id(scale), {s.cell for s in plan(scale)}
    return [r for r in records if r.get("study") == study and r.get("scale_id") == sid and r["cell"] in cells
            and r["seed"] in seeds]


class Eta:
    """Remaining time from the runs finished in this session: seconds = a + c * tokens, fitted."""

    def __init__(self):
        self.points: list[tuple[float, float]] = []

    def add(self, tokens: float, seconds: float) -> None:
        self.points.append((tokens, seconds))

    def estimate(self, tokens: float) -> float | None:
        if not self.points:
            return None
        xs, ys = zip(*self.points)
        if len(set(xs)) < 2:
            return sum(ys) / sum(xs) * tokens
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        slope = max(slope, 0.0)
        return max(0.0, my - slope * mx) + slope * tokens


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = round(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def run_studies(studies: dict[str, Scale], seeds: Sequence[int], out: pathlib.Path, log=print,
                on_record=None) -> list[dict]:
    """Run every (study, cell, seed) not already in `<out>/outer_sweep_runs.jsonl`; return all records."""
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / f"{NAME}_runs.jsonl"
    existing = load_records(jsonl)
    done = {r["key"]: r for name, scale in studies.items() for r in matching(existing, name, scale, seeds)}
    todo = [(name, spec, seed) for name, scale in studies.items() for spec in plan(scale) for seed in seeds
            if run_key(name, spec, seed) not in done]
    total = len(done) + len(todo)
    log(f"{NAME}: {total} runs ({len(done)} already in {jsonl.name}, {len(todo)} to go); "
        f"{NUM_CPU_DEVICES} simulated CPU devices; split {', '.join(sorted({s.split for s in studies.values()}))}")
    for scale in studies.values():
        check_split_honoured(scale, out / "runs")
    tokens = lambda name, spec: (spec.replicas * spec.batch_size * studies[name].seq_len
                                 * studies[name].steps)
    eta, study_start = Eta(), time.perf_counter()
    for i, (name, spec, seed) in enumerate(todo):
        record = run_one(name, spec, studies[name], seed, out / "runs" / name / f"{spec.cell}_s{seed}")
        with jsonl.open("a") as f:
            f.write(json.dumps(record) + "\n")
        done[record["key"]] = record
        eta.add(tokens(name, spec), record["elapsed_s"])
        left = [eta.estimate(tokens(n, s)) for n, s, _ in todo[i + 1:]]
        remaining = None if any(x is None for x in left) else sum(left)
        log(f"[{len(done)}/{total}] {record['key']:<48} eval {record['eval_loss']:.4f}  "
            f"{record['elapsed_s']:6.1f}s  elapsed {fmt_time(time.perf_counter() - study_start)}  "
            f"ETA {fmt_time(remaining)}")
        if on_record is not None:
            on_record(list(done.values()))
    return list(done.values())
