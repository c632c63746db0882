"""Below one bit per parameter: eval loss against float32 DiLoCo for quantized, top-k sparse and
Muon-inside outer gradients, at R = 2 and R = 4, over seeds, on the embedded corpus.

Settings (every one with error feedback except float32):

    float32          the float32 psum (the reference)
    int4, int2       dense blocked formats
    topk10-int2 ...  top-k at 10%, 5%, 3%, 2% and 1% (chunks of 65536, the default), values in int2;
                     topk10-int4 ... at 10%, 3% and 1% in int4
    topk3-int2-chunk256  top-k 3% of each 256-value chunk, int2
    topk2-int2-gather, topk5-int2-gather  top-k 2% or 5% + int2 through the one-shot gather (no
                     re-sparsification); every other top-k setting runs the two-phase exchange above
                     R = 2 (the owner re-sparsifies the reduced sum)
    sparseloco-topk5-int2 ...  SparseLoCo: top-k 5%, 3%, 2% or 1% + int2, the residual decayed by 0.95
                     before it is added (--diloco.error-feedback-decay) and no outer momentum;
                     sparseloco-topk5-int2-gather the same at 5% through the gather
    muon             Muon inside (optax.contrib.muon on the stacked matrices, AdamW elsewhere), float32 sync
    muon-topk2-int2  Muon inside, top-k 2% + int2

Each (setting, R, seed) is one run of the trainer: 4 layers x 64, seq 64, 4 sequences per replica
step, H = 20, 500 steps, equal tokens for every setting. Reported per setting and R: eval loss
mean +- sd over seeds, the paired gap to float32 of the same seed (mean +- sd, and its 95%
interval), payload bits per parameter per sync (indices and scales included), and wire bytes per
replica over the run. Runs already in `--out` are reused (a killed sweep resumes); `--settings`
and `--replicas` pick a subset. 4 simulated CPU devices, pinned.

    python -m benchmarks.compression --out benchmarks/results/compression
    python -m benchmarks.compression --quick     # microscopic, for tests
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import _common as common  # noqa: E402

NUM_DEVICES = 4
EF = dict(error_feedback=True)
SETTINGS: dict[str, dict] = {
    "float32": {},
    "int4": dict(quantize="int4", **EF),
    "int2": dict(quantize="int2", **EF),
    **{f"topk{round(100 * d)}-{fmt}": dict(quantize=fmt, topk=d, **EF)
       for d in (0.10, 0.05, 0.03, 0.02, 0.01) for fmt in ("int2", "int4") if fmt == "int2" or d in (0.10, 0.03, 0.01)},
    "topk3-int2-chunk256": dict(quantize="int2", topk=0.03, topk_chunk=256, **EF),
    "topk2-int2-gather": dict(quantize="int2", topk=0.02, exchange="gather", **EF),
    "topk5-int2-gather": dict(quantize="int2", topk=0.05, exchange="gather", **EF),
    # SparseLoCo: the error-feedback accumulator decays (beta 0.95) and replaces outer momentum.
    **{f"sparseloco-topk{round(100 * d)}-int2": dict(quantize="int2", topk=d, error_feedback=True,
                                                     error_feedback_decay=0.95, outer_momentum=0.0)
       for d in (0.05, 0.03, 0.02, 0.01)},
    "sparseloco-topk5-int2-gather": dict(quantize="int2", topk=0.05, error_feedback=True, error_feedback_decay=0.95,
                                         outer_momentum=0.0, exchange="gather"),
    "muon": dict(inner="muon"),
    "muon-topk2-int2": dict(inner="muon", quantize="int2", topk=0.02, **EF),
}


def make_config(setting: str, replicas: int, seed: int, run_dir: pathlib.Path, args):
    options = dict(SETTINGS[setting])
    if "topk" in options and "exchange" not in options and replicas > 2:
        options["exchange"] = "two_phase"  # top-k settings not named -gather: the two-phase exchange above R = 2
    optim = {"inner": options.pop("inner")} if "inner" in options else None
    return common.small_lm_config(quick=args.quick, steps=args.steps, sync_period=args.sync_period,
                                  num_replicas=replicas, seed=seed, run_dir=run_dir, diloco=options, optim=optim)


def _run(setting: str, replicas: int, seed: int, args) -> dict:
    """One run's eval loss, bits per parameter and wire bytes (from its folder if it finished)."""
    run_dir = args.out / "runs" / f"{setting}_r{replicas}_s{seed}"
    done = run_dir / "compression_run.json"
    if done.exists() and not args.quick:
        return json.loads(done.read_text())
    from eqx_diloco.lm.trainer import Trainer

    if run_dir.exists():
        shutil.rmtree(run_dir)  # a leftover checkpoint would make the trainer resume
    start = time.perf_counter()
    summary = Trainer(make_config(setting, replicas, seed, run_dir, args), verbose=False).run()
    out = {"eval_loss": summary["eval_loss"], "elapsed_s": time.perf_counter() - start,
           "wire_bytes": summary["wire_bytes"], "bits_per_parameter": summary["bits_per_parameter"]}
    done.write_text(json.dumps(out))
    return out


