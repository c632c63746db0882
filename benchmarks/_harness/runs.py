"""Running the trainer in-process and reading back what it wrote: metrics.jsonl, final
numbers and eval curves, averages over seeds, and temporary run folders."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any


def read_metrics(run_dir: pathlib.Path) -> tuple[list[dict], list[dict]]:
    """(per-step lines, eval lines) of `<run_dir>/metrics.jsonl`."""
    steps, evals = [], []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if "eval_loss" in record:
            evals.append(record)
        elif "loss" in record:
            steps.append(record)
    return steps, evals


def summarize_run(run_dir: pathlib.Path, summary: dict[str, Any], tokens_per_step: int) -> dict[str, Any]:
    """Final numbers and curves of one finished run, from the trainer's summary and metrics.jsonl.

    `curve` holds one point per evaluation: step, eval loss of the global model, bytes one
    replica had sent by then, and tokens consumed by all replicas together.
    """
    steps, evals = read_metrics(run_dir)
    sent_at = {s["step"]: s["sent_bytes"] for s in steps}
    curve = []
    for e in evals:
        t = e["step"]
        # With log_every=1 every step has a line; otherwise use the latest logged step before t.
        sent = sent_at.get(t, max([v for k, v in sent_at.items() if k <= t], default=0))
        curve.append({"step": t, "eval_loss": e["eval_loss"], "sent_bytes": sent, "tokens": t * tokens_per_step})
    last = steps[-1] if steps else {}
    train_tail = [s["loss"] for s in steps[-max(1, len(steps) // 10) :]]
    return {
        "eval_loss": summary.get("eval_loss", evals[-1]["eval_loss"] if evals else None),
        "sent_bytes": summary.get("sent_bytes", last.get("sent_bytes")),
        "peak_sync_bytes": summary.get("peak_sync_bytes", last.get("peak_sync_bytes")),
        "wire_bytes": summary.get("wire_bytes", last.get("wire_bytes")),
        "metrics_sent_bytes": last.get("sent_bytes"),
        "metrics_peak_sync_bytes": last.get("peak_sync_bytes"),
        "final_train_loss": statistics.fmean(train_tail) if train_tail else None,
        "curve": curve,
    }


def train_and_summarize(config, *, fresh: bool = True) -> dict[str, Any]:
    """Run the trainer on `config` (its run_dir is wiped first: a leftover checkpoint
    would make the trainer resume) and return `summarize_run`'s dict plus `elapsed_s`."""
    from eqx_diloco.lm.trainer import Trainer

    if fresh and config.run_dir.exists():
        shutil.rmtree(config.run_dir)
    start = time.perf_counter()
    summary = Trainer(config, verbose=False).run()
    elapsed = time.perf_counter() - start
    tokens_per_step = config.diloco.num_replicas * config.train.batch_size * config.train.seq_len
    out = summarize_run(config.run_dir, summary, tokens_per_step)
    out["elapsed_s"] = elapsed
    return out


def average_seeds(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Mean over seeds of the final numbers and of the curves (same eval steps); std of eval loss."""
    first = dict(results[0])
    if len(results) == 1:
        first["eval_loss_std"] = 0.0
        first["seed_eval_losses"] = [first["eval_loss"]]
        return first
    losses = [r["eval_loss"] for r in results]
    out = dict(first)
    out["eval_loss"] = statistics.fmean(losses)
    out["eval_loss_std"] = statistics.stdev(losses)
    out["seed_eval_losses"] = losses
    out["final_train_loss"] = statistics.fmean(r["final_train_loss"] for r in results)
    out["elapsed_s"] = sum(r["elapsed_s"] for r in results)
    out["curve"] = [
        {**points[0], "eval_loss": statistics.fmean(p["eval_loss"] for p in points)}
        for points in zip(*(r["curve"] for r in results))
    ]
    return out



class TemporaryRunDirs:
    """A folder for run directories: a temporary one (deleted on exit) unless `keep` is given."""

    def __init__(self, keep: str | os.PathLike | None = None):
        self.keep = None if keep is None else pathlib.Path(keep)
        self._tmp = None

    def __enter__(self) -> pathlib.Path:
        if self.keep is not None:
            self.keep.mkdir(parents=True, exist_ok=True)
            return self.keep
        self._tmp = tempfile.TemporaryDirectory(prefix="eqx_diloco_bench_")
        return pathlib.Path(self._tmp.name)

    def __exit__(self, *exc):
        if self._tmp is not None:
            self._tmp.cleanup()


def small_lm_config(*, quick: bool, steps: int, sync_period: int, num_replicas: int, seed: int,
                    run_dir: pathlib.Path, diloco: dict[str, Any] | None = None, optim: dict[str, Any] | None = None):
    """The small LM run the outer-gradient benchmarks compare settings on: 4 layers x 64, 4
    sequences x 64 tokens per replica step, lr 3e-3, the embedded corpus (8 MB), evaluations
    every steps / 5 on 64 held-out sequences, no checkpoints, no compilation cache; `quick`
    shrinks all of it for tests. `diloco` and `optim` override `DiLoCoConfig` / `OptimConfig` fields."""
    from eqx_diloco.lm.config import CheckpointConfig, Config, DataConfig, DiLoCoConfig, OptimConfig, TrainConfig
    from models import TransformerConfig

    q = quick
    model = TransformerConfig(num_layers=2 if q else 4, dim=32 if q else 64, num_heads=2 if q else 4,
                              mlp_ratio=2 if q else 4)
    train = TrainConfig(steps=steps, batch_size=2 if q else 4, seq_len=16 if q else 64, lr=3e-3,
                        warmup_steps=2 if q else 20, seed=seed, log_every=10, eval_every=steps // 5,
                        eval_sequences=8 if q else 64)
    return Config(run_dir=run_dir, model=model, train=train, optim=OptimConfig(**(optim or {})),
                  diloco=DiLoCoConfig(num_replicas=num_replicas, sync_period=sync_period, **(diloco or {})),
                  data=DataConfig(source="corpus", max_corpus_bytes=200_000 if q else 8_000_000),
                  checkpoint=CheckpointConfig(every=0), compile_cache=False)
