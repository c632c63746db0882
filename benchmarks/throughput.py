"""Speed of the inner step, compile time of scan vs unrolled layers, and model FLOPs utilization.

(a) Tokens/s of the trainer's jitted DiLoCo inner step (`Trainer.inner_step`: shard_map
    over the mesh, per-replica AdamW, metrics) with R = 1 on one device, against a plain
    training loop written here: `jax.jit` of value_and_grad + optax AdamW (the same
    clipping, schedule, weight-decay mask and hyper-parameters as the trainer's inner
    optimizer), same model, same batch, same device, params and optimizer state donated.
    Also R = 2 on 2 devices (twice the tokens per step), against the same plain loop.
    Measured in one process, interleaved: every round times `steps_per_round` steps of
    each variant (rotating their order), all compiled and warmed up beforehand; the
    ratio is the median over rounds of (variant tokens/s) / (plain tokens/s) in that round.
    The same fixed token batch is fed to every step (no host data pipeline in the timing).

(b) Compile time (`jax.jit(step).lower(...)`, then `.compile()`, both timed) of the plain
    train step with the model's `lax.scan` over the stacked layers against the same step
    with the layers unrolled (a Python loop indexing layer i out of the stacked arrays),
    for 4, 12 and 24 layers, plus the trainer's own inner step (scan) for reference. Each
    is compiled `compile_reps` times (interleaved) from abstract shapes, fresh each time,
    and the fastest try is reported: on a shared machine other load only adds time.

(c) Model FLOPs utilization = model FLOPs per token x tokens/s / peak FLOP/s. FLOPs per
    token for training (forward + backward = 3 x forward):

        6 * N_matmul + 12 * L * T * d

    N_matmul = the weights used in matrix multiplies: per layer 3 d*d (q, k, v) + d*d (out) +
    2*d*(mlp_ratio*d) (MLP), plus d*V for the output head (the embedding lookup, norms
    and biases do no matmul FLOPs). The second term is attention's two T x T products
    (q k^T and weights @ v, 2*T*d FLOPs each per token and layer in the forward pass),
    counted for the full T x T matrix because the model computes it and masks it (PaLM's
    6N + 12 L H Q T with H Q = d). Peak = the best FLOP/s of a jitted float32 matmul of
    size n x n x n (2 n^3 FLOPs) on one device, measured in the same run (before and after
    the step timings; the higher one is used).

Run `python -m benchmarks.throughput --help`. About 3-5 minutes on 2 idle CPU cores.

Output in `--out-dir` (default `runs/benchmarks/throughput_default`, or `throughput_smoke`
with `--smoke`; the committed results under `benchmarks/results` are written only when
`--out-dir benchmarks/results` is given): `throughput.json` (or `--json PATH`) and
`throughput.md`.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import _common as common
from benchmarks._throughput.compile_time import measure_compile
from benchmarks._throughput.plain_loop import scan_loss, unrolled_loss  # noqa: F401  (the tests compare them)
from benchmarks._throughput.report import report
from benchmarks._throughput.settings import SMOKE, Settings, model_config, model_flops
from benchmarks._throughput.speed import measure_matmul_peak, measure_throughput


def run(settings: Settings = Settings(), *, out_dir: pathlib.Path | None = None, json_path=None, log=None,
        write: bool = True) -> dict[str, Any]:
    """All three measurements; writes JSON and markdown. Expects >= 2 CPU devices set up for R = 2."""
    log = log or (lambda msg: print(msg, flush=True))
    start = time.perf_counter()
    out_dir = pathlib.Path(out_dir or common.default_out_dir("throughput", "smoke" if settings == SMOKE else "default"))
    with common.TemporaryRunDirs() as runs_dir:
        log("peak matmul ...")
        peak_before = measure_matmul_peak(settings.matmul_sizes, settings.matmul_reps)
        log(f"  {peak_before['flops_per_s'] / 1e9:.1f} GFLOP/s")
        log("tokens/s ...")
        throughput = measure_throughput(settings, runs_dir, log)
        for r in throughput["rows"]:
            log(f"  {r['variant']:<36} {r['tokens_per_s']:>10,.0f} tok/s"
                + (f"  {r['ratio_vs_plain']:.3f}x plain" if "ratio_vs_plain" in r else ""))
        peak_after = measure_matmul_peak(settings.matmul_sizes, settings.matmul_reps)
        log(f"  peak again: {peak_after['flops_per_s'] / 1e9:.1f} GFLOP/s")
        log("compile times ...")
        compile_rows = measure_compile(settings, runs_dir, log)
    peak = max((peak_before, peak_after), key=lambda p: p["flops_per_s"])
    flops = model_flops(model_config(settings), settings.seq_len)
    for r in throughput["rows"]:
        r["model_flops_per_s"] = r["tokens_per_s"] * flops["flops_per_token"]
        r["mfu"] = r["model_flops_per_s"] / peak["flops_per_s"]
    result = {
        "benchmark": "throughput",
        "settings": dataclasses.asdict(settings),
        "machine": common.machine_info(),
        "flops": flops,
        "flops_formula": "6 * N_matmul + 12 * L * T * d per token (training; full T x T attention)",
        "peak": {**peak, "before": peak_before["flops_per_s"], "after": peak_after["flops_per_s"]},
        "throughput": throughput,
        "compile": compile_rows,
        "total_elapsed_s": time.perf_counter() - start,
    }
    text = report(result)
    if write:
        common.write_text(out_dir / "throughput.md", text)
        common.write_json(json_path or out_dir / "throughput.json", result)
    return result | {"markdown": text}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="microscopic settings (tests only)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps-per-round", type=int, default=None)
    parser.add_argument("--compile-layers", type=int, nargs="*", default=None)
    parser.add_argument("--no-r2", action="store_true", help="skip the R = 2 inner step")
    parser.add_argument("--out-dir", type=pathlib.Path, default=None,
                        help="output folder (default runs/benchmarks/throughput_default, --smoke: throughput_smoke; "
                             "committed results under benchmarks/results only when given explicitly)")
    parser.add_argument("--json", type=pathlib.Path, default=None,
                        help="JSON output (default: <out-dir>/throughput.json)")
    args = parser.parse_args(argv)
    settings = SMOKE if args.smoke else Settings()
    args.out_dir = args.out_dir or common.default_out_dir("throughput", "smoke" if args.smoke else "default")
    overrides = {k: v for k, v in (("rounds", args.rounds), ("steps_per_round", args.steps_per_round)) if v}
    if args.compile_layers is not None:
        overrides["compile_layers"] = tuple(args.compile_layers)
    if args.no_r2:
        overrides["with_r2"] = False
    settings = dataclasses.replace(settings, **overrides)
    common.setup_jax(2)
    result = run(settings, out_dir=args.out_dir, json_path=args.json)
    print()
    print(result["markdown"])
    print(f"total {result['total_elapsed_s']:.0f}s; wrote {args.json or args.out_dir / 'throughput.json'}, "
          f"{args.out_dir / 'throughput.md'}")
    return result


if __name__ == "__main__":
    main()