def _table(result: dict) -> str:
    lines = [f"{result['steps']} steps, H = {result['sync_period']}, seeds {result['seeds']}, "
             f"{NUM_DEVICES} simulated CPU devices; gap = loss / float32 loss of the same seed - 1\n"]
    for R, rows in result["by_replicas"].items():
        lines.append(f"### R = {R}\n")
        lines.append("| setting | bits / parameter / sync | eval loss (mean +- sd) | gap to float32 (mean +- sd) "
                     "| 95% interval of the gap | wire bytes per replica |")
        lines.append("|---|---|---|---|---|---|")
        for name, row in rows.items():
            gap = row.get("gap")
            interval = "-"
            if gap and gap.get("ci95") is not None:
                lo, hi = gap["mean"] - gap["ci95"], gap["mean"] + gap["ci95"]
                interval = f"[{100 * lo:+.2f}%, {100 * hi:+.2f}%]"
            lines.append(f"| {name} | {row['bits_per_parameter']:.3g} | {common.fmt_pm(row['eval_loss'], '.4f')} | "
                         f"{common.fmt_pm(gap, '+.2f', '%', scale=100) if gap else '-'} | {interval} | "
                         f"{common.fmt_bytes(row['wire_bytes'])} |")
        lines.append("")
    return "\n".join(lines)


Y_MIN, Y_MAX = -15.0, 40.0  # the plot's gap axis (%)


def _plot(result: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for R, rows in result["by_replicas"].items():
        xs, ys, es, names = [], [], [], []
        for name, row in rows.items():
            if row.get("gap") and name != "float32":
                xs.append(row["bits_per_parameter"])
                ys.append(100 * row["gap"]["mean"])
                es.append(100 * row["gap"]["sd"])
                names.append(name)
        # Points outside the axis (a diverged seed above, Muon's gain below) sit on its edge, with their
        # mean written out.
        shown = [min(max(y, Y_MIN), Y_MAX) for y in ys]
        es = [e if at == y else 0.0 for e, y, at in zip(es, ys, shown)]  # no bar for a point off the axis
        ax.errorbar(xs, shown, yerr=[[min(e, y - Y_MIN) for e, y in zip(es, shown)], es], fmt="o", capsize=3,
                    label=f"R = {R}")
        for x, y, at, name in zip(xs, ys, shown, names):
            label = name if at == y else f"{name} ({y:+.0f}%)"
            ax.annotate(label, (x, at), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_ylim(Y_MIN, Y_MAX + 3)
    ax.axhline(0, color="gray", lw=0.8)
    ax.axhline(1, color="gray", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("payload bits per parameter per sync (log)")
    ax.set_ylabel("eval loss gap to float32 DiLoCo (%)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="microscopic runs for tests")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated subset")
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None, help="inner steps (default 500; quick 8)")
    parser.add_argument("--sync-period", type=int, default=None, help="H (default 20; quick 4)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/benchmarks/compression"))
    args = parser.parse_args(argv)
    args.steps = args.steps or (8 if args.quick else 500)
    args.sync_period = args.sync_period or (4 if args.quick else 20)
    settings = [s for s in args.settings.split(",") if s]
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        parser.error(f"unknown setting {', '.join(unknown)}; choose from {', '.join(SETTINGS)}")
    if "float32" not in settings:
        settings.insert(0, "float32")  # every gap is to float32
    common.setup_jax(NUM_DEVICES)
    args.out.mkdir(parents=True, exist_ok=True)
    total = len(settings) * len(args.replicas) * len(args.seeds)
    done, start = 0, time.perf_counter()
    runs: dict = {}
    for R in args.replicas:
        for seed in args.seeds:
            for setting in settings:
                runs[(setting, R, seed)] = run = _run(setting, R, seed, args)
                done += 1
                eta = (time.perf_counter() - start) / done * (total - done)
                print(f"[{done}/{total}] R={R} {setting:<16} seed {seed}  eval {run['eval_loss']:.4f}  "
                      f"{run['bits_per_parameter']:.3g} bits/param  ETA {eta:.0f}s", flush=True)
    by_replicas: dict = {}
    for R in args.replicas:
        reference = {s: runs[("float32", R, s)]["eval_loss"] for s in args.seeds}
        rows = {}
        for setting in settings:
            losses = {s: runs[(setting, R, s)]["eval_loss"] for s in args.seeds}
            first = runs[(setting, R, args.seeds[0])]
            rows[setting] = {"eval_loss": common.mean_sd(losses.values()), "losses": losses,
                             "bits_per_parameter": first["bits_per_parameter"], "wire_bytes": first["wire_bytes"],
                             "gap": None if setting == "float32" else common.paired_gap(losses, reference, scale=1.0)}
        by_replicas[str(R)] = rows
    result = {"benchmark": "compression", "mode": "quick" if args.quick else "default", "num_devices": NUM_DEVICES,
              "seeds": args.seeds, "steps": args.steps, "sync_period": args.sync_period, "settings": settings,
              "by_replicas": by_replicas, "machine": common.machine_info(), "revision": common.revision()}
    common.write_json(args.out / "compression.json", result)
    common.write_text(args.out / "compression.md", "# Compression of outer gradients\n\n" + _table(result))
    try:
        _plot(result, args.out / "compression_gap_vs_bits.png")
    except ImportError:
        print("matplotlib is not installed: no plot", flush=True)
    print(_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
