"""Where a blocking DiLoCo sync step's time goes, between two processes of one machine.

The config `benchmarks/vs_torchft.py` compares with torchft (2 layers x 64, 4 x 64 tokens per
replica step, DiLoCo R = 2 as 2 processes of `eqx_diloco.launch`, H = 10, 200 steps, the same
text), with the launcher's two CPU settings: each process on a core of its own (`--cpus split`,
the default) and both on every core (`--cpus shared`). Per setting and repeat, two runs:

- as the trainer runs: each step's time from process 0's metrics timestamps (as vs_torchft
  measures it), as a multiple of the run's median step, for the steps that synced and the others;
- probed (`benchmarks/_sync_probe.py`): at every sync each process waits for its inner step,
  then for the sync. From both processes' clocks: how far apart the two finished their inner
  steps (what the faster one waits for at the psum), and how long the sync took after the
  later of the two (the sync program and its psum over gloo: compare `benchmarks/psum_floor.py`).

Before the repeats each setting runs once untimed, so every run finds its programs cached.

    python -m benchmarks.sync_step --out-dir benchmarks/results   # sync_step.{json,md}; about a minute
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from benchmarks import _common as common
from benchmarks._sync_probe import PROBE_DIR_ENV
from benchmarks.vs_torchft import CONFIGS, CORPUS, EQX_FLAGS, eqx_step_times

SETTINGS = ("split", "shared")


def trainer_flags(steps: int, sync_period: int, corpus: Path) -> list[str]:
    """vs_torchft's DiLoCo flags with `steps` and `sync_period` (H) in place of its own."""
    flags = [*EQX_FLAGS, "--data.path", str(corpus), *CONFIGS["diloco"][2]]
    return [*flags, "--train.steps", str(steps), "--diloco.sync-period", str(sync_period)]  # the last value wins


