"""Seconds per step of each method on a rate-limited link: does the overlap really overlap?

Every method trains the same model as 2 processes (one replica each) joined by
`jax.distributed`, inside a network namespace whose loopback is shaped to
`--bandwidth` (see `eqx_diloco.lm.launch`). Methods:

- compute_only: DiLoCo with no sync in the run (the floor), one device per process;
- compute_only_comm: the same with the overlapped methods' device layout (a
  communication device beside each replica's compute device, `--diloco.overlap-steps 1`
  with no sync in the run): the floor of the overlapped methods;
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
and slow, runs fewer steps.

Compute utilization is a paired ratio against the compute-only run of the method's own
device layout. A repeat runs, per layout, that layout's compute-only run, then each of its
methods followed by another compute-only run (C M1 C M2 ... Mk C), the methods in a
rotated order from repeat to repeat and the layouts in alternating order; a method's
utilization in that repeat is the mean s/step of the two compute-only runs on either side
of it divided by its own s/step. The machine's speed drifts over minutes, so only runs
next to each other are compared, and a method is only compared with runs that place its
replica on the same devices (a second device per process may change how the compute is
scheduled). The table gives, per
method, the mean over repeats with the half-width of its 95% t-interval. Needs root
(network namespaces).

The JSON (`--json`) is rewritten after every repeat, so an interrupted run keeps the
repeats it finished. Per method it holds `compute_utilization` as `{n, mean, sd, ci95,
values}` (`values`: one paired ratio per repeat), the median `s_per_step`, and per repeat
`s_per_step_repeats` and `compute_only_s_per_step_repeats` (the mean of the two
neighbouring runs of its compute-only `baseline`); `revision` is the code's git commit.

    python -m benchmarks.overlap --quick --repeats 8 --only ddp diloco streaming_overlap_tau3 eager \\
        --json benchmarks/results/overlap.json
"""

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/overlap.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _common as common
from eqx_diloco.lm.launch import LinkLimit


def method_flags(H: int, P: int, tau_large: int) -> dict[str, list[str]]:
    stream = ["--diloco.sync-period", str(H), "--diloco.num-fragments", str(P)]
    int4 = ["--diloco.quantize", "int4", "--diloco.error-feedback"]
    no_sync = ["--diloco.sync-period", "1000000"]
    return {
        "compute_only": no_sync,
        "compute_only_comm": [*no_sync, "--diloco.overlap-steps", "1"],
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


BASELINES = ("compute_only", "compute_only_comm")


def baseline_of(flags: list[str]) -> str:
    """The compute-only run with the same device layout as a method with these flags: an
    overlapped sync (tau > 0 or an eager/delayed outer overlap) adds a communication device."""
    return "compute_only_comm" if {"--diloco.overlap-steps", "--diloco.outer-overlap"} & set(flags) else "compute_only"


def seconds_per_step(metrics: Path, warmup: int) -> float:
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    timed = [r for r in records if "time" in r and r["step"] >= warmup]
    first, last = timed[0], timed[-1]
    return (last["time"] - first["time"]) / (last["step"] - first["step"])


def sync_bytes(metrics: Path) -> int:
    records = [json.loads(line) for line in metrics.read_text().splitlines() if '"peak_sync_bytes"' in line]
    return records[-1]["peak_sync_bytes"]


def run_method(name: str, flags: list[str], common_flags: list[str], bandwidth: str, work: Path, steps: int,
               warmup: int, cache: Path) -> dict:
    run_dir = work / name
    cmd = [sys.executable, "-m", "eqx_diloco.launch", "--num-processes", "2", "--bandwidth", bandwidth,
           "--log-dir", str(work / f"{name}_logs"), "--", *common_flags, "--train.steps", str(steps), *flags,
           "--run-dir", str(run_dir)]
    # One persistent compilation cache for all methods and repeats: most share the inner step program.
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"error: {name} failed:\n{proc.stderr[-3000:]}")
    metrics = run_dir / "metrics.jsonl"
    return {"s_per_step": seconds_per_step(metrics, warmup), "bytes_per_sync": sync_bytes(metrics),
            "steps": steps, "timed_after_step": warmup}


