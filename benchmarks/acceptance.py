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
import dataclasses
import hashlib
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
from benchmarks import convergence

NAME = "acceptance"
REPO = pathlib.Path(__file__).resolve().parents[1]
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


# -- running ----------------------------------------------------------------------------


def load_records(path: pathlib.Path, sid: str) -> dict[str, dict[str, Any]]:
    """Finished runs with these settings in a JSONL log (a line cut short by a kill is skipped)."""
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("settings_id") == sid:
                out[record["key"]] = record
    return out


def train_one(run: Run, scale: convergence.Scale, seed: int, run_dir: pathlib.Path, sid: str) -> dict[str, Any]:
    result = common.train_and_summarize(make_config(run, scale, run_dir, seed))
    if result["eval_loss"] is None or not result["curve"] or result["curve"][-1]["step"] != scale.steps:
        raise RuntimeError(f"{run_dir}: no evaluation at the last step {scale.steps}")
    return {"key": f"{run.name}_s{seed}", "run": run.name, "seed": seed, "settings_id": sid,
            **{k: result[k] for k in ("eval_loss", "final_train_loss", "sent_bytes", "wire_bytes",
                                      "peak_sync_bytes", "elapsed_s")},
            "curve": [[p["step"], p["eval_loss"]] for p in result["curve"]]}


# -- statistics and report ---------------------------------------------------------------


def verdict(comparison: Comparison, gap: dict[str, Any]) -> dict[str, Any]:
    mean, sd, ci = gap["mean"], gap["sd"], gap["ci95"]
    if mean is None:
        return {"met": None, "text": "no paired seeds yet"}
    if comparison.threshold_pct is not None:
        X = comparison.threshold_pct
        met = mean <= X
        upper = None if ci is None else mean + ci
        text = (f"{'met' if met else 'NOT met'}: mean gap {mean:+.2f}% {'<=' if met else '>'} {X:g}%")
        if upper is not None:
            text += (f"; upper end of the 95% interval {upper:+.2f}% "
                     f"({'also below' if upper <= X else 'above'} {X:g}%)")
        return {"met": met, "met_95": None if upper is None else upper <= X, "upper95_pct": upper, "text": text}
    # Not worse beyond seed noise: the 95% interval of the mean gap reaches 0 or below.
    if ci is None:
        met = mean <= 0
        return {"met": met, "text": f"{'met' if met else 'NOT met'} (one seed, no noise estimate): mean {mean:+.2f}%"}
    lower = mean - ci
    met = lower <= 0
    text = (f"{'met' if met else 'NOT met'}: mean gap {mean:+.2f}%, 95% interval "
            f"[{lower:+.2f}%, {mean + ci:+.2f}%] {'reaches 0 or below' if met else 'lies above 0'}")
    if sd == 0 and mean == 0:
        text += " (identical losses on every seed)"
    return {"met": met, "lower95_pct": lower, "text": text}


def build_result(records: dict[str, dict[str, Any]], runs: Sequence[Run], mode: str, seeds: Sequence[int],
                 s: dict[str, Any], command: str) -> dict[str, Any]:
    by_run: dict[str, dict[int, dict[str, Any]]] = {r.name: {} for r in runs}
    for rec in records.values():
        if rec["run"] in by_run and rec["seed"] in seeds:
            by_run[rec["run"]][rec["seed"]] = rec
    run_rows = {}
    for r in runs:
        recs = [by_run[r.name][seed] for seed in sorted(by_run[r.name])]
        curves = [rec["curve"] for rec in recs]
        steps = [p[0] for p in curves[0]] if curves else []
        same = all([p[0] for p in c] == steps for c in curves)
        run_rows[r.name] = {
            "label": r.label, "spec": dataclasses.asdict(r.spec), "seeds": [rec["seed"] for rec in recs],
            "eval_loss": common.mean_sd(rec["eval_loss"] for rec in recs),
            "per_seed_eval_loss": {rec["seed"]: rec["eval_loss"] for rec in recs},
            "sent_bytes": recs[0]["sent_bytes"] if recs else None,
            "wire_bytes": recs[0]["wire_bytes"] if recs else None,
            "peak_sync_bytes": recs[0]["peak_sync_bytes"] if recs else None,
            "elapsed_s": sum(rec["elapsed_s"] for rec in recs),
            "curve": [{"step": st, "eval_loss": sum(c[j][1] for c in curves) / len(curves)}
                      for j, st in enumerate(steps)] if curves and same else [],
        }
    comparisons = []
    for c in COMPARISONS:
        losses = {seed: rec["eval_loss"] for seed, rec in by_run[c.run].items()}
        ref = {seed: rec["eval_loss"] for seed, rec in by_run[c.reference].items()}
        gap = common.paired_gap(losses, ref)
        comparisons.append({**dataclasses.asdict(c), "gap_pct": gap, "verdict": verdict(c, gap)})
    done = sum(len(v) for v in by_run.values())
    return {
        "benchmark": NAME, "mode": mode, "command": command, "revision": common.revision(), "seeds": list(seeds),
        "num_devices": NUM_DEVICES, "settings": s, "settings_id": settings_id(s),
        "complete": done == len(runs) * len(seeds), "runs_done": done, "runs_planned": len(runs) * len(seeds),
        "total_run_s": sum(rec["elapsed_s"] for v in by_run.values() for rec in v.values()),
        "machine": common.machine_info(), "runs": run_rows, "comparisons": comparisons,
        "records": sorted((rec for v in by_run.values() for rec in v.values()), key=lambda rec: rec["key"]),
    }


