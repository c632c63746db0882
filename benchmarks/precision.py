"""bfloat16 against float32 compute on the embedded corpus, same seeds (issue #31's precision policy).

Runs the CLI's trainer in-process (DiLoCo, the CLI's defaults otherwise) on a small model for
`--model.dtype float32` and `--model.dtype bfloat16` at each seed, and writes the final eval loss
of every run, mean +- sd per dtype and the relative gap per seed (acceptance: within 2%) to
`benchmarks/results/precision.json` with the git revision and the machine.

    python -m benchmarks.precision                 # 3 seeds x 2 dtypes, 200 steps: 15-20 min on 2 CPU cores
    python -m benchmarks.precision --steps 20 --seeds 1 --out /tmp/p.json   # a quick look

On CPU, XLA runs bfloat16 matmuls slower than float32 ones (no native bf16 units), so this measures
loss, not speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import tempfile
import time

from benchmarks._common import RESULTS_DIR, machine_info, revision, setup_jax, write_json

MODEL = {"num_layers": 4, "dim": 128, "num_heads": 4, "vocab_size": 256}
DTYPES = ("float32", "bfloat16")


def make_config(dtype: str, seed: int, steps: int, run_dir: pathlib.Path):
    from eqx_diloco.lm.config import CheckpointConfig, Config, TrainConfig
    from models import TransformerConfig

    return Config(
        run_dir=run_dir,
        model=TransformerConfig(**MODEL, dtype=dtype),
        train=TrainConfig(steps=steps, seed=seed, eval_every=0, log_every=max(1, steps // 5), warmup_steps=steps // 10),
        checkpoint=CheckpointConfig(every=0),
        compile_cache=False,
    )


def run_one(dtype: str, seed: int, steps: int, tmp: pathlib.Path) -> dict:
    from eqx_diloco.lm.trainer import Trainer

    config = make_config(dtype, seed, steps, tmp / f"{dtype}_{seed}")
    start = time.perf_counter()
    summary = Trainer(config, verbose=False).run()
    return {"dtype": dtype, "seed": seed, "eval_loss": float(summary["eval_loss"]),
            "elapsed_s": round(time.perf_counter() - start, 1)}


def mean_sd(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS_DIR / "precision.json")
    args = parser.parse_args(argv)
    setup_jax(2)  # the CLI's default: 2 replicas, one device each
    rev = revision()  # of the code that runs (read now: the checkout may move on during the runs)
    runs = []
    with tempfile.TemporaryDirectory(prefix="precision_") as tmp:
        for seed in range(args.seeds):
            for dtype in DTYPES:
                runs.append(run_one(dtype, seed, args.steps, pathlib.Path(tmp)))
                r = runs[-1]
                print(f"seed {seed}  {dtype:<8}  eval loss {r['eval_loss']:.4f}  ({r['elapsed_s']:.0f} s)", flush=True)
    by = {d: {r["seed"]: r["eval_loss"] for r in runs if r["dtype"] == d} for d in DTYPES}
    gaps = {s: (by["bfloat16"][s] - by["float32"][s]) / by["float32"][s] for s in by["float32"]}
    config = make_config("float32", 0, args.steps, pathlib.Path("runs/precision"))
    result = {
        "what": "final eval loss of the global model, --model.dtype float32 vs bfloat16, same seeds, embedded corpus",
        "model": MODEL,
        "train": {k: v for k, v in dataclasses.asdict(config.train).items() if k in ("steps", "batch_size", "seq_len",
                                                                                        "lr", "warmup_steps")},
        "diloco": {"num_replicas": config.diloco.num_replicas, "sync_period": config.diloco.sync_period},
        "runs": runs,
        "eval_loss": {d: mean_sd(list(by[d].values())) for d in DTYPES},
        "relative_gap_per_seed": gaps,
        "max_abs_relative_gap": max(abs(g) for g in gaps.values()),
        "within_2_percent": all(abs(g) <= 0.02 for g in gaps.values()),
        "revision": rev,
        "machine": machine_info(),
    }
    write_json(args.out, result)
    for d in DTYPES:
        stat = result["eval_loss"][d]
        print(f"{d:<8}  eval loss {stat['mean']:.4f} +- {stat['sd']:.4f} over {stat['n']} seeds")
    print(f"largest per-seed gap {100 * result['max_abs_relative_gap']:.2f}% -> {args.out}")
    return result


if __name__ == "__main__":
    main()
