"""Cost of asynchronous checkpointing: step time with a checkpoint every N steps vs none.

(a) Paired windows in one process (the figure of merit): the default train state and the
    trainer's own compiled inner step and outer syncs (`Trainer.inner_step`,
    `Trainer.outer_steps`), run in windows of N steps. A "plain" window is N steps; a
    "checkpoint" window is a `Checkpointer.save` of the current state followed by the same
    N steps, timed until the save's background write has also finished (so a write that
    outlasts the window is charged in full). Windows alternate (order swapped every round)
    and the overhead is the median over rounds of checkpoint / plain - 1, which cancels
    slow drifts of a shared machine.

(b) One save of that state: how long `save` blocks the caller (checksums, device-to-host
    copy, orbax bookkeeping), how long until the background write is done, the size on
    disk, and a full restore onto the mesh.

(c) With `--e2e-repeats K`: real training runs of `python -m eqx_diloco.train`
    alternating `--checkpoint.every 0` and `--checkpoint.every N` (K each, one shared
    persistent compilation cache). The time of step t is read from metrics.jsonl
    (`--train.log-every 1`): tokens of one step / that line's `tokens_per_s`. Steps
    1..`--skip` (compilation, first save) are left out; mean and median over the rest.
    On a machine shared with other work this is much noisier than (a).

The default config's model and batch are used unless `--train-args` says otherwise.
Run `python -m benchmarks.checkpoint_overhead --help`. Prints tables; `--json PATH` writes
the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_training(run_dir: Path, every: int, steps: int, train_args: list[str], env: dict) -> dict:
    cmd = [sys.executable, "-m", "eqx_diloco.train", *train_args, "--run-dir", str(run_dir),
           "--train.steps", str(steps), "--train.log-every", "1", "--train.eval-every", "0",
           "--checkpoint.every", str(every)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"training failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    config = json.loads((run_dir / "config.json").read_text())
    t = config["train"]
    tokens_per_step = config["diloco"]["num_replicas"] * t["batch_size"] * t["seq_len"]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    seconds = {r["step"]: tokens_per_step / r["tokens_per_s"] for r in lines if "tokens_per_s" in r}
    return {"every": every, "wall_s": wall, "step_s": seconds, "tokens_per_step": tokens_per_step}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def in_process(train_args: list[str], every: int, rounds: int, saves: int, workdir: Path) -> dict:
    """(a) paired windows and (b) single-save timings, on the trainer's compiled programs."""
    import tyro

    from eqx_diloco.lm.config import Config
    from eqx_diloco._mesh import ensure_cpu_devices
    from eqx_diloco.lm._layout import devices_needed

    config = tyro.cli(Config, args=[*train_args, "--run-dir", str(workdir / "inprocess"),
                                    "--checkpoint.every", str(every), "--checkpoint.keep", "2"])
    ensure_cpu_devices(devices_needed(config))
    import jax

    from eqx_diloco.lm.trainer import Trainer

    trainer = Trainer(config, verbose=False)
    checkpointer = trainer.checkpointer
    state, _ = trainer.initial_state()
    step = 0

    def advance(state, n):
        nonlocal step
        for _ in range(n):
            tokens = jax.device_put(trainer.batches.batch(step), trainer.batch_sharding)
            state, _ = trainer.inner_step(state, tokens)
            step += 1
            if trainer.outer is not None:
                state = trainer.outer_steps(state, step)[0]
        return jax.block_until_ready(state)

    def save(state):
        if hasattr(trainer, "install_pending"):  # launched syncs go into the state first
            state = trainer.install_pending(state)
        checkpointer.save(step, state, config)
        return state

    # Warm-up: compile every program a window runs (a full sync period) and the checksums.
    state = advance(state, max(every, config.diloco.sync_period) + 1)
    state = save(state)
    checkpointer.wait()

    plain, checkpoint = [], []
    for r in range(rounds):
        for kind in ("plain", "checkpoint") if r % 2 == 0 else ("checkpoint", "plain"):
            start = time.perf_counter()
            if kind == "checkpoint":
                state = save(state)
            state = advance(state, every)
            if kind == "checkpoint":
                checkpointer.wait()
                checkpoint.append(time.perf_counter() - start)
            else:
                plain.append(time.perf_counter() - start)
        print(f"  round {r}: plain {plain[-1] / every * 1e3:7.1f} ms/step   with a save "
              f"{checkpoint[-1] / every * 1e3:7.1f} ms/step", flush=True)
    ratios = [c / p for c, p in zip(checkpoint, plain)]

    blocking, total = [], []
    for _ in range(saves):
        step += 1  # a fresh step number for every save (the state is the same)
        start = time.perf_counter()
        checkpointer.save(step, state, config)
        blocking.append(time.perf_counter() - start)
        checkpointer.wait()
        total.append(time.perf_counter() - start)
    size = dir_bytes(checkpointer.directory / str(step))
    start = time.perf_counter()
    restored = checkpointer.restore_latest(trainer.abstract_state, trainer.shardings, trainer.resume_check)
    jax.block_until_ready(restored[0])
    restore_s = time.perf_counter() - start
    checkpointer.close()
    leaves = jax.tree.leaves(state)
    return {
        "windows": {
            "steps_per_window": every,
            "rounds": rounds,
            "plain_step_s": [t / every for t in plain],
            "checkpoint_step_s": [t / every for t in checkpoint],
            "ratios": ratios,
            "median_plain_step_s": statistics.median(plain) / every,
            "median_checkpoint_step_s": statistics.median(checkpoint) / every,
            "overhead": statistics.median(ratios) - 1,
        },
        "save": {
            "state_arrays": len(leaves),
            "state_bytes": int(sum(x.nbytes for x in leaves)),
            "checkpoint_bytes": size,
            "save_blocking_s": statistics.median(blocking),
            "save_total_s": statistics.median(total),
            "restore_s": restore_s,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint_overhead",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--every", type=int, default=10, help="steps per checkpoint (and per timed window)")
    parser.add_argument("--rounds", type=int, default=6, help="(a): pairs of windows")
    parser.add_argument("--saves", type=int, default=5, help="(b): saves timed")
    parser.add_argument("--e2e-repeats", type=int, default=0, help="(c): training runs of each variant (0 = skip)")
    parser.add_argument("--steps", type=int, default=60, help="(c): steps per training run")
    parser.add_argument("--skip", type=int, default=10, help="(c): leading steps left out of the timing")
    parser.add_argument("--train-args", default="", help="trainer flags, e.g. '--model.num-layers 4'")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--keep", type=Path, default=None, help="keep the run folders here (default: a temp dir)")
    args = parser.parse_args(argv)
    train_args = shlex.split(args.train_args)
    if args.e2e_repeats and args.skip >= args.steps:
        parser.error("--skip must be < --steps")

    workdir = Path(tempfile.mkdtemp(prefix="ckpt_bench_")) if args.keep is None else args.keep
    workdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(
        JAX_COMPILATION_CACHE_DIR=str(workdir / "jax_cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
    )
    load_before = os.getloadavg()
    runs = []
    try:
        print(f"(a) paired windows of {args.every} steps, {args.rounds} rounds", flush=True)
        measured = in_process(train_args, args.every, args.rounds, args.saves, workdir)
        if args.e2e_repeats:
            print(f"(c) training runs, {args.steps} steps", flush=True)
            # Warm the compilation cache so that no timed run pays for compiling.
            run_training(workdir / "warmup", args.every, args.every + 1, train_args, env)
            for r in range(args.e2e_repeats):
                for every in (0, args.every) if r % 2 == 0 else (args.every, 0):
                    run = run_training(workdir / f"every{every}_{r}", every, args.steps, train_args, env)
                    timed = [s for t, s in run["step_s"].items() if t > args.skip]
                    run.update(mean_step_s=statistics.fmean(timed), median_step_s=statistics.median(timed),
                               timed_steps=len(timed))
                    runs.append(run)
                    print(f"  every={every:<3} repeat {r}: mean {run['mean_step_s'] * 1e3:7.1f} ms/step  "
                          f"median {run['median_step_s'] * 1e3:7.1f} ms/step  wall {run['wall_s']:.1f} s",
                          flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)

    w, sv = measured["windows"], measured["save"]
    flags = f"trainer flags: {args.train_args}" if args.train_args else "default config"
    print()
    print(f"(a) step time with a checkpoint every {args.every} steps vs none ({flags}; median of {args.rounds} "
          f"paired windows)")
    print("| checkpoint.every | s/step | vs none |")
    print("|---|---|---|")
    print(f"| 0 | {w['median_plain_step_s']:.4f} | |")
    print(f"| {args.every} | {w['median_checkpoint_step_s']:.4f} | {w['overhead'] * 100:+.1f}% |")
    print()
    print(f"(b) one save of the train state (median of {args.saves})")
    print("| state arrays | state MB | checkpoint MB | save blocks caller | save complete | restore |")
    print("|---|---|---|---|---|---|")
    print(f"| {sv['state_arrays']} | {sv['state_bytes'] / 1e6:.1f} | {sv['checkpoint_bytes'] / 1e6:.1f} | "
          f"{sv['save_blocking_s'] * 1e3:.1f} ms | {sv['save_total_s'] * 1e3:.1f} ms | "
          f"{sv['restore_s'] * 1e3:.1f} ms |")
    summary = {}
    if runs:
        print()
        print(f"(c) training runs, steps {args.skip + 1}..{args.steps}, {args.e2e_repeats} run(s) each")
        print("| checkpoint.every | mean s/step | median s/step | vs none (mean) |")
        print("|---|---|---|---|")
        for every in (0, args.every):
            mine = [r for r in runs if r["every"] == every]
            summary[every] = {"mean_step_s": statistics.fmean(r["mean_step_s"] for r in mine),
                              "median_step_s": statistics.fmean(r["median_step_s"] for r in mine)}
        for every, m in summary.items():
            rel = "" if every == 0 else f"{(m['mean_step_s'] / summary[0]['mean_step_s'] - 1) * 100:+.1f}%"
            print(f"| {every} | {m['mean_step_s']:.4f} | {m['median_step_s']:.4f} | {rel} |")
    print(f"\ncheckpointing every {args.every} steps: {w['overhead'] * 100:+.1f}% step time "
          f"({'within' if w['overhead'] <= 0.10 else 'OVER'} the 10% budget); load average "
          f"{load_before[0]:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if args.json is not None:
        result = {
            "benchmark": "checkpoint_overhead",
            "every": args.every,
            "train_args": train_args,
            "overhead": w["overhead"],
            **measured,
            "e2e": {
                "steps": args.steps, "skip": args.skip, "summary": {str(k): v for k, v in summary.items()},
                "runs": [{**{k: v for k, v in r.items() if k != "step_s"},
                          "step_s": {str(t): x for t, x in r["step_s"].items()}} for r in runs],
            },
            "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version(), "load_avg_before": load_before,
                        "load_avg_after": os.getloadavg()},
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
