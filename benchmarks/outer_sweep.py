"""Outer-optimizer study: outer lr x outer momentum x per-replica batch x H, DDP beside every cell.

Question: which outer SGD settings (lr, momentum, Nesterov) make DiLoCo R = 2 closest to
data-parallel training at equal tokens, and how the gap moves with the per-replica batch
(the papers run 10^5-10^6 tokens per replica step; the CLI and the benchmarks run ~10^3).

Every run trains the same model on the embedded corpus (the standard library's sources,
bytes) and is evaluated on the same held-out windows; the number is the final eval loss of
the *global* model (DDP: the shared params). For every per-replica batch b the grid holds

- DDP, R = 2, batch b (the reference: same tokens, same steps, same seed);
- DiLoCo, R = 2, batch b, for every H and every outer setting;
- at the batches in `r1_batch_sizes`: plain training (DDP with R = 1) and DiLoCo R = 1 with
  every outer setting that has momentum or lr != 1 (papers: R = 1 DiLoCo matches or beats
  plain training; with lr 1 and no momentum it *is* plain training, so that cell is skipped).

Steps are the same for every batch size: a larger batch means more tokens, never fewer
steps, so DDP and DiLoCo always compare at equal tokens and equal steps. Gaps are paired:
for each seed, 100 * (loss - loss of the reference with the same seed) / reference, then
mean, standard deviation and a 95% t-interval over seeds, all computed here from the
per-seed numbers stored in the JSON.

Data split: the study uses `--data.split contiguous` by default (replica r samples only its
own half of the train split), the CLI's default and the realistic case for islands that
hold their own data; the convergence benchmark reads the data the same way, so numbers are
comparable with it (the issue measured iid vs contiguous at 512 tokens: +8.1% vs +8.3%).
`--split iid` measures the papers' setting (every replica samples the whole train split);
the script refuses it if the trainer in use does not pass `DataConfig.split` to its batches.

Simulated devices: the CPU device count is pinned to NUM_CPU_DEVICES (2) in every mode,
before JAX starts, and recorded in the JSON (results move by ~0.5% with the device count).

Modes (each is one or more sub-studies, all written to one JSONL and one JSON):

- default (`--full`), sub-study `batch`: 4 layers, dim 64, seq 64, inner AdamW lr 3e-3
  (the convergence benchmark's quick scale), per-replica batches of 512, 2048 and 8192
  tokens (batch 8, 32, 128), H = 10, outer settings lr/momentum 1.0/0 (plain averaging),
  0.7/Nesterov 0.9 (the papers'), 1.0/Nesterov 0.3 (the issue's best single-seed result),
  R = 1 rows at 512 tokens, 3 seeds, **100 steps** for every batch. 100 and not 500 steps:
  an 8192-token step of R = 2 costs 1.6-2.4 s on one (shared) CPU core, so 500 steps would
  be ~15 minutes per run; the whole grid at 100 steps is about an hour on one idle core.
  `--steps 500` is the same study at the longer budget.
- `--full --study default_regime`: 512 tokens per replica step for 500 steps (the
  convergence benchmark's quick scale and the issue's measurements), R = 1 and R = 2.
- `--quick`: a microscopic version of both sub-studies (2 layers, dim 16, 10 steps, 2
  seeds) that exercises the whole pipeline; used by the tests, numbers are meaningless.
- `--report`: train nothing; read a saved JSON (`--from`: the file or a study folder,
  default `--out`; with a folder, runs appended to its JSONL since are included) and write
  the JSON, markdown and plots into `--out`.
- `--plan`: print the runs the chosen options would make, and exit.

Order and resuming: cells run most important first (R = 1 rows, then per outer setting the
smallest batch, the largest, the ones between), all seeds of a cell together, so a study
cut short has full seed sets for the cells it reached. Every finished run is appended to
`<out>/outer_sweep_runs.jsonl` and the JSON and markdown are rewritten; started again with
the same options, the study skips runs already there (runs made with other scale options
are ignored). Output: `<out>/outer_sweep.json`, `outer_sweep.md`,
`outer_sweep_<study>_gap_vs_batch.png`, `outer_sweep_<study>_loss_vs_step.png`. The
default `--out` is a scratch folder under runs/; committed results under benchmarks/results
are written only when `--out benchmarks/results` is given.

Run `python -m benchmarks.outer_sweep --help`.
"""


