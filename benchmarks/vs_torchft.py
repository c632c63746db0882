"""eqx_diloco beside torchft 0.2.0 on one tiny config: whole-run wall time and tokens/s.

Both systems train the same byte-level model (2 layers, width 64, 2 heads, 4 x 64 tokens
per replica step, 200 steps, lr 3e-4, 10 warm-up steps) on the same text files, run
alternately (torchft, then eqx_diloco, per config and repeat, so drift in the machine's
speed hits both). Configs:

- diloco: DiLoCo, R = 2 as 2 processes, H = 10;
- streaming: the same with 2 fragments, one step of overlap, alpha 0.5;
- plain: one process, a plain loop (torchft `--mode plain --threads 1`; eqx_diloco
  `--algorithm ddp` with one replica).

Measured: wall time from process start to exit of the whole command (torchft: its
`run.sh`, which starts a Lighthouse too; eqx_diloco: `python -m eqx_diloco.launch` or
`.train`); time from that start until step 1 is done (torchft: replica 0's first metrics
line, which it writes and flushes after each step; eqx_diloco: process 0's "first step done"
phase, when it read step 1's values); and tokens/s per replica after step 10 (torchft: its
`summary.json`, from its step times; eqx_diloco: from the metrics' timestamps of steps 10
and 200, which include host work between steps). Before the repeats each eqx_diloco config
runs once untimed, so every timed run finds its programs in the compilation cache (warm;
`--no-warm-up` times the first repeat as it comes). `--cold` adds an eqx_diloco run with an
empty compilation cache after each pair, compared with that pair's torchft run.
The table gives eqx/torchft ratios, mean +- sd over repeats, and the load average.

torch is never a dependency of this project: install the peer as its README says
(`../shared/peers/torchft/README.md`, a separate virtualenv) and pass its python:

    python -m benchmarks.vs_torchft --torch-python $VENV/bin/python --repeats 3 \\
        --json benchmarks/results/vs_torchft.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from benchmarks import _common as common

PEER = common.REPO.parent / "shared" / "peers" / "torchft"
CORPUS = Path("/usr/share/common-licenses")
STEPS, SKIP, TOKENS_PER_STEP = 200, 10, 4 * 64
PEER_FLAGS = ["--num-layers", "2", "--dim", "64", "--num-heads", "2", "--seq-len", "64", "--batch-size", "4",
              "--steps", str(STEPS), "--lr", "3e-4", "--warmup-steps", "10", "--bench-skip-steps", str(SKIP),
              "--log-every", "50"]
EQX_FLAGS = ["--model.num-layers", "2", "--model.dim", "64", "--model.num-heads", "2", "--train.batch-size", "4",
             "--train.seq-len", "64", "--train.steps", str(STEPS), "--train.lr", "3e-4", "--train.warmup-steps", "10",
             "--train.eval-every", "0", "--checkpoint.every", "0", "--train.log-every", "1", "--data.source", "text"]
CONFIGS = {  # name: (torchft mode and flags, eqx_diloco entry and flags, processes)
    "diloco": (["--mode", "diloco", "--replicas", "2"], ["--sync-every", "10"],
               ["--diloco.num-replicas", "2", "--diloco.sync-period", "10"], 2),
    "streaming": (["--mode", "diloco", "--replicas", "2"],
                  ["--sync-every", "10", "--num-fragments", "2", "--fragment-sync-delay", "1",
                   "--fragment-update-alpha", "0.5"],
                  ["--diloco.num-replicas", "2", "--diloco.sync-period", "10", "--diloco.num-fragments", "2",
                   "--diloco.overlap-steps", "1", "--diloco.alpha", "0.5"], 2),
    "plain": (["--mode", "plain", "--replicas", "1"], ["--threads", "1"],
              ["--algorithm", "ddp", "--diloco.num-replicas", "1"], 1),
}


def torchft_missing(python: str | None) -> str | None:
    """Why the peer cannot run (None if it can)."""
    if not python:
        return "no --torch-python given"
    probe = subprocess.run([python, "-c", "import torch, torchft"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"{python} cannot import torch and torchft"
    if not (PEER / "run.sh").exists():
        return f"the peer harness is not at {PEER}"
    return None


def eqx_tokens_per_s(metrics: Path) -> float:
    """Tokens/s per replica between steps SKIP and STEPS, from the metrics' timestamps."""
    times = {r["step"]: r["time"] for r in map(json.loads, metrics.read_text().splitlines())
             if "time" in r and "loss" in r}
    return (STEPS - SKIP) * TOKENS_PER_STEP / (times[STEPS] - times[SKIP])