def rotated(names: list[str], repeat: int) -> list[str]:
    """The methods in repeat `repeat`'s order: shifted by one each repeat, so no method is
    always the first or the last of a repeat."""
    shift = repeat % len(names) if names else 0
    return names[shift:] + names[:shift]


def paired_repeat(run, names: list[str], baseline: dict[str, str] | None = None) -> dict[str, dict]:
    """One repeat: each method between two runs of its compute-only baseline.

    `run(name)` returns `run_method`'s dict; `baseline[name]` names the method's
    compute-only run (default `compute_only` for all). A baseline run is shared by the
    methods on either side of it when both use it. Each method's record gets the mean s/step
    of the baseline runs just before and just after it (`compute_only_s_per_step`) and the
    baseline's name (`baseline`).
    """
    baseline = baseline or {}
    before, out = None, {}
    for name in names:
        base = baseline.get(name, "compute_only")
        if before is None or before[0] != base:
            before = (base, run(base))
        result = run(name)
        after = (base, run(base))
        out[name] = result | {"baseline": base,
                              "compute_only_s_per_step": (before[1]["s_per_step"] + after[1]["s_per_step"]) / 2}
        before = after
    return out


def repeat_order(names: list[str], baseline: dict[str, str], repeat: int) -> list[str]:
    """Repeat `repeat`'s order: the methods grouped by baseline (so each group's baseline
    runs are shared), each group rotated, the groups' order alternating between repeats."""
    groups = [[n for n in names if baseline[n] == b] for b in BASELINES]
    groups = [rotated(g, repeat) for g in groups if g]
    if repeat % 2:
        groups.reverse()
    return [name for group in groups for name in group]


def summarize(repeats: list[dict[str, dict]]) -> dict[str, dict]:
    """Per method, over repeats: the median s/step, and `common.mean_sd` of its paired
    compute utilization (per repeat: its neighbouring compute_only s/step over its own)."""
    out = {}
    for name in repeats[0]:
        runs = [r[name] for r in repeats]
        utilization = [run["compute_only_s_per_step"] / run["s_per_step"] for run in runs]
        out[name] = {"s_per_step": statistics.median(run["s_per_step"] for run in runs),
                     "compute_utilization": common.mean_sd(utilization),
                     "s_per_step_repeats": [run["s_per_step"] for run in runs],
                     "compute_only_s_per_step_repeats": [run["compute_only_s_per_step"] for run in runs],
                     "baseline": runs[0].get("baseline", "compute_only"),
                     "bytes_per_sync": runs[0]["bytes_per_sync"], "steps": runs[0]["steps"],
                     "timed_after_step": runs[0]["timed_after_step"]}
    return out


