"""Seconds per step of each method on a rate-limited link: does the overlap really overlap?

Every method trains the same model as 2 processes (one replica each) joined by
`jax.distributed`, inside a network namespace whose loopback is shaped to
`--bandwidth` (see `eqx_diloco.lm.launch`). Methods:

- compute_only: DiLoCo with no sync in the run (the floor);
- ddp: a gradient all-reduce every step;
- diloco: a blocking sync of everything every H steps;
- streaming: P fragments, one blocking sync every H/P steps;
- streaming_overlap_tau{1,N}: the same, each sync running on the communication devices
  while tau steps compute, waited for only at t + tau;
- eager, streaming_eager: `--diloco.outer-overlap eager` (P = 1 and P): each exchange runs
  on the communication devices for a whole round and is waited for at the next sync of
  the same parameters (their first installs fall inside the longer warm-up, 2H + 1);
  eager_int4, streaming_eager_int4: the same with 4-bit payloads and error feedback;
  eager_metrics_lag0: eager with `--dist.metrics-lag 0`, every step waiting for the
  per-step metrics exchange with the other process (it crosses the same link).

s/step is measured from the metrics' timestamps after a warm-up that covers every
program's compilation (the first sync of every fragment); ddp, whose steps are all alike
and slow, runs fewer steps. compute_utilization is compute_only's s/step divided by the
method's, within one repeat; with `--repeats N` every method runs N times, interleaved
(so a slow spell of the machine hits every method alike), and the table gives the median,
the range and the mean +- sd over repeats. Needs root (network namespaces).

    python -m benchmarks.overlap --quick --repeats 3 --json benchmarks/results/overlap.json
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from eqx_diloco.lm.launch import LinkLimit


def method_flags(H: int, P: int, tau_large: int) -> dict[str, list[str]]:
    stream = ["--diloco.sync-period", str(H), "--diloco.num-fragments", str(P)]
    int4 = ["--diloco.quantize", "int4", "--diloco.error-feedback"]
    return {
        "compute_only": ["--diloco.sync-period", "1000000"],
        "ddp": ["--algorithm", "ddp"],
        "diloco": ["--diloco.sync-period", str(H)],
        "streaming": stream,
        "streaming_overlap_tau1": [*stream, "--diloco.overlap-steps", "1"],
        f"streaming_overlap_tau{tau_large}": [*stream, "--diloco.overlap-steps", str(tau_large)],
        # Whole-round overlap (arXiv 2502.12996): each exchange has a full round (H steps) to arrive.
        "eager": ["--diloco.sync-period", str(H), "--diloco.outer-overlap", "eager"],
        "streaming_eager": [*stream, "--diloco.outer-overlap", "eager"],
        # The paper's bandwidth claims are for 4-bit payloads: the same with int4 + error feedback.
        "eager_int4": ["--diloco.sync-period", str(H), "--diloco.outer-overlap", "eager", *int4],
        "streaming_eager_int4": [*stream, "--diloco.outer-overlap", "eager", *int4],
        # Every step waits for the per-step metrics exchange (round trips over the same link as the exchange).
        "eager_metrics_lag0": ["--diloco.sync-period", str(H), "--diloco.outer-overlap", "eager",
                               "--dist.metrics-lag", "0"],
    }


def seconds_per_step(metrics: Path, warmup: int) -> float:
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    timed = [r for r in records if "time" in r and r["step"] >= warmup]
    first, last = timed[0], timed[-1]
    return (last["time"] - first["time"]) / (last["step"] - first["step"])


def sync_bytes(metrics: Path) -> int:
    records = [json.loads(line) for line in metrics.read_text().splitlines() if '"peak_sync_bytes"' in line]
    return records[-1]["peak_sync_bytes"]


def run_method(name: str, flags: list[str], common: list[str], args, work: Path, steps: int, warmup: int,
               cache: Path) -> dict:
    run_dir = work / name
    common = [*common, "--train.steps", str(steps)]
    cmd = [sys.executable, "-m", "eqx_diloco.launch", "--num-processes", "2", "--bandwidth", args.bandwidth,
           "--log-dir", str(work / f"{name}_logs"), "--", *common, *flags, "--run-dir", str(run_dir)]
    # One persistent compilation cache for all methods and repeats: most share the inner step program.
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"error: {name} failed:\n{proc.stderr[-3000:]}")
    metrics = run_dir / "metrics.jsonl"
    return {"s_per_step": seconds_per_step(metrics, warmup), "bytes_per_sync": sync_bytes(metrics),
            "steps": steps, "timed_after_step": warmup}


def summarize(repeats: list[dict[str, dict]]) -> dict[str, dict]:
    """Per method, over repeats: the median s/step, and the median and range of its compute
    utilization (each repeat's utilization against that repeat's compute_only)."""
    out = {}
    for name in repeats[0]:
        runs = [r[name] for r in repeats]
        cu = [r["compute_only"]["s_per_step"] / run["s_per_step"] for r, run in zip(repeats, runs)]
        out[name] = {"s_per_step": statistics.median(run["s_per_step"] for run in runs),
                     "compute_utilization": statistics.median(cu), "compute_utilization_min": min(cu),
                     "compute_utilization_max": max(cu), "compute_utilization_mean": statistics.fmean(cu),
                     "compute_utilization_sd": statistics.stdev(cu) if len(cu) > 1 else 0.0,
                     "compute_utilization_repeats": cu, "s_per_step_repeats": [run["s_per_step"] for run in runs],
                     "bytes_per_sync": runs[0]["bytes_per_sync"], "steps": runs[0]["steps"],
                     "timed_after_step": runs[0]["timed_after_step"]}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (about 6 minutes per repeat)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every method, interleaved")
    parser.add_argument("--bandwidth", default="60mbit", help="link rate in tc units")
    parser.add_argument("--sync-period", type=int, default=16, help="H")
    parser.add_argument("--num-fragments", type=int, default=4, help="P (num_layers must be divisible by P - 1)")
    parser.add_argument("--steps", type=int, default=None, help="steps of the syncing methods (default warm-up + 2H quick, + 4H full)")
    parser.add_argument("--warmup", type=int, default=None, help="steps excluded from timing (default H + H/P)")
    parser.add_argument("--only", nargs="+", default=None, help="run only these methods (compute_only always runs)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--model-flags", default="--model.num-layers 6 --model.dim 128 --train.batch-size 4",
                        help="model and batch flags passed to every run")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1 (got {args.repeats})")
    problem = LinkLimit.check()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    H, P = args.sync_period, args.num_fragments
    tau_large = H // P - 1
    args.warmup = args.warmup or H + tau_large + 1
    steps = args.steps or (args.warmup + (2 if args.quick else 4) * H)
    common = [*args.model_flags.split(), "--diloco.num-replicas", "2",
              "--train.log-every", "1", "--train.eval-every", "0", "--checkpoint.every", "0"]
    methods = method_flags(H, P, tau_large)
    if args.only:
        unknown = sorted(set(args.only) - set(methods))
        if unknown:
            parser.error(f"--only: unknown method(s) {unknown}; choose from {sorted(methods)}")
        methods = {k: v for k, v in methods.items() if k == "compute_only" or k in args.only}
    repeats = []
    with tempfile.TemporaryDirectory(prefix="overlap_bench_") as tmp:
        for repeat in range(args.repeats):
            if args.repeats > 1:
                print(f"repeat {repeat + 1} of {args.repeats}", flush=True)
            results = {}
            for name, flags in methods.items():
                work, cache = Path(tmp) / f"r{repeat}", Path(tmp) / "jax_cache"
                if name == "ddp":  # its steps are uniform and slow: a short run times them
                    short = 3 + (6 if args.quick else 16)
                    results[name] = run_method(name, flags, common, args, work, short, 3, cache)
                elif "eager" in name:  # the first install of every exchange (step 2H) must be warm
                    warmup = max(args.warmup, 2 * H + 1)
                    results[name] = run_method(name, flags, common, args, work, warmup + steps - args.warmup, warmup, cache)
                else:  # compute_only too: timed over as many steps as the syncing methods
                    results[name] = run_method(name, flags, common, args, work, steps, args.warmup, cache)
                print(f"  {name:<26} {results[name]['s_per_step']:.3f} s/step", flush=True)
            repeats.append(results)
    results = summarize(repeats)
    print(f"\nlink {args.bandwidth}, 2 processes x 1 replica, H={H}, P={P}, {steps} steps "
          f"(timed after step {args.warmup}; eager: after step {max(args.warmup, 2 * H + 1)}; ddp: "
          f"{results['ddp']['steps'] if 'ddp' in results else '-'} steps timed after step 3), {args.repeats} "
          f"repeat(s), model flags: {args.model_flags}\n")
    print("| method | s/step (median) | compute utilization (median) | range over repeats | mean +- sd | bytes per sync |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        sent = "-" if name == "compute_only" else f"{r['bytes_per_sync'] / 1e6:.2f} MB"
        spread = f"{r['compute_utilization_min']:.2f}-{r['compute_utilization_max']:.2f}"
        mean = f"{r['compute_utilization_mean']:.3f} +- {r['compute_utilization_sd']:.3f}"
        print(f"| {name} | {r['s_per_step']:.3f} | {r['compute_utilization']:.2f} | {spread} | {mean} | {sent} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"link": args.bandwidth, "sync_period": H, "num_fragments": P,
                                         "steps": steps, "warmup": args.warmup, "repeats": args.repeats,
                                         "model_flags": args.model_flags, "methods": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