def step_spread(took: list[float], synced: list[bool]) -> dict:
    """Step times (seconds) and whether each step synced: the median, and the slowest step that synced
    and the slowest that did not, each as a multiple of the median."""
    median = float(np.median(took))
    slowest = {flag: max((t for t, s in zip(took, synced) if s == flag), default=0.0) for flag in (True, False)}
    return {"median_step_s": median, "slowest_sync_step_x": slowest[True] / median,
            "slowest_other_step_x": slowest[False] / median}


def eqx_step_times(metrics: Path) -> tuple[list[float], list[bool]]:
    """eqx_diloco's step times after step 1 (seconds, from the metrics' timestamps; log-every 1) and
    whether each step synced."""
    by_step = {r["step"]: r for r in map(json.loads, metrics.read_text().splitlines()) if "time" in r and "loss" in r}
    steps = [t for t in sorted(by_step) if t >= 2 and t - 1 in by_step]
    return ([by_step[t]["time"] - by_step[t - 1]["time"] for t in steps],
            [by_step[t].get("synced_fragment") is not None for t in steps])


def eqx_step_spread(metrics: Path) -> dict:
    """`step_spread` of eqx_diloco's steps after step 1 (`eqx_step_times`)."""
    return step_spread(*eqx_step_times(metrics))


def torchft_step_spread(metrics: Path) -> dict:
    """`step_spread` of torchft's steps after step 1: replica 0's own `step_time_s` per step (the step
    call, its sync included)."""
    rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if r["step"] > 1]
    return step_spread([r["step_time_s"] for r in rows], [bool(r["sync"]) for r in rows])


def timed(cmd: list[str], env: dict, log: Path, first_line: Path | None = None) -> tuple[float, float | None]:
    """Run `cmd` to its end: (wall seconds, seconds until `first_line` held a whole line, or None).

    The wall clock's start is `time.time()` just before the process starts (see `eqx_first_step_s`)."""
    started, first = time.time(), None
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        while proc.poll() is None:
            if first is None and first_line is not None and first_line.exists() and b"\n" in first_line.read_bytes():
                first = time.time() - started
            time.sleep(0.005)
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd[:4])} ... failed (exit {proc.returncode}); its output: {log}")
    return time.time() - started, first


def eqx_first_step_s(run_dir: Path, started: float) -> float:
    """Seconds from `started` (the wall clock when the command was started) until process 0 of the run
    had step 1's values (its phases: `started_unix` plus the "first step done" mark)."""
    phases = json.loads((run_dir / "phases" / "process-0.json").read_text())
    done = next(m["s"] for m in phases["marks"] if m["phase"] == "first step done")
    return phases["started_unix"] + done - started


def run_eqx(name: str, corpus: Path, run_dir: Path, env: dict, log: Path) -> dict:
    """One eqx_diloco run of config `name`: wall seconds, seconds to step 1, and (warm runs) its speed."""
    started = time.time()
    wall, _ = timed(eqx_command(name, corpus, run_dir), env, log)
    return {"wall_s": wall, "start_to_step_1_s": eqx_first_step_s(run_dir, started)}


def eqx_command(name: str, corpus: Path, run_dir: Path) -> list[str]:
    _, _, eqx_flags, processes = CONFIGS[name]
    entry = ["-m", "eqx_diloco.launch", "--num-processes", str(processes), "--"] if processes > 1 else \
        ["-m", "eqx_diloco.train"]
    return [sys.executable, *entry, *EQX_FLAGS, "--data.path", str(corpus), *eqx_flags, "--run-dir", str(run_dir)]


