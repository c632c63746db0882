"""Start-up time of the CLI trainer: seconds from process start to the end of step 1, cold and warm.

Each configuration runs `python -m eqx_diloco.train ARGS --train.log-every 1` as a fresh
process, timed from just before the process is started until its metrics.jsonl holds the
line of step 1 (written once step 1's metrics are read back, so every program step 1 needs,
including the evaluation at step 0, has been compiled and run); the process is then killed.
Also timed: the first line on its stdout (the setup banner).

- cold: JAX's persistent compilation cache points at a fresh, empty folder
  (`XDG_CACHE_HOME` set to a temporary folder; `JAX_COMPILATION_CACHE_DIR` removed from
  the environment), so every program is compiled;
- warm: the same command again with the same cache folder (`--repeats` times).

Before the timed runs one untimed process imports the trainer, so the operating system's
file cache holds Python's and JAX's files for every run alike: cold and warm differ only in
the compilation cache.

    python -m benchmarks.startup                  # default run and --diloco.num-fragments 4
    python -m benchmarks.startup --quick          # a tiny model (tests)

Results go to `--out` (default runs/benchmarks/startup.json, plus a .md beside it). An
existing file given with `--out` is only replaced with `--overwrite`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from importlib.metadata import version
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "runs" / "benchmarks" / "startup.json"

CONFIGS = {
    "full": [
        ("default", []),
        ("fragments4", ["--diloco.num-fragments", "4"]),
    ],
    "quick": [
        ("tiny", ["--model.num-layers", "2", "--model.dim", "32", "--model.num-heads", "2", "--train.seq-len", "16",
                  "--train.batch-size", "4", "--data.source", "synthetic", "--train.eval-sequences", "4"]),
    ],
}


def child_env(cache_home: pathlib.Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    env["XDG_CACHE_HOME"] = str(cache_home)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def step_one_logged(metrics: pathlib.Path) -> bool:
    try:
        text = metrics.read_text()
    except FileNotFoundError:
        return False
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("step", 0) >= 1 and "loss" in record:
            return True
    return False


def time_to_step_one(args: list[str], run_dir: pathlib.Path, cache_home: pathlib.Path, *,
                     timeout_s: float) -> dict[str, float]:
    """{"step1_s", "banner_s"}: seconds from process start to step 1's metrics line and to its first stdout line."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    command = [sys.executable, "-m", "eqx_diloco.train", *args, "--train.log-every", "1", "--run-dir", str(run_dir)]
    first_line: list[float] = []
    tail: list[str] = []
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=REPO, env=child_env(cache_home), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def read_output():
        for line in proc.stdout:
            if not first_line:
                first_line.append(time.perf_counter() - start)
            tail.append(line.rstrip())
            del tail[:-20]

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    metrics = run_dir / "metrics.jsonl"
    try:
        while True:
            if step_one_logged(metrics):
                step1 = time.perf_counter() - start
                break
            if proc.poll() is not None:
                if step_one_logged(metrics):
                    step1 = time.perf_counter() - start
                    break
                raise RuntimeError(f"the trainer exited ({proc.returncode}) before step 1:\n" + "\n".join(tail))
            if time.perf_counter() - start > timeout_s:
                raise RuntimeError(f"no step 1 within {timeout_s:.0f} s:\n" + "\n".join(tail))
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        reader.join(timeout=5)
        proc.stdout.close()
    return {"step1_s": round(step1, 3), "banner_s": round(first_line[0], 3) if first_line else None}


def run(mode: str, *, repeats: int = 2, timeout_s: float = 900.0, log=print) -> dict[str, Any]:
    results = []
    with tempfile.TemporaryDirectory(prefix="eqx_diloco_startup_") as tmp:
        tmp = pathlib.Path(tmp)
        # Untimed: bring Python's and JAX's files into the OS file cache for every run alike.
        subprocess.run([sys.executable, "-c", "import eqx_diloco.lm.trainer"], cwd=REPO,
                       env=child_env(tmp / "warmup"), check=True, capture_output=True)
        for name, args in CONFIGS[mode]:
            cache_home = tmp / f"cache_{name}"
            cold = time_to_step_one(args, tmp / f"run_{name}", cache_home, timeout_s=timeout_s)
            log(f"{name}: cold {cold['step1_s']:.1f} s to step 1 (banner at {cold['banner_s']} s)")
            warm = []
            for i in range(repeats):
                warm.append(time_to_step_one(args, tmp / f"run_{name}", cache_home, timeout_s=timeout_s))
                log(f"{name}: warm {i + 1} {warm[-1]['step1_s']:.1f} s to step 1 (banner at {warm[-1]['banner_s']} s)")
            warm_s = statistics.median(w["step1_s"] for w in warm)
            cache_files = sum(1 for _ in (cache_home / "eqx_diloco" / "jax").glob("*"))
            results.append({
                "name": name,
                "command": " ".join(["python -m eqx_diloco.train", *args]),
                "cold_s": cold["step1_s"],
                "warm_s": [w["step1_s"] for w in warm],
                "warm_median_s": warm_s,
                "speedup": round(cold["step1_s"] / warm_s, 2),
                "banner_cold_s": cold["banner_s"],
                "banner_warm_s": [w["banner_s"] for w in warm],
                "cache_entries": cache_files,
            })
    return {
        "benchmark": "startup",
        "mode": mode,
        "measure": "seconds from process start to the metrics line of step 1 (--train.log-every 1)",
        "machine": {
            "cpu_count": os.cpu_count(),
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
            "platform": platform.platform(),
            "python": platform.python_version(),
            "jax": version("jax"),
        },
        "runs": results,
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "| command | cold: s to step 1 | warm: s to step 1 | cold / warm | banner (cold, warm) |",
        "|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        warm = ", ".join(f"{w:.1f}" for w in r["warm_s"])
        banner = f"{r['banner_cold_s']:.1f} s, {statistics.median(r['banner_warm_s']):.1f} s"
        lines.append(f"| `{r['command']}` | {r['cold_s']:.1f} | {warm} | {r['speedup']:.1f}x | {banner} |")
    m = result["machine"]
    lines.append("")
    lines.append(f"{m['cpu_count']} CPUs, {m['platform']}, Python {m['python']}, JAX {m['jax']}; "
                 f"load average at the end {m['load_average_at_end']}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.startup", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one tiny model instead of the default configs")
    parser.add_argument("--repeats", type=int, default=2, help="warm runs per config (median reported)")
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help=f"result JSON (default {DEFAULT_OUT.relative_to(REPO)}); a .md is written beside it")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per trainer process")
    args = parser.parse_args(argv)
    out = args.out or DEFAULT_OUT
    if args.out is not None and not args.overwrite:
        existing = [p for p in (out, out.with_suffix(".md")) if p.exists()]
        if existing:
            print(f"error: {existing[0]} exists (pass --overwrite to replace it)", file=sys.stderr)
            return 2
    result = run("quick" if args.quick else "full", repeats=args.repeats, timeout_s=args.timeout)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