def render_table(results: dict[str, dict]) -> str:
    rows = [{"method": name, "baseline": r["baseline"], "s_per_step": r["s_per_step"],
             "compute_only": statistics.median(r["compute_only_s_per_step_repeats"]),
             "utilization": r["compute_utilization"], "range": r["compute_utilization"]["values"],
             "bytes": r["bytes_per_sync"]} for name, r in results.items()]
    return common.markdown_table(rows, [
        ("method", "method", None),
        ("s/step (median)", "s_per_step", "{:.3f}".format),
        ("paired with", "baseline", None),
        ("its s/step (median)", "compute_only", "{:.3f}".format),
        ("compute utilization, mean +- 95% CI", "utilization",
         lambda u: f"{u['mean']:.3f} +- {u['ci95']:.3f}" if u["ci95"] is not None else f"{u['mean']:.3f}"),
        ("range over repeats", "range", lambda v: f"{min(v):.2f}-{max(v):.2f}"),
        ("bytes per sync", "bytes", common.fmt_bytes),
    ])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (about a minute per run)")
    parser.add_argument("--repeats", type=int, default=1, help="paired repeats of every method")
    parser.add_argument("--bandwidth", default="60mbit", help="link rate in tc units")
    parser.add_argument("--sync-period", type=int, default=16, help="H")
    parser.add_argument("--num-fragments", type=int, default=4, help="P (num_layers must be divisible by P - 1)")
    parser.add_argument("--steps", type=int, default=None, help="steps of the syncing methods (default warm-up + 2H quick, + 4H full)")
    parser.add_argument("--warmup", type=int, default=None, help="steps excluded from timing (default H + H/P)")
    parser.add_argument("--only", nargs="+", default=None,
                        help="run only these methods (with the compute-only runs of their layouts)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here (after every repeat)")
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
    warmup = args.warmup or H + tau_large + 1
    eager_warmup = max(warmup, 2 * H + 1)  # the first install of every exchange (step 2H) must be warm
    steps = args.steps or (warmup + (2 if args.quick else 4) * H)
    ddp_steps = 3 + (6 if args.quick else 16)  # its steps are uniform and slow: a short run times them
    common_flags = [*args.model_flags.split(), "--diloco.num-replicas", "2",
                    "--train.log-every", "1", "--train.eval-every", "0", "--checkpoint.every", "0"]
    methods = method_flags(H, P, tau_large)
    if args.only:
        unknown = sorted(set(args.only) - set(methods))
        if unknown:
            parser.error(f"--only: unknown method(s) {unknown}; choose from {sorted(methods)}")
        methods = {k: v for k, v in methods.items() if k in BASELINES or k in args.only}
    names = [name for name in methods if name not in BASELINES]
    baseline = {name: baseline_of(methods[name]) for name in names}
    header = {"link": args.bandwidth, "sync_period": H, "num_fragments": P, "steps": steps, "warmup": warmup,
              "eager_warmup": eager_warmup, "ddp_steps": ddp_steps, "model_flags": args.model_flags,
              "pairing": "each method between two runs of the compute-only baseline with its device layout "
                         "(compute_only, or compute_only_comm for overlapped methods); utilization = their mean "
                         "s/step / the method's",
              "revision": common.revision()}
    repeats = []
    with common.TemporaryRunDirs() as tmp:
        cache, run_ids = tmp / "jax_cache", itertools.count()

        def run(name: str) -> dict:
            start, work = time.perf_counter(), tmp / f"run{next(run_ids):03d}"  # every run its own folder
            if name == "ddp":
                result = run_method(name, methods[name], common_flags, args.bandwidth, work, ddp_steps, 3, cache)
            elif "eager" in name:
                result = run_method(name, methods[name], common_flags, args.bandwidth, work,
                                    eager_warmup + steps - warmup, eager_warmup, cache)
            else:  # compute_only too: timed over as many steps as the syncing methods
                result = run_method(name, methods[name], common_flags, args.bandwidth, work, steps, warmup, cache)
            print(f"  {name:<26} {result['s_per_step']:.3f} s/step ({time.perf_counter() - start:.0f} s)", flush=True)
            return result

        for repeat in range(args.repeats):
            print(f"repeat {repeat + 1} of {args.repeats}", flush=True)
            repeats.append(paired_repeat(run, repeat_order(names, baseline, repeat), baseline))
            results = summarize(repeats)
            if args.json:
                common.write_json(args.json, header | {"repeats": len(repeats), "methods": results})
    print(f"\nlink {args.bandwidth}, 2 processes x 1 replica, H={H}, P={P}, {steps} steps (timed after step "
          f"{warmup}; eager: after step {eager_warmup}; ddp: {ddp_steps} steps timed after step 3), "
          f"{len(repeats)} paired repeat(s), model flags: {args.model_flags}, revision {header['revision']}\n")
    print(render_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