def run_pair(name: str, python: str, corpus: Path, work: Path, cold: bool = False) -> dict:
    peer_mode, peer_flags, _, _ = CONFIGS[name]
    out = work / "torchft"
    env = dict(os.environ, PEER_PYTHON=python)
    torch_wall, torch_first = timed(["bash", str(PEER / "run.sh"), *peer_mode, "--out", str(out), "--",
                                     *PEER_FLAGS, "--data-path", str(corpus), *peer_flags], env, work / "torchft.log",
                                    first_line=out / "metrics_r0.jsonl")  # replica 0 writes a line per step
    summary = json.loads((out / "summary.json").read_text())
    torch_tps = sum(summary["tokens_per_s_per_replica"]) / len(summary["tokens_per_s_per_replica"])
    run_dir = work / "eqx"
    eqx = run_eqx(name, corpus, run_dir, dict(os.environ), work / "eqx.log")
    pair = {"torchft": {"wall_s": torch_wall, "start_to_step_1_s": torch_first, "tokens_per_s_per_replica": torch_tps,
                        **torchft_step_spread(out / "metrics_r0.jsonl")},
            "eqx_diloco": {**eqx, "tokens_per_s_per_replica": eqx_tokens_per_s(run_dir / "metrics.jsonl"),
                           **eqx_step_spread(run_dir / "metrics.jsonl")},
            "load_average": os.getloadavg()}
    if cold:  # the same run again with an empty compilation cache: every program compiled
        cache = work / "empty_cache"
        cache.mkdir()
        pair["eqx_diloco_cold"] = run_eqx(name, corpus, work / "eqx_cold", dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache)),
                                          work / "eqx_cold.log")
    return pair


def summarize(pairs: list[dict]) -> dict:
    """eqx/torchft ratios over repeats: wall time (lower is better for eqx) and tokens/s."""
    def ratios(eqx: str, key: str) -> dict | None:
        values = [p[eqx][key] / p["torchft"][key] for p in pairs if eqx in p and p["torchft"].get(key)]
        return common.mean_sd(values) if values else None

    spread = {k: max(p["eqx_diloco"].get(k, 0.0) for p in pairs) for k in ("slowest_sync_step_x", "slowest_other_step_x")}
    spread.update({f"torchft_{k}": max(p["torchft"].get(k, 0.0) for p in pairs)
                   for k in ("slowest_sync_step_x", "slowest_other_step_x")})
    return {"wall_ratio": ratios("eqx_diloco", "wall_s"), "tokens_per_s_ratio": ratios("eqx_diloco", "tokens_per_s_per_replica"),
            "start_to_step_1_ratio": ratios("eqx_diloco", "start_to_step_1_s"),
            "cold_wall_ratio": ratios("eqx_diloco_cold", "wall_s"),
            "cold_start_to_step_1_ratio": ratios("eqx_diloco_cold", "start_to_step_1_s"), **spread, "repeats": pairs}


