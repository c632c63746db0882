"""Where a whole run's time goes, from process start to exit: 1 process and 2 launched processes, cold and warm.

The config is the one eqx_diloco is compared with torchft on (`benchmarks/vs_torchft.py`: 2
layers x 64, 4 x 64 tokens per replica step, DiLoCo R = 2, H = 10, 200 steps, no evaluation
or checkpoint), on the embedded corpus. Each run is a fresh process (or the launcher with 2
processes), timed from just before it starts until it exits; `--train.log-every 1` lets the
time of step 1's metrics line be read too. Each trainer process writes the end of each of its
phases, in seconds since that process started (`RUN_DIR/phases/process-K.json`, see
`eqx_diloco/lm/_phases.py`); the table gives each phase's own length, and "exit" is the time
from the last phase to the run's end (JAX's shutdown, the interpreter's, the launcher's).

- cold: JAX's persistent compilation cache in a fresh, empty folder;
- warm: the same command again with that folder (`--repeats` times; the median is shown).

    python -m benchmarks.startup_breakdown              # 2 layouts x (1 cold + 2 warm), about 3 minutes
    python -m benchmarks.startup_breakdown --steps 20   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import _common as common

FLAGS = ["--model.num-layers", "2", "--model.dim", "64", "--model.num-heads", "2", "--train.batch-size", "4",
         "--train.seq-len", "64", "--train.lr", "3e-4", "--train.warmup-steps", "10", "--train.eval-every", "0",
         "--checkpoint.every", "0", "--train.log-every", "1", "--diloco.num-replicas", "2",
         "--diloco.sync-period", "10"]
LAYOUTS = {"1 process": 1, "2 processes": 2}


def command(processes: int, steps: int, run_dir: pathlib.Path) -> list[str]:
    entry = ["-m", "eqx_diloco.launch", "--num-processes", str(processes), "--"] if processes > 1 else \
        ["-m", "eqx_diloco.train"]
    return [sys.executable, *entry, *FLAGS, "--train.steps", str(steps), "--run-dir", str(run_dir)]


def step_one_s(metrics: pathlib.Path) -> float | None:
    """The trainer's own time of step 1's line (seconds since `Trainer.run` started), if written."""
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if record.get("step") == 1 and "time" in record:
            return record["time"]
    return None


def run_once(processes: int, steps: int, run_dir: pathlib.Path, cache_home: pathlib.Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    env["XDG_CACHE_HOME"] = str(cache_home)
    start = time.perf_counter()
    proc = subprocess.run(command(processes, steps, run_dir), cwd=common.REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"error: the run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    phases = {}
    for path in sorted((run_dir / "phases").glob("process-*.json")):
        phases[path.stem] = json.loads(path.read_text())["marks"]
    return {"wall_s": round(wall, 3), "phases": phases}


def own_lengths(marks: list[dict]) -> dict[str, float]:
    """Each phase's own length: its end minus the previous phase's end (the first from process start)."""
    out, previous = {}, 0.0
    for m in marks:
        out[m["phase"]] = round(m["s"] - previous, 3)
        previous = m["s"]
    return out


def summarize(runs: list[dict]) -> dict:
    """Per process: the median of each phase's own length, and of the time from its last phase to the run's end."""
    out = {}
    for process in runs[0]["phases"]:
        lengths = [own_lengths(r["phases"][process]) for r in runs]
        exits = [r["wall_s"] - r["phases"][process][-1]["s"] for r in runs]
        out[process] = {**{name: statistics.median(x[name] for x in lengths) for name in lengths[0]},
                        "exit": round(statistics.median(exits), 3)}
    return {"wall_s": statistics.median(r["wall_s"] for r in runs), "phases": out}


def markdown(result: dict) -> str:
    columns = [(layout, cache, process) for layout in result["layouts"] for cache in ("cold", "warm")
               for process in result["layouts"][layout][cache]["phases"]]
    names = list(next(iter(result["layouts"].values()))["cold"]["phases"]["process-0"])
    head = "| phase (seconds) | " + " | ".join(
        f"{layout}, {cache}" + (f", {process}" if layout != "1 process" else "") for layout, cache, process in columns)
    lines = [head + " |", "|---|" + "---|" * len(columns)]
    for name in names:
        cells = [result["layouts"][layout][cache]["phases"][process].get(name) for layout, cache, process in columns]
        lines.append(f"| {name} | " + " | ".join("-" if c is None else f"{c:.2f}" for c in cells) + " |")
    walls = [result["layouts"][layout][cache]["wall_s"] for layout, cache, _ in columns]
    lines.append("| **whole run, start to exit** | " + " | ".join(f"**{w:.2f}**" for w in walls) + " |")
    return "\n".join([
        "# Where a run's time goes",
        "",
        (f"{result['what']}. Revision {result['revision']}; {result['steps']} steps; warm: median of "
         f"{result['repeats']} runs. Load average at the end {result['load_average']}."),
        "",
        *lines,
    ]) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2, help="warm runs per layout (median reported)")
    parser.add_argument("--out", type=pathlib.Path, default=common.RESULTS_DIR / "startup_breakdown.json")
    args = parser.parse_args(argv)
    rev = common.revision()
    layouts = {}
    with tempfile.TemporaryDirectory(prefix="eqx_diloco_breakdown_") as tmp:
        tmp = pathlib.Path(tmp)
        for name, processes in LAYOUTS.items():
            cache_home = tmp / f"cache_{processes}"
            cold = run_once(processes, args.steps, tmp / f"run_{processes}_cold", cache_home)
            print(f"{name}: cold {cold['wall_s']:.1f} s", flush=True)
            warm = []
            for i in range(args.repeats):
                warm.append(run_once(processes, args.steps, tmp / f"run_{processes}_warm{i}", cache_home))
                print(f"{name}: warm {warm[-1]['wall_s']:.1f} s", flush=True)
            layouts[name] = {"cold": summarize([cold]), "warm": summarize(warm), "runs": {"cold": cold, "warm": warm}}
    result = {"what": "seconds per phase of python -m eqx_diloco.train (1 process) and python -m eqx_diloco.launch "
                      "--num-processes 2, the vs_torchft config (2 x 64, R = 2, H = 10) on the embedded corpus",
              "revision": rev, "machine": common.machine_info(), "steps": args.steps, "repeats": args.repeats,
              "load_average": [round(x, 2) for x in os.getloadavg()], "layouts": layouts}
    common.write_json(args.out, result)
    args.out.with_suffix(".md").write_text(markdown(result))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return result


if __name__ == "__main__":
    main()