def launch(setting: str, flags: list[str], run_dir: Path, *, probe_dir: Path | None = None) -> None:
    """One 2-process run with the launcher's `--cpus setting`; probed (`_sync_probe`) into `probe_dir` if given."""
    module = "benchmarks._sync_probe" if probe_dir else "eqx_diloco.train"
    cmd = [sys.executable, "-m", "eqx_diloco.launch", "--num-processes", "2", "--cpus", setting, "--module", module,
           "--", *flags, "--run-dir", str(run_dir)]
    env = dict(os.environ, PYTHONPATH=str(common.REPO))
    if probe_dir:
        env[PROBE_DIR_ENV] = str(probe_dir)
    done = subprocess.run(cmd, check=False, env=env, cwd=common.REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: the {setting} run{' (probed)' if probe_dir else ''} failed (exit "
                         f"{done.returncode}):\n{done.stderr[-2000:]}")


def sync_breakdown(processes: list[list[dict]]) -> dict[str, list[float]]:
    """From each process's probe lines (in sync order): per sync, the gap between the two processes'
    inner steps and each process's sync time after the later inner step, in milliseconds."""
    count = min(len(lines) for lines in processes)
    apart, after = [], []
    for i in range(count):
        inner = [lines[i]["inner_done"] for lines in processes]
        apart.append(1e3 * (max(inner) - min(inner)))
        after.extend(1e3 * (lines[i]["sync_done"] - max(inner)) for lines in processes)
    return {"inner_steps_apart_ms": apart, "sync_after_later_inner_ms": after}


def summarize(plain: list[tuple[list[float], list[bool]]], probed: list[dict[str, list[float]]]) -> dict:
    """One setting's repeats: step multiples pooled over the runs, each run by its own median."""
    medians, sync_x, other_x = [], [], []
    for took, synced in plain:
        median = float(np.median(took))
        medians.append(1e3 * median)
        sync_x += [t / median for t, s in zip(took, synced) if s]
        other_x += [t / median for t, s in zip(took, synced) if not s]
    apart = [x for run in probed for x in run["inner_steps_apart_ms"]]
    after = [x for run in probed for x in run["sync_after_later_inner_ms"]]

    def spread(values: list[float]) -> dict[str, float]:
        return {"median": float(np.median(values)), "p90": float(np.percentile(values, 90)), "max": float(max(values))}

    return {"runs": len(plain), "median_step_ms": common.mean_sd(medians), "sync_step_x": spread(sync_x),
            "other_step_x": spread(other_x), "syncs_probed": len(apart), "inner_steps_apart_ms": spread(apart),
            "sync_after_later_inner_ms": spread(after)}


def render(result: dict) -> str:
    rows = [dict(setting=s, **v) for s, v in result["settings"].items()]

    def spread(v: dict[str, float]) -> str:
        return f"{v['median']:.2f} / {v['p90']:.2f} / {v['max']:.2f}"

    table = common.markdown_table(rows, [
        ("CPUs", "setting", lambda s: "each process on a core of its own (split)" if s == "split" else
         "both processes on every core (shared)"),
        ("runs", "runs", None),
        ("median step (ms)", "median_step_ms", lambda v: common.fmt_pm(v, ".2f")),
        ("sync step / median: median / p90 / max", "sync_step_x", spread),
        ("other steps / median: median / p90 / max", "other_step_x", spread),
        ("syncs probed", "syncs_probed", None),
        ("inner steps apart (ms): median / p90 / max", "inner_steps_apart_ms", spread),
        ("sync after the later inner step (ms): median / p90 / max", "sync_after_later_inner_ms", spread),
    ])
    return (f"# A blocking DiLoCo sync step between two processes (2 x 64 model, H = {result['sync_period']}, "
            f"{result['steps']} steps)\n\nCommand: `python -m benchmarks.sync_step`; revision {result['revision']}; "
            f"{result['machine'].get('cpu_count', '?')} CPUs. Nothing else ran.\n\n{table}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each kind per CPU setting")
    parser.add_argument("--steps", type=int, default=200, help="inner steps per run")
    parser.add_argument("--sync-period", type=int, default=10, help="H: inner steps between syncs")
    parser.add_argument("--cpus", nargs="+", choices=SETTINGS, default=list(SETTINGS), help="the launcher's CPU settings to run")
    parser.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                        help="do not run each setting once untimed first (the first runs may compile)")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="where to write sync_step.{json,md} (default runs/benchmarks/sync_step_default)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.sync_period < 1 or args.steps < 2 * args.sync_period:
        parser.error(f"--repeats and --sync-period must be >= 1 and --steps >= 2 x --sync-period "
                     f"(got {args.repeats}, {args.sync_period}, {args.steps})")
    if not CORPUS.is_dir():
        parser.error(f"the text the runs train on is missing: {CORPUS} (Debian's license texts)")
    out_dir = args.out_dir or common.default_out_dir("sync_step", "default")
    flags = trainer_flags(args.steps, args.sync_period, CORPUS)
    plain: dict[str, list] = {s: [] for s in args.cpus}
    probed: dict[str, list] = {s: [] for s in args.cpus}
    with tempfile.TemporaryDirectory(prefix="sync_step_") as tmp:
        work = Path(tmp)
        for setting in args.cpus if args.warm_up else []:
            print(f"warming the compilation cache: {setting}", flush=True)
            launch(setting, flags, work / f"warm-{setting}")
        for repeat in range(args.repeats):
            for setting in args.cpus:
                run = work / f"{setting}-{repeat}"
                launch(setting, flags, run)
                plain[setting].append(eqx_step_times(run / "metrics.jsonl"))
                probes = work / f"{setting}-{repeat}-probes"
                launch(setting, flags, work / f"{setting}-{repeat}-probed", probe_dir=probes)
                lines = [[json.loads(x) for x in (probes / f"process-{k}.jsonl").read_text().splitlines()]
                         for k in range(2)]
                probed[setting].append(sync_breakdown(lines))
                print(f"repeat {repeat + 1}/{args.repeats} {setting}: done", flush=True)
    result = {"revision": common.revision(), "machine": common.machine_info(), "steps": args.steps,
              "sync_period": args.sync_period,
              "warm_up": args.warm_up, "settings": {s: summarize(plain[s], probed[s]) for s in args.cpus}}
    common.write_json(out_dir / "sync_step.json", result)
    common.write_text(out_dir / "sync_step.md", render(result))
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