def render_markdown(result: dict[str, Any]) -> str:
    s, sc = result["settings"], result["settings"]["scale"]
    status = "" if result["complete"] else (
        f" **Incomplete: {result['runs_done']} of {result['runs_planned']} runs finished.**")
    lines = [
        f"# Issue 12 acceptance: the CLI's default outer optimizer ({result['mode']})",
        "",
        (f"Generated by `{result['command']}` (`benchmarks/acceptance.py`) at revision "
         f"`{result['revision'] or 'unknown'}`; seeds {', '.join(map(str, result['seeds']))}; "
         f"{result['num_devices']} simulated CPU devices; total run time {result['total_run_s'] / 60:.0f} min."
         + status),
        "",
        (f"Model: {sc['num_layers']} layers, dim {sc['dim']}, {sc['num_heads']} heads, byte vocab; seq "
         f"{sc['seq_len']}; {sc['batch_size']} sequences ({sc['batch_size'] * sc['seq_len']} tokens) per replica "
         f"step at every R; {sc['steps']} steps; inner AdamW lr {sc['lr']:g} (warm-up {sc['warmup_steps']}, "
         f"cosine to 10%). Outer SGD: lr {s['outer_lr']:g}, momentum {s['outer_momentum']:g} (the CLI default). "
         f"H = {s['sync_period']}; Streaming: P = {s['fragments']}, tau = {s['overlap']}, alpha 0 (P = 4 is not "
         f"allowed at {sc['num_layers']} layers: P - 1 must divide the layer count and P must divide H). Default "
         "final sync. Contiguous data split. Eval: the global model on "
         f"{sc['eval_sequences']} fixed held-out windows after the last step, nats per byte."),
        "",
        ("Gap: paired by seed, 100 x (loss - reference loss with the same seed) / reference loss; mean +- sample sd "
         "over seeds, and the half-width of the 95% t-interval of the mean gap."),
        "",
        "| comparison | requirement | n | gap (mean +- sd) | 95% CI | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for c in result["comparisons"]:
        g = c["gap_pct"]
        ci = "-" if g["ci95"] is None else f"+-{g['ci95']:.2f}%"
        lines.append(f"| {c['label']} | {c['requirement']} | {g['n']} | {common.fmt_pm(g, '+.2f', '%')} | {ci} | "
                     f"{c['verdict']['text']} |")
    lines += [
        "",
        ("| run | n | eval loss (mean +- sd) | per seed | bytes sent / replica | wire bytes / replica | "
         "peak bytes / step |"),
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"].values():
        per_seed = ", ".join(f"{v:.4f}" for v in r["eval_loss"]["values"]) or "-"
        lines.append(f"| {r['label']} | {r['eval_loss']['n']} | {common.fmt_pm(r['eval_loss'], '.4f')} | {per_seed} | "
                     f"{common.fmt_bytes(r['sent_bytes'])} | {common.fmt_bytes(r['wire_bytes'])} | "
                     f"{common.fmt_bytes(r['peak_sync_bytes'])} |")
    lines.append("")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: pathlib.Path) -> pathlib.Path:
    panels = [("R = 2", [(r["label"], r["curve"]) for r in result["runs"].values() if r["spec"]["replicas"] == 2]),
              ("R = 1", [(r["label"], r["curve"]) for r in result["runs"].values() if r["spec"]["replicas"] == 1])]
    return common.plot_curves(panels, "step", path, xlabel="inner step",
                              title="Seed-mean eval loss vs inner step, CLI default outer optimizer")


def write_outputs(result: dict[str, Any], out_dir: pathlib.Path, json_path: pathlib.Path) -> list[pathlib.Path]:
    return [common.write_json(json_path, result),
            common.write_text(out_dir / f"{NAME}.md", render_markdown(result))]


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
