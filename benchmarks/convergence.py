"""Convergence at a fixed token budget: data parallel vs DiLoCo vs Streaming DiLoCo.

Every run trains the same model from the same seed on the embedded corpus (the Python
standard library's sources, byte level) and is evaluated on the same held-out windows.
For each run we report the final eval loss of the *global* model (theta_g; for DDP the
replicas' common params), the bytes one replica sent over the whole run, and the peak
bytes one replica sends at a single step (the bandwidth a link must sustain if a sync has
to fit in one step). Plots: eval loss against steps and against bytes sent.

Token budget ("same total tokens"): with R replicas of per-replica batch b trained for S
steps the run consumes R * b * S * seq_len tokens. All runs keep R * b * S fixed:

- the R = 2 group (DDP, DiLoCo, Streaming DiLoCo) uses b = B and S steps;
- the R = 4 group uses b = B / 2 and the same S steps (same global batch, same number of
  steps, so the same tokens, the "scaling laws for DiLoCo" setting: more replicas at a
  fixed budget). DDP R = 4 with b = B / 2 computes the same gradient as DDP R = 2 with
  b = B; only the data order differs (each replica reads its own share of the corpus).

Whole-round overlap (`--diloco.outer-overlap`, arXiv 2502.12996): DiLoCo R = 2 with the
outer step overlapped with the next round, delayed and eager at H = 10, eager at H = 50.
Like every run here they are evaluated at their last scheduled sync (no final sync), so
their last round's exchange is not landed.

Sync periods: the model has L = 4 layers so Streaming DiLoCo with P = L + 1 = 5 fragments
(fragment 0 = embeddings/final norm/head, fragments 1..4 = one layer each) and P = 2
(fragment 1 = all layers) both divide H for H in {10, 50}, the issue's values. Streaming
runs use H = 50 (the larger H: one fragment every H / P = 10 steps for P = 5), where
tau in {0, 1, 4} is allowed (tau < H / P). DiLoCo runs use H in {10, 50}.

Modes:

- `--quick` (default): L = 4, dim 64, seq 64, B = 8, 500 steps, 16 runs, a subset of the
  streaming grid; about 5-8 minutes on 2 idle CPU cores.
- `--full`: L = 4, dim 128, seq 128, B = 8, 1000 steps, the whole streaming grid
  (P x tau x alpha, plus int4); roughly an hour or more on 2 CPU cores.
- `--smoke`: microscopic, for tests only (numbers are meaningless).

Output in `--out-dir` (default `runs/benchmarks/convergence_<mode>`; the committed results
under `benchmarks/results` are written only when `--out-dir benchmarks/results` is given):
`convergence.json` (or `--json PATH`), `convergence.md` and two PNG plots.

Run `python -m benchmarks.convergence --help`.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/convergence.py`
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import _common as common
from benchmarks._convergence.report import add_relative, plot, report
from benchmarks._convergence.suite import SCALES, RunSpec, Scale, devices_for, make_config, suite


def run_suite(specs: Sequence[RunSpec], scale: Scale, *, seeds: Sequence[int] = (0,),
              runs_dir: pathlib.Path, log=None) -> list[dict[str, Any]]:
    """Train every spec for every seed; return one row per spec (seed-averaged numbers + curve)."""
    log = log or (lambda msg: print(msg, flush=True))
    rows = []
    for i, spec in enumerate(specs):
        per_seed = []
        for seed in seeds:
            run_dir = runs_dir / f"{i:02d}_{spec.name.replace(' ', '_')}_s{seed}"
            per_seed.append(common.train_and_summarize(make_config(spec, scale, run_dir, seed)))
        result = common.average_seeds(per_seed)
        row = {"name": spec.name, **dataclasses.asdict(spec), **result}
        row["tokens"] = spec.replicas * spec.batch_size * scale.steps * scale.seq_len
        rows.append(row)
        log(f"[{i + 1}/{len(specs)}] {spec.name:<40} eval_loss {row['eval_loss']:.4f}  "
            f"sent {common.fmt_bytes(row['sent_bytes']):>10}  "
            f"peak/step {common.fmt_bytes(row['peak_sync_bytes']):>10}  {row['elapsed_s']:.1f}s")
    add_relative(rows)
    return rows




def run(mode: str = "quick", *, seeds: Sequence[int] = (0,), only: str | Sequence[str] | None = None,
        out_dir: pathlib.Path | None = None, json_path: pathlib.Path | None = None, keep_runs=None,
        make_plots: bool = True, log=None, **overrides) -> dict[str, Any]:
    """Run the benchmark of `mode` and write markdown, JSON and plots. Returns the JSON dict.

    `overrides` replace fields of the mode's `Scale` (e.g. steps=200, outer_lr=0.5); None
    values are ignored. Expects the CPU device count to be set already (see `main`)."""
    scale = dataclasses.replace(SCALES[mode], **{k: v for k, v in overrides.items() if v is not None})
    specs = suite(scale, "smoke" if mode == "smoke" else mode)
    if only:
        wanted = [only] if isinstance(only, str) else list(only)
        specs = [s for s in specs if any(text in s.name for text in wanted)]
    out_dir = pathlib.Path(out_dir or common.default_out_dir("convergence", mode))
    start = time.perf_counter()
    with common.TemporaryRunDirs(keep_runs) as runs_dir:
        rows = run_suite(specs, scale, seeds=seeds, runs_dir=runs_dir, log=log)
    text = report(rows, scale, mode, seeds)
    result = {
        "benchmark": "convergence",
        "mode": mode,
        "scale": dataclasses.asdict(scale),
        "seeds": list(seeds),
        "machine": common.machine_info(),
        "total_elapsed_s": time.perf_counter() - start,
        "runs": rows,
    }
    common.write_text(out_dir / "convergence.md", text)
    common.write_json(json_path or out_dir / "convergence.json", result)
    if make_plots:
        result["plots"] = [str(p) for p in plot(rows, out_dir)]
    return result | {"markdown": text}


def replot(json_path: pathlib.Path, out_dir: pathlib.Path) -> dict[str, Any]:
    """Redraw the plots and the markdown table of a saved run."""
    import json

    result = json.loads(pathlib.Path(json_path).read_text())
    scale = Scale(**{k: tuple(v) if isinstance(v, list) else v for k, v in result["scale"].items()})
    text = report(result["runs"], scale, result["mode"], result["seeds"])
    common.write_text(out_dir / "convergence.md", text)
    plots = plot(result["runs"], out_dir)
    print(text)
    print("wrote", ", ".join(str(p) for p in [out_dir / "convergence.md", *plots]))
    return result | {"markdown": text, "plots": [str(p) for p in plots]}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_mode_flags(parser)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="average over these seeds")
    parser.add_argument("--steps", type=int, default=None, help="override the mode's step count")
    parser.add_argument("--lr", type=float, default=None, help="override the inner AdamW peak learning rate")
    parser.add_argument("--outer-lr", type=float, default=None, help="override the outer SGD learning rate (0.7)")
    parser.add_argument("--outer-momentum", type=float, default=None, help="override the outer momentum (0.9)")
    parser.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                        help="run only specs whose name contains one of these texts")
    parser.add_argument("--out-dir", type=pathlib.Path, default=None,
                        help="where the JSON, markdown and PNG plots go (default runs/benchmarks/convergence_<mode>; "
                             "committed results under benchmarks/results only when given explicitly)")
    parser.add_argument("--json", type=pathlib.Path, default=None,
                        help="JSON output (default: <out-dir>/convergence.json)")
    parser.add_argument("--keep-runs", type=pathlib.Path, default=None,
                        help="keep the run folders (metrics.jsonl) here instead of a temporary folder")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--replot", type=pathlib.Path, default=None, metavar="JSON",
                        help="train nothing: redraw the plots and markdown from a saved JSON into --out-dir")
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="do not share compiled programs between runs through a temporary persistent cache")
    args = parser.parse_args(argv)
    mode = args.mode or "quick"
    args.out_dir = args.out_dir or common.default_out_dir("convergence", mode)
    if args.replot is not None:
        return replot(args.replot, args.out_dir)
    scale = SCALES[mode]
    with tempfile.TemporaryDirectory(prefix="eqx_diloco_jaxcache_") as cache:
        common.setup_jax(devices_for(suite(scale, "smoke" if mode == "smoke" else mode)),
                         compile_cache=None if args.no_compile_cache else cache)
        result = run(mode, seeds=args.seeds, only=args.only, out_dir=args.out_dir, json_path=args.json,
                     keep_runs=args.keep_runs, make_plots=not args.no_plots, steps=args.steps, lr=args.lr,
                     outer_lr=args.outer_lr, outer_momentum=args.outer_momentum)
    print()
    print(result["markdown"])
    written = [args.json or args.out_dir / "convergence.json", args.out_dir / "convergence.md",
               *result.get("plots", [])]
    print(f"total {result['total_elapsed_s']:.0f}s; wrote {', '.join(map(str, written))}")
    return result


if __name__ == "__main__":
    main()
