"""Eval loss of the two-phase int4 exchange against float32 at R = 4, over seeds.

The two-phase exchange (packed reduce-scatter + all-gather, see `eqx_diloco/_exchange.py`)
keeps int4 at ~1/8 of a float32 ring all-reduce on the wire at any R, but rounds twice
(sender and chunk owner). This run checks that it costs nothing in loss: R = 4 replicas,
float32 psum vs `--diloco.quantize int4 --diloco.error-feedback --diloco.exchange two_phase`,
same seeds, same data, paired gap `loss_int4 / loss_float32 - 1` (mean +- sd over seeds).

Default: 4 layers, width 64, seq 64, 4 sequences per replica step, H = 20, 500 steps,
seeds 0 1 2, the CLI's default outer optimizer; `--quick` for tests. 4 simulated CPU
devices, pinned. Writes `quantized_r4.json` / `.md` into `--out` (default
`runs/benchmarks/quantized_r4`).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import _common as common  # noqa: E402

NUM_DEVICES = 4
METHODS = {"float32": {}, "int4_two_phase": dict(quantize="int4", error_feedback=True, exchange="two_phase")}


def make_config(method: str, seed: int, run_dir: pathlib.Path, args):
    return common.small_lm_config(quick=args.quick, steps=args.steps, sync_period=args.sync_period, num_replicas=4,
                                  seed=seed, run_dir=run_dir, diloco=METHODS[method])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="microscopic run for tests")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None, help="inner steps (default 500; quick 12)")
    parser.add_argument("--sync-period", type=int, default=None, help="H (default 20; quick 4)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/benchmarks/quantized_r4"))
    args = parser.parse_args(argv)
    args.steps = args.steps or (12 if args.quick else 500)
    args.sync_period = args.sync_period or (4 if args.quick else 20)
    common.setup_jax(NUM_DEVICES)
    args.out.mkdir(parents=True, exist_ok=True)
    losses, wire = {m: {} for m in METHODS}, {}
    total, done, start = len(METHODS) * len(args.seeds), 0, time.perf_counter()
    for seed in args.seeds:
        for method in METHODS:
            result = common.train_and_summarize(make_config(method, seed, args.out / "runs" / f"{method}_s{seed}", args))
            losses[method][seed] = result["eval_loss"]
            records, _ = common.read_metrics(args.out / "runs" / f"{method}_s{seed}")
            wire[method] = [r["wire_bytes"] for r in records if "wire_bytes" in r][-1]
            done += 1
            print(f"[{done}/{total}] {method:<15} seed {seed}  eval {result['eval_loss']:.4f}  "
                  f"{result['elapsed_s']:.0f}s  ETA {(time.perf_counter() - start) / done * (total - done):.0f}s",
                  flush=True)
    result = {"benchmark": "quantized_r4", "mode": "quick" if args.quick else "default", "num_devices": NUM_DEVICES,
              "seeds": args.seeds, "steps": args.steps, "sync_period": args.sync_period,
              "eval_loss": {m: common.mean_sd([losses[m][s] for s in args.seeds]) for m in METHODS},
              "gap_int4_to_float32": common.paired_gap(losses["int4_two_phase"], losses["float32"], scale=1.0),
              "wire_bytes": wire,
              "wire_ratio": wire["int4_two_phase"] / wire["float32"], "machine": common.machine_info()}
    e, g = result["eval_loss"], result["gap_int4_to_float32"]
    text = (f"R = 4, H = {args.sync_period}, {args.steps} steps, seeds {args.seeds}, {NUM_DEVICES} simulated CPU devices\n\n"
            "| exchange | eval loss (mean +- sd) | wire bytes per replica (whole run) |\n|---|---|---|\n"
            + "".join(f"| {m} | {common.fmt_pm(e[m], '.4f')} | {wire[m] / 1e6:.2f} MB |\n" for m in METHODS)
            + f"\npaired gap int4 two-phase vs float32: {common.fmt_pm(g, '+.2f', '%', scale=100)} "
              f"(n = {g['n']}); wire bytes ratio {result['wire_ratio']:.3f}\n")
    common.write_json(args.out / "quantized_r4.json", result)
    common.write_text(args.out / "quantized_r4.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