from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/outer_sweep.py`
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks._outer_sweep.grid import NUM_CPU_DEVICES

if __name__ == "__main__":  # before anything starts a JAX backend
    import jax

    jax.config.update("jax_num_cpu_devices", NUM_CPU_DEVICES)

from benchmarks import _common as common
from benchmarks._outer_sweep.grid import (  # noqa: F401  (the names the tests use)
    DEFAULT_SEEDS,
    DEFAULT_STUDIES,
    NAME,
    STUDIES,
    Outer,
    Scale,
    Spec,
    parse_outer,
    plan,
    scale_id,
)
from benchmarks._outer_sweep.report import build_result, render_markdown, report, write_outputs
from benchmarks._outer_sweep.runs import run_key, run_studies  # noqa: F401


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--full", dest="mode", action="store_const", const="full",
                      help="the real study (the default): see Modes above")
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick",
                      help="microscopic, < 1 minute, for the test suite (numbers are meaningless)")
    parser.add_argument("--report", action="store_true",
                        help="train nothing: render JSON, markdown and plots into --out from --from")
    parser.add_argument("--from", dest="source", type=pathlib.Path, default=None,
                        help="with --report: a study folder or a saved outer_sweep.json (default: --out)")
    parser.add_argument("--plan", action="store_true", help="print the runs of the chosen options and exit")
    parser.add_argument("--study", nargs="+", default=None,
                        help="sub-studies to run (default: full: batch; quick: default_regime batch; "
                             "full also has default_regime)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="seeds run for every cell (default: 0 1 2; --quick: 0 1)")
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help="output folder (default: runs/outer_sweep_<mode>; results under benchmarks/results "
                             "are written only when it is given explicitly)")
    parser.add_argument("--steps", type=int, default=None,
                        help="inner steps of every run of every sub-study (same for every batch)")
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=None,
                        help="sequences per replica per step (tokens = batch x seq len) of the R = 2 cells, every "
                             "sub-study; given with no value: no R = 2 cells (only the R = 1 rows)")
    parser.add_argument("--r1-batch-sizes", type=int, nargs="*", default=None,
                        help="batches of the R = 1 rows (plain training and DiLoCo R = 1), every sub-study; given "
                             "with no value: no R = 1 rows (they can be added later into the same --out)")
    parser.add_argument("--sync-periods", type=int, nargs="+", default=None, help="H values, every sub-study")
    parser.add_argument("--outer", type=parse_outer, nargs="+", default=None, metavar="LR:MOMENTUM[:plain]",
                        help="outer settings in priority order (Nesterov unless ':plain'), every sub-study")
    parser.add_argument("--split", choices=("contiguous", "iid"), default=None,
                        help="--data.split of every run (default contiguous, see above)")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    mode_name = args.mode or "full"
    out = args.out or common.REPO / "runs" / f"{NAME}_{mode_name}"
    if args.report:
        result = report(args.source or out, out, make_plots=not args.no_plots)
        print(render_markdown(result))
        return result
    overrides = {"steps": args.steps, "split": args.split,
                 "batch_sizes": tuple(args.batch_sizes) if args.batch_sizes is not None else None,
                 "r1_batch_sizes": tuple(args.r1_batch_sizes) if args.r1_batch_sizes is not None else None,
                 "sync_periods": tuple(args.sync_periods) if args.sync_periods else None,
                 "outers": tuple(args.outer) if args.outer else None}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    chosen = args.study or DEFAULT_STUDIES[mode_name]
    studies = {name: dataclasses.replace(scale, **overrides) for name, scale in STUDIES[mode_name].items()
               if name in chosen}
    if not studies:
        raise SystemExit(f"--study: none of {args.study} in {list(STUDIES[mode_name])}")
    seeds = tuple(args.seeds) if args.seeds else DEFAULT_SEEDS[mode_name]
    if args.plan:
        for name, scale in studies.items():
            for spec in plan(scale):
                print(f"{name:<16} {spec.cell:<36} {spec.label():<50} seeds {list(seeds)}")
        return {}
    import jax

    cache = out / "jax_cache"  # identical programs (seeds of one cell) compile once; results unchanged
    cache.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    if len(jax.devices()) != NUM_CPU_DEVICES:
        raise SystemExit(f"expected {NUM_CPU_DEVICES} CPU devices, JAX has {len(jax.devices())} "
                         "(run this file as a script, not imported after JAX started)")
    def checkpoint(records):  # JSON and markdown after every run, so a cut study still has them
        write_outputs(build_result(records, studies, seeds, mode_name), out, make_plots=False)

    records = run_studies(studies, seeds, out, log=lambda msg: print(msg, flush=True), on_record=checkpoint)
    result = build_result(records, studies, seeds, mode_name)
    written = write_outputs(result, out, make_plots=not args.no_plots)
    print()
    print(render_markdown(result))
    print(f"total run time {result['total_run_s']:.0f}s; wrote {', '.join(map(str, written))}")
    return result


if __name__ == "__main__":
    main()
