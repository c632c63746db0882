"""Outer-gradient wire formats: what quantization costs in loss and saves in bytes.

Same model, seed, data and schedule for every run; only `--diloco.quantize` (and
`--diloco.error-feedback`) change. Formats: float32 (`none`, the reference), bf16, fp8
(e4m3, per-block scales), int8, int4 (absmax per block) and e3m0 (sign + 3-bit exponent
per block), the two 4-bit formats with and without error feedback. For each run: the
final eval loss of the global model, its change against float32, and the bytes one
replica sent (read from metrics.jsonl) as a ratio to float32.

Setting: DiLoCo (P = 1) with R = 2 and H = 10 by default, so the run holds many outer
syncs (500 / 10 = 50 in `--quick`) and quantization error has the most chances to add up;
`--fragments`, `--sync-period` and `--overlap` switch to a Streaming DiLoCo setting (the
paper's 4-bit result is for Streaming DiLoCo, H = 100, tau = 1).

Noise floor: the loss difference between formats only means something next to the
difference that changing the seed alone makes, so float32 is also run with the seeds in
`--noise-seeds` (reported, not used as the reference). `--seeds 0 1 2` runs every format
with every seed and reports the mean of the paired (same-seed) changes and their spread;
that is what it takes to resolve a 1% target at this scale.

Modes: `--quick` (default; the convergence benchmark's quick model, 500 steps, about
4-5 minutes on 2 idle CPU cores), `--full` (its full model, 1000 steps), `--smoke` (tests).

Output in `--out-dir` (default `runs/benchmarks/quantization_<mode>`; the committed results
under `benchmarks/results` are written only when `--out-dir benchmarks/results` is given):
`quantization.json` (or `--json PATH`) and `quantization.md`.

Run `python -m benchmarks.quantization --help`.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import _common as common  # noqa: E402
from benchmarks.convergence import SCALES, RunSpec, make_config  # noqa: E402

# (format, error feedback)
FORMATS = (
    ("none", False), ("bf16", False), ("fp8", False), ("int8", False),
    ("int4", False), ("int4", True), ("e3m0", False), ("e3m0", True),
)
SMOKE_FORMATS = (("none", False), ("int4", True))
TOLERANCE_PCT = 1.0  # the target: int4 within 1% of float32


def specs_for(formats, *, replicas: int, batch_size: int, sync_period: int, fragments: int,
              overlap: int) -> list[RunSpec]:
    method = "streaming" if fragments > 1 else "diloco"
    return [RunSpec(method, replicas, batch_size, sync_period, fragments, overlap, 0.0, fmt, ef)
            for fmt, ef in formats]


def label(fmt: str, ef: bool) -> str:
    return ("float32" if fmt == "none" else fmt) + (" + EF" if ef else "")


def run(mode: str = "quick", *, formats=None, sync_period: int | None = None, fragments: int = 1, overlap: int = 0,
        replicas: int = 2, seeds: Sequence[int] = (0,), noise_seeds: Sequence[int] = (1,), steps: int | None = None,
        out_dir: pathlib.Path | None = None, json_path: pathlib.Path | None = None, keep_runs=None,
        log=None) -> dict[str, Any]:
    """Run every format for every seed (and float32 for the noise seeds); write markdown and JSON.

    With several seeds, a format's loss change is the mean of its *paired* changes (format
    vs float32 with the same seed), which cancels most of the seed-to-seed spread.
    Expects devices set up."""
    from eqx_diloco import quantize

    log = log or (lambda msg: print(msg, flush=True))
    scale = SCALES[mode]
    if steps is not None:
        scale = dataclasses.replace(scale, steps=steps)
    formats = formats or (SMOKE_FORMATS if mode == "smoke" else FORMATS)
    H = sync_period or scale.sync_periods[0 if fragments == 1 else 1]
    specs = specs_for(formats, replicas=replicas, batch_size=scale.batch_size, sync_period=H, fragments=fragments,
                      overlap=overlap)
    if specs[0].quantize != "none":
        raise ValueError("the first format must be float32 ('none'), the reference")
    out_dir = pathlib.Path(out_dir or common.default_out_dir("quantization", mode))
    start = time.perf_counter()
    noise_seeds = [s for s in noise_seeds if s not in seeds]
    jobs = [(spec, sd, False) for sd in seeds for spec in specs] + [(specs[0], sd, True) for sd in noise_seeds]
    results: dict[tuple[int, int], dict[str, Any]] = {}  # (spec index, seed) -> run summary
    noise = []
    with common.TemporaryRunDirs(keep_runs) as runs_dir:
        for i, (spec, sd, is_noise) in enumerate(jobs):
            run_dir = runs_dir / f"{i:02d}_{spec.quantize}{'_ef' if spec.error_feedback else ''}_s{sd}"
            result = common.train_and_summarize(make_config(spec, scale, run_dir, sd))
            name = label(spec.quantize, spec.error_feedback)
            if is_noise:
                noise.append({"label": name, "seed": sd, **result})
            else:
                results[(specs.index(spec), sd)] = result
            log(f"[{i + 1}/{len(jobs)}] {name + (f' (seed {sd})' if is_noise or len(seeds) > 1 else ''):<22} "
                f"eval_loss {result['eval_loss']:.4f}  sent {common.fmt_bytes(result['metrics_sent_bytes'])}  "
                f"{result['elapsed_s']:.1f}s")
    rows = []
    for k, spec in enumerate(specs):
        per_seed = [results[(k, sd)] for sd in seeds]
        refs = [results[(0, sd)] for sd in seeds]
        deltas = [100.0 * (r["eval_loss"] - f["eval_loss"]) / f["eval_loss"] for r, f in zip(per_seed, refs)]
        rows.append({
            "format": spec.quantize,
            "error_feedback": spec.error_feedback,
            "label": label(spec.quantize, spec.error_feedback),
            "run": spec.name,
            "bits_per_value": quantize.bits_per_value(spec.quantize),
            "seeds": list(seeds),
            "seed_eval_losses": [r["eval_loss"] for r in per_seed],
            "eval_loss": statistics.fmean(r["eval_loss"] for r in per_seed),
            "loss_delta_pct": statistics.fmean(deltas),
            "loss_delta_pct_std": statistics.stdev(deltas) if len(deltas) > 1 else None,
            "paired_deltas_pct": deltas,
            "metrics_sent_bytes": per_seed[0]["metrics_sent_bytes"],
            "sent_bytes": per_seed[0]["sent_bytes"],
            "peak_sync_bytes": per_seed[0]["peak_sync_bytes"],
            "bytes_ratio": per_seed[0]["metrics_sent_bytes"] / refs[0]["metrics_sent_bytes"],
            "elapsed_s": sum(r["elapsed_s"] for r in per_seed),
            "per_seed": per_seed,
        })
        rows[-1]["within_1pct"] = abs(rows[-1]["loss_delta_pct"]) <= TOLERANCE_PCT
    ref_loss = rows[0]["seed_eval_losses"][0]
    for r in noise:
        r["loss_delta_pct"] = 100.0 * (r["eval_loss"] - ref_loss) / ref_loss
    setting = (f"{'Streaming DiLoCo' if fragments > 1 else 'DiLoCo'} R={replicas}, H={H}"
               + (f", P={fragments}, tau={overlap}" if fragments > 1 else "") + f", {scale.steps} steps, "
               f"model {scale.num_layers} layers x dim {scale.dim}, seq {scale.seq_len}, batch {scale.batch_size}"
               f"/replica, seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}")
    text = report(rows, noise, setting, mode, seed=seeds[0])
    result = {
        "benchmark": "quantization",
        "mode": mode,
        "setting": setting,
        "scale": dataclasses.asdict(scale),
        "sync_period": H,
        "fragments": fragments,
        "overlap": overlap,
        "replicas": replicas,
        "seeds": list(seeds),
        "tolerance_pct": TOLERANCE_PCT,
        "machine": common.machine_info(),
        "total_elapsed_s": time.perf_counter() - start,
        "runs": rows,
        "noise_runs": noise,
    }
    common.write_text(out_dir / "quantization.md", text)
    common.write_json(json_path or out_dir / "quantization.json", result)
    return result | {"markdown": text}


COLUMNS = [
    ("format", "label", None),
    ("bits/value", "bits_per_value", lambda v: f"{v:g}"),
    ("eval loss", "eval_loss", lambda v: f"{v:.4f}"),
    ("vs float32", "loss_delta_pct", lambda v: f"{v:+.2f}%"),
    ("within 1%", "within_1pct", lambda v: "yes" if v else "NO"),
    ("bytes sent / replica", "metrics_sent_bytes", common.fmt_bytes),
    ("bytes vs float32", "bytes_ratio", lambda v: f"{v:.4f}"),
    ("time", "elapsed_s", lambda v: f"{v:.0f}s"),
]


def report(rows, noise, setting: str, mode: str, seed: int = 0) -> str:
    columns = list(COLUMNS)
    if len(rows[0]["seeds"]) > 1:
        columns.insert(4, ("std of paired change", "loss_delta_pct_std", lambda v: f"{v:.2f}%"))
    lines = [
        f"# Outer-gradient quantization ({mode})",
        "",
        f"Setting: {setting}; embedded corpus. Every run has the same seed, data and schedule; only the wire "
        "format of the outer gradients changes (each replica quantizes its own outer gradient; receivers decode "
        "and average in float32). Bytes are read from metrics.jsonl (payload plus per-block scales). "
        "bits/value is the asymptotic rate for large arrays. With several seeds: mean eval loss, and the mean of "
        "the per-seed (paired) changes against float32.",
        "",
        common.markdown_table(rows, columns),
        "",
    ]
    if noise:
        spread = ", ".join(f"seed {r['seed']}: {r['eval_loss']:.4f} ({r['loss_delta_pct']:+.2f}%)" for r in noise)
        lines += [f"Noise floor: float32 with other seeds than {seed} (data order and initial weights change): "
                  f"{spread}.", ""]
    worst4 = [r for r in rows if r["format"] in ("int4", "e3m0")]
    if worst4:
        ok = [r["label"] for r in worst4 if r["within_1pct"]]
        bad = [r["label"] for r in worst4 if not r["within_1pct"]]
        lines.append(f"4-bit target (within {TOLERANCE_PCT:g}% of float32): met by {', '.join(ok) or 'none'}"
                     + (f"; missed by {', '.join(bad)}" if bad else "") + ".")
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_mode_flags(parser)
    parser.add_argument("--formats", nargs="+", default=None, metavar="FMT",
                        help="subset of formats, e.g. none int4 int4+ef (float32 = none, always run first)")
    parser.add_argument("--sync-period", type=int, default=None, help="H (default: 10; 50 with --fragments > 1)")
    parser.add_argument("--fragments", type=int, default=1, help="P (1 = DiLoCo)")
    parser.add_argument("--overlap", type=int, default=0, help="tau (streaming only)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="run every format with each seed; changes are paired per seed")
    parser.add_argument("--noise-seeds", type=int, nargs="*", default=[1],
                        help="extra float32 runs with these seeds (the seed-to-seed noise floor)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--out-dir", type=pathlib.Path, default=None,
                        help="output folder (default runs/benchmarks/quantization_<mode>; committed results under "
                             "benchmarks/results only when given explicitly)")
    parser.add_argument("--json", type=pathlib.Path, default=None,
                        help="JSON output (default: <out-dir>/quantization.json)")
    parser.add_argument("--keep-runs", type=pathlib.Path, default=None)
    parser.add_argument("--no-compile-cache", action="store_true")
    args = parser.parse_args(argv)
    mode = args.mode or "quick"
    args.out_dir = args.out_dir or common.default_out_dir("quantization", mode)
    formats = None
    if args.formats:
        known = {f"{fmt}{'+ef' if ef else ''}": (fmt, ef) for fmt, ef in FORMATS}
        bad = [f for f in args.formats if f not in known]
        if bad:
            parser.error(f"--formats: unknown {', '.join(bad)} (choose from {', '.join(known)})")
        formats = [("none", False)] + [known[f] for f in args.formats if f != "none"]
    devices = args.replicas * (2 if args.overlap > 0 else 1)
    with tempfile.TemporaryDirectory(prefix="eqx_diloco_jaxcache_") as cache:
        common.setup_jax(devices, compile_cache=None if args.no_compile_cache else cache)
        result = run(mode, formats=formats, sync_period=args.sync_period, fragments=args.fragments,
                     overlap=args.overlap, replicas=args.replicas, seeds=args.seeds, noise_seeds=args.noise_seeds, steps=args.steps,
                     out_dir=args.out_dir, json_path=args.json, keep_runs=args.keep_runs)
    print()
    print(result["markdown"])
    print(f"total {result['total_elapsed_s']:.0f}s; wrote {args.json or args.out_dir / 'quantization.json'}, "
          f"{args.out_dir / 'quantization.md'}")
    return result


if __name__ == "__main__":
    main()
