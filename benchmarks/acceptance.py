"""Issue 12's acceptance numbers with the CLI's default outer optimizer, over seeds.

Every run trains the same model on the embedded corpus (the standard library's sources,
bytes) at the quick scale of `benchmarks/convergence.py` (4 layers, width 64, 4 heads, seq
64, 8 sequences = 512 tokens per replica step, 500 steps, inner AdamW lr 3e-3) with the
outer SGD settings the CLI uses by default (read from `DiLoCoConfig()`: lr 1.0,
Nesterov 0.3) and the trainer's default `--train.final-sync` (stale fragments get one blocking
sync after the last step, so every method's evaluated global model holds all 500 steps).
The number is the final eval loss of the global model (DDP: the shared params) on the same
held-out windows. Runs (R replicas, batch per replica the same everywhere):

- `ddp_r2`: data parallel, R = 2;
- `diloco_r2`: DiLoCo, R = 2, H = 20;
- `streaming_r2`: Streaming DiLoCo, R = 2, H = 20, P = 5, tau = 1, alpha 0;
- `streaming_r2_int4_ef`: the same with `--diloco.quantize int4 --diloco.error-feedback`;
- `plain_r1`: plain training (DDP with R = 1);
- `diloco_r1`: DiLoCo, R = 1, H = 20.

Fragments: the issue asks for P = 4, which the fragment rule forbids at 4 layers
(fragment 0 holds embeddings, final norm and head; fragments 1..P-1 hold layers, so P - 1
must divide the layer count, and P must divide H): at L = 4, H = 20 the legal P are 2 and 5.
P = 5 (one layer per fragment, P = L + 1, as in the convergence benchmark) is used; it is the
finer streaming split, with a smaller peak send than P = 4 would have.

Comparisons, each paired by seed (`_common.paired_gap`: per seed, 100 x (loss - reference
loss) / reference loss; then mean, sample sd and the 95% t-interval of the mean):

- DiLoCo R = 2 vs DDP R = 2: acceptance wants it within 4%;
- Streaming vs DiLoCo (R = 2, H = 20): within 1%;
- int4 + error feedback vs float32 (both Streaming, as above): within 1%;
- DiLoCo R = 1 vs plain training: not worse beyond seed noise.

"Within X%" is one-sided (a method better than its reference passes) and is judged on the
mean gap; the markdown also says whether the upper end of the 95% interval is below X.
"Not worse beyond seed noise" holds when the 95% interval of the mean gap reaches 0 or
below. With outer lr 1 and no momentum, DiLoCo at R = 1 computes plain training up to
rounding (the outer step copies the replica), so that gap is expected to be ~0.

Modes (`_common.add_mode_flags`):

- `--quick` (default): the scale above, seeds 0 1 2, 18 runs; about 30-60 s per run on
  2 idle CPU cores (much more on a shared machine).
- `--full`: the convergence benchmark's full scale (dim 128, seq 128, 1000 steps), same runs.
- `--smoke`: microscopic (2 layers, H = 6, P = 3, 12 steps, seeds 0 1), for the test suite;
  the numbers are meaningless.

Pinned: 4 simulated CPU devices in every mode (2 replicas + one communication device per
replica for the tau = 1 runs), recorded in the JSON.

Output in `--out-dir` (default `runs/benchmarks/acceptance_<mode>`; committed results under
`benchmarks/results` are written only when `--out-dir benchmarks/results` is given):
`acceptance.json` (or `--json PATH`), `acceptance.md`, `acceptance_loss_vs_step.png`, and
`acceptance_runs.jsonl`, one line per finished run. JSON and markdown are rewritten after
every run, so a run cut short still shows its finished seeds; started again with the same
options and out dir, the script skips runs already in the JSONL (`--no-resume` to redo them).

Run `python -m benchmarks.acceptance --help`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/acceptance.py`
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import _common as common
from benchmarks._acceptance.plan import MODES, NAME, NUM_DEVICES, REPO, runs_for, scale_for, settings, settings_id
from benchmarks._acceptance.records import load_records, train_one
from benchmarks._acceptance.report import build_result, plot, render_markdown, write_outputs


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_mode_flags(parser)
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="seeds of every run (default 0 1 2; --smoke: 0 1)")
    parser.add_argument("--steps", type=int, default=None, help="override the mode's step count")
    parser.add_argument("--out-dir", "--out", type=pathlib.Path, default=None,
                        help="output folder (default runs/benchmarks/acceptance_<mode>; committed results under "
                             "benchmarks/results only when given explicitly)")
    parser.add_argument("--json", type=pathlib.Path, default=None,
                        help="JSON output (default <out-dir>/acceptance.json)")
    parser.add_argument("--no-resume", action="store_true",
                        help="redo runs already in <out-dir>/acceptance_runs.jsonl (the log is started afresh)")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    mode = args.mode or "quick"
    seeds = tuple(args.seeds) if args.seeds else MODES[mode].seeds
    out_dir = args.out_dir or REPO / "runs" / "benchmarks" / f"{NAME}_{mode}"
    json_path = args.json or out_dir / f"{NAME}.json"
    command = " ".join(["python -m benchmarks.acceptance", f"--{mode}"]
                       + (["--seeds", *map(str, seeds)] if args.seeds else [])
                       + (["--steps", str(args.steps)] if args.steps else []))
    scale = scale_for(mode, args.steps)
    runs = runs_for(mode, scale)
    s = settings(mode, scale)
    sid = settings_id(s)
    out_dir.mkdir(parents=True, exist_ok=True)
    jsonl = out_dir / f"{NAME}_runs.jsonl"
    if args.no_resume and jsonl.exists():
        jsonl.unlink()
    records = load_records(jsonl, sid)
    todo = [(seed, r) for seed in seeds for r in runs if f"{r.name}_s{seed}" not in records]
    log = lambda msg: print(msg, flush=True)
    log(f"{NAME} ({mode}): {len(runs) * len(seeds)} runs, {len(todo)} to go ({jsonl}); outer lr "
        f"{s['outer_lr']:g} momentum {s['outer_momentum']:g}; {NUM_DEVICES} simulated CPU devices")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="eqx_diloco_jaxcache_") as cache:
        common.setup_jax(NUM_DEVICES, compile_cache=cache)
        import jax

        if len(jax.devices()) != NUM_DEVICES:
            raise SystemExit(f"expected {NUM_DEVICES} CPU devices, JAX has {len(jax.devices())}")
        for i, (seed, run) in enumerate(todo):
            run_dir = out_dir / "runs" / f"{run.name}_s{seed}"
            record = train_one(run, scale, seed, run_dir, sid)
            shutil.rmtree(run_dir, ignore_errors=True)
            with jsonl.open("a") as f:
                f.write(json.dumps(common.jsonable(record)) + "\n")
            records[record["key"]] = record
            write_outputs(build_result(records, runs, mode, seeds, s, command), out_dir, json_path)
            elapsed = time.perf_counter() - start
            eta = elapsed / (i + 1) * (len(todo) - i - 1)
            log(f"[{i + 1}/{len(todo)}] {record['key']:<26} eval {record['eval_loss']:.4f}  "
                f"{record['elapsed_s']:5.0f}s  elapsed {elapsed / 60:.1f} min  ETA {eta / 60:.1f} min")
    result = build_result(records, runs, mode, seeds, s, command)
    written = write_outputs(result, out_dir, json_path)
    if not args.no_plots:
        try:
            written.append(plot(result, out_dir / f"{NAME}_loss_vs_step.png"))
        except ImportError:
            log("matplotlib missing: no plot")
    print()
    print(render_markdown(result))
    print(f"wrote {', '.join(map(str, written))}")
    return result


if __name__ == "__main__":
    main()
