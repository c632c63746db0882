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
`.train`), and tokens/s per replica after step 10 (torchft: its `summary.json`, from its
step times; eqx_diloco: from the metrics' timestamps of steps 10 and 200, which include
host work between steps). Before the repeats each eqx_diloco config runs once untimed, so every
timed run finds its programs in the compilation cache (warm; `--no-warm-up` times the first
repeat as it comes).
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


def eqx_step_spread(metrics: Path) -> dict:
    """eqx_diloco's step times after step 1 (from the metrics' timestamps, log-every 1): the median, and
    the slowest step that synced and the slowest that did not, each as a multiple of the median."""
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if "time" in r and "loss" in r]
    by_step = {r["step"]: r for r in records}
    steps = [t for t in range(2, STEPS + 1) if t in by_step and t - 1 in by_step]
    took = {t: by_step[t]["time"] - by_step[t - 1]["time"] for t in steps}
    median = float(np.median(list(took.values())))
    synced = [took[t] for t in steps if by_step[t].get("synced_fragment") is not None]
    plain = [took[t] for t in steps if by_step[t].get("synced_fragment") is None]
    return {"median_step_s": median, "slowest_sync_step_x": max(synced, default=0.0) / median,
            "slowest_other_step_x": max(plain, default=0.0) / median}


def timed(cmd: list[str], env: dict, log: Path) -> float:
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd[:4])} ... failed (exit {proc.returncode}); its output: {log}")
    return time.perf_counter() - start


def eqx_command(name: str, corpus: Path, run_dir: Path) -> list[str]:
    _, _, eqx_flags, processes = CONFIGS[name]
    entry = ["-m", "eqx_diloco.launch", "--num-processes", str(processes), "--"] if processes > 1 else \
        ["-m", "eqx_diloco.train"]
    return [sys.executable, *entry, *EQX_FLAGS, "--data.path", str(corpus), *eqx_flags, "--run-dir", str(run_dir)]


def run_pair(name: str, python: str, corpus: Path, work: Path) -> dict:
    peer_mode, peer_flags, _, _ = CONFIGS[name]
    out = work / "torchft"
    env = dict(os.environ, PEER_PYTHON=python)
    torch_wall = timed(["bash", str(PEER / "run.sh"), *peer_mode, "--out", str(out), "--",
                        *PEER_FLAGS, "--data-path", str(corpus), *peer_flags], env, work / "torchft.log")
    summary = json.loads((out / "summary.json").read_text())
    torch_tps = sum(summary["tokens_per_s_per_replica"]) / len(summary["tokens_per_s_per_replica"])
    run_dir = work / "eqx"
    eqx_wall = timed(eqx_command(name, corpus, run_dir), dict(os.environ), work / "eqx.log")
    return {"torchft": {"wall_s": torch_wall, "tokens_per_s_per_replica": torch_tps},
            "eqx_diloco": {"wall_s": eqx_wall, "tokens_per_s_per_replica": eqx_tokens_per_s(run_dir / "metrics.jsonl"),
                           **eqx_step_spread(run_dir / "metrics.jsonl")},
            "load_average": os.getloadavg()}


def summarize(pairs: list[dict]) -> dict:
    """eqx/torchft ratios over repeats: wall time (lower is better for eqx) and tokens/s."""
    wall = [p["eqx_diloco"]["wall_s"] / p["torchft"]["wall_s"] for p in pairs]
    tps = [p["eqx_diloco"]["tokens_per_s_per_replica"] / p["torchft"]["tokens_per_s_per_replica"] for p in pairs]
    spread = {k: max(p["eqx_diloco"].get(k, 0.0) for p in pairs) for k in ("slowest_sync_step_x", "slowest_other_step_x")}
    return {"wall_ratio": common.mean_sd(wall), "tokens_per_s_ratio": common.mean_sd(tps), **spread, "repeats": pairs}


def render(results: dict[str, dict]) -> str:
    def pm(stat: dict) -> str:
        return f"{stat['mean']:.2f} +- {stat['sd']:.2f}" if stat["sd"] is not None else f"{stat['mean']:.2f}"

    rows = [{"config": name, "torch_wall": [p["torchft"]["wall_s"] for p in r["repeats"]],
             "eqx_wall": [p["eqx_diloco"]["wall_s"] for p in r["repeats"]], "wall": r["wall_ratio"],
             "tps": r["tokens_per_s_ratio"], "load": [p["load_average"][0] for p in r["repeats"]],
             "spread": (r.get("slowest_sync_step_x", 0.0), r.get("slowest_other_step_x", 0.0))}
            for name, r in results.items()]
    seconds = lambda v: ", ".join(f"{x:.1f}" for x in v)  # noqa: E731
    return common.markdown_table(rows, [
        ("config", "config", None), ("torchft wall s", "torch_wall", seconds), ("eqx wall s", "eqx_wall", seconds),
        ("wall eqx/torchft", "wall", pm), ("tokens/s per replica eqx/torchft", "tps", pm),
        ("eqx slowest step / median: sync, other", "spread", lambda v: f"{v[0]:.1f}x, {v[1]:.1f}x"),
        ("load average (1 min)", "load", lambda v: ", ".join(f"{x:.2f}" for x in v)),
    ])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch-python", default=os.environ.get("PEER_PYTHON"),
                        help="a python with torch and torchft (default $PEER_PYTHON)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
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
                pair = run_pair(name, args.torch_python, corpus, work)
                results[name].append(pair)
                print(f"repeat {repeat + 1}/{args.repeats} {name:<9} torchft {pair['torchft']['wall_s']:.1f} s, "
                      f"eqx_diloco {pair['eqx_diloco']['wall_s']:.1f} s", flush=True)
    summary = {name: summarize(pairs) for name, pairs in results.items()}
    if args.json:
        common.write_json(args.json, {"revision": common.revision(), "steps": STEPS, "timed_after_step": SKIP,
                                      "warm_up": args.warm_up, "configs": summary})
    print(render(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