def render(results: dict[str, dict]) -> str:
    def pm(stat: dict | None) -> str:
        if stat is None:
            return "-"
        return f"{stat['mean']:.2f} +- {stat['sd']:.2f}" if stat["sd"] is not None else f"{stat['mean']:.2f}"

    def seconds(system: str, key: str, repeats: list[dict]) -> str:
        values = [p[system][key] for p in repeats if system in p and p[system].get(key) is not None]
        return ", ".join(f"{x:.1f}" for x in values) or "-"

    rows = [{"config": name, "torch_wall": seconds("torchft", "wall_s", r["repeats"]),
             "eqx_wall": seconds("eqx_diloco", "wall_s", r["repeats"]), "wall": r["wall_ratio"],
             "torch_first": seconds("torchft", "start_to_step_1_s", r["repeats"]),
             "eqx_first": seconds("eqx_diloco", "start_to_step_1_s", r["repeats"]), "first": r["start_to_step_1_ratio"],
             "cold": (r["cold_wall_ratio"], r["cold_start_to_step_1_ratio"]),
             "tps": r["tokens_per_s_ratio"], "load": [p["load_average"][0] for p in r["repeats"]],
             "spread": (r.get("slowest_sync_step_x", 0.0), r.get("slowest_other_step_x", 0.0)),
             "torch_spread": (r.get("torchft_slowest_sync_step_x", 0.0), r.get("torchft_slowest_other_step_x", 0.0))}
            for name, r in results.items()]
    return common.markdown_table(rows, [
        ("config", "config", None), ("torchft wall s", "torch_wall", None), ("eqx wall s", "eqx_wall", None),
        ("wall eqx/torchft", "wall", pm), ("torchft start to step 1 s", "torch_first", None),
        ("eqx start to step 1 s", "eqx_first", None), ("start to step 1 eqx/torchft", "first", pm),
        ("cold eqx/torchft: wall; start to step 1", "cold", lambda v: f"{pm(v[0])}; {pm(v[1])}"),
        ("tokens/s per replica eqx/torchft", "tps", pm),
        ("torchft slowest step / median: sync, other", "torch_spread", lambda v: f"{v[0]:.1f}x, {v[1]:.1f}x"),
        ("eqx slowest step / median: sync, other", "spread", lambda v: f"{v[0]:.1f}x, {v[1]:.1f}x"),
        ("load average (1 min)", "load", lambda v: ", ".join(f"{x:.2f}" for x in v)),
    ])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch-python", default=os.environ.get("PEER_PYTHON"),
                        help="a python with torch and torchft (default $PEER_PYTHON)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--json", type=Path, default=None, help="write the results here (and the table beside it, .md)")
    parser.add_argument("--cold", action="store_true",
                        help="after each pair, run eqx_diloco once more with an empty compilation cache (cold)")
    parser.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                        help="do not run each eqx_diloco config once untimed first (the first repeat may compile)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1 (got {args.repeats})")
    missing = torchft_missing(args.torch_python)
    if missing:
        print(f"error: torchft is not installed: {missing}; set it up as {PEER / 'README.md'} says "
              "(a separate virtualenv) and pass --torch-python", file=sys.stderr)
        return 2
    if not CORPUS.is_dir():
        print(f"error: the text both systems train on is missing: {CORPUS} (Debian's license texts)", file=sys.stderr)
        return 2
    results: dict[str, list] = {name: [] for name in args.only}
    with tempfile.TemporaryDirectory(prefix="vs_torchft_") as tmp:
        corpus = Path(tmp) / "corpus"
        shutil.copytree(CORPUS, corpus, symlinks=False)  # the same files for both, links resolved
        for name in args.only if args.warm_up else []:
            print(f"warming the compilation cache: {name}", flush=True)
            timed(eqx_command(name, corpus, Path(tmp) / f"warm_{name}"), dict(os.environ), Path(tmp) / "warm.log")
        for repeat in range(args.repeats):
            for name in args.only:
                work = Path(tmp) / f"{name}_{repeat}"
                work.mkdir()
                pair = run_pair(name, args.torch_python, corpus, work, cold=args.cold)
                results[name].append(pair)
                print(f"repeat {repeat + 1}/{args.repeats} {name:<9} torchft {pair['torchft']['wall_s']:.1f} s, "
                      f"eqx_diloco {pair['eqx_diloco']['wall_s']:.1f} s", flush=True)
    summary = {name: summarize(pairs) for name, pairs in results.items()}
    if args.json:
        common.write_json(args.json, {"revision": common.revision(), "steps": STEPS, "timed_after_step": SKIP,
                                      "warm_up": args.warm_up, "cold": args.cold, "configs": summary})
        common.write_text(args.json.with_suffix(".md"), render(summary) + "\n")  # the table, with each run's times
    print(render(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
