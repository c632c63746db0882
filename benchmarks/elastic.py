"""Elastic islands under fire: 3 islands, SIGKILL one at random moments, the run goes on.

Issue 14's acceptance benchmark. One run of `python -m eqx_diloco.launch --num-processes 3
--max-restarts K --rejoin-after-s 1 --drain-s 3 -- --elastic.enabled ...` (one island per
process) is attacked by a kill driver: K times it picks an island and a moment, SIGKILLs that
island's trainer process (the pid in `<run-dir>/elastic/island-<i>/progress.json`), then waits
until the run re-formed without it AND the island rejoined (all 3 islands training again)
before the next kill, so the kills are spread over the run. Then (not in `--smoke`) the same
command runs once more without kills (same seed), and the final eval losses are compared.

The moments (seeded `random.Random(--seed)`): each kill gets a target step (the run's
kill window cut into K equal slices, a uniform step in each; never earlier than 1 to H steps
after the previous rejoin), a random island, and a kind, the K kinds dealt round-robin from
(`checkpoint`, `sync`, `any`) and shuffled. Once the island reported the target step:

- `sync`: at a fresh line of a step during which a sync is in flight (see below), kill it
  0.3 to 1.5 step times later (uniform), when the sync's exchange is most likely running;
- `checkpoint`: once an orbax save is running (a `<step>.orbax-checkpoint-tmp*` folder of this
  generation under `<run-dir>/checkpoints`), kill it after a uniform delay in [0, 20 ms);
- `any`: after a uniform delay in [0, one step time).

A moment that does not come within 4 checkpoint periods falls back to `any`. What the kill
hit is recorded from what is visible just before the signal: an orbax save in progress (its tmp
folder), an island snapshot being written (a `<step>.snapshot.tmp` of this generation; a kill
mid-write leaves one behind), and whether the island had an overlapped sync in flight: launched
(dispatched to its communication device) and not merged yet, read off the island's newest
line t (`sync_in_flight`: the trainer writes the line of t once step t + 1, and the sync
launched after it, are dispatched, and waits for a boundary step t + 1 to be computed before
that line; with tau = 1 a sync is in flight during the lines of the odd steps). Whether its
bytes were on the wire at that instant or it was still queued behind step t + 1 is not visible
from outside. Step time is the attacked run's own, from metrics.jsonl.

Reported (from metrics.jsonl's `island_lost` / `island_rejoined` events and the driver's
clock): kills survived / tried (survived: the loss is logged for that island, the others
train on with 2 replicas, the island rejoins and trains with 3, and the run goes on to the
next kill, or for the last one finishes with exit 0 and its final evaluation); per kill the
seconds the run stalled at the loss and at the rejoin (the events' `stalled_s`), the inner
steps of work lost (the event's `lost_steps`: the newest step any island had reported minus
the sync boundary the run re-formed from; bound: H = `--diloco.sync-period`, flagged when
exceeded); the final eval loss of the attacked run vs the uninterrupted one (acceptance:
within 2%); and whether metrics.jsonl holds every step's line exactly once.

Pinned (every mode): 3 islands; the model of the tests (2 layers, width 32, 2 heads), seq 32,
4 sequences per island, the embedded corpus (first 1 MB), 16 eval sequences; Streaming DiLoCo
H = 6, P = 3, tau = 1 (a fragment syncs every 2 steps and each sync overlaps one step, so a
sync is in flight half the time; sync boundaries, where islands snapshot, every 2 steps);
the default inner AdamW; outer SGD lr 1.0 with Nesterov momentum 0.3 (the CLI default, pinned:
its buffer is outer state each re-formed run must carry over); checkpoints every 5 steps; one
evaluation at the end; training seed 0; `--elastic.min-replicas 2`; launcher `--rejoin-after-s 1
--drain-s 3 --grace-s 10`;
JAX's persistent compilation cache on (the CLI default) in a folder of this benchmark,
shared by both runs. Modes (`_common.add_mode_flags`):

- `--quick` (default): 3 kills, 120 steps;
- `--full`: 10 kills, 240 steps (the acceptance run);
- `--smoke`: 1 kill, 36 steps, for the test suite: its islands keep the caller's `XLA_FLAGS` (the
  suite's compile faster), since its times are not figures.

Every wait has a timeout and the whole benchmark a bound (`--timeout`, default per mode:
smoke 600 s, quick 1800 s, full 3600 s): past it, the launcher is stopped (SIGTERM, then
SIGKILL of its process group; islands die with it) and the result says why it failed, with
the tails of the launcher's and the islands' logs.

Output in `--out-dir` (default `runs/benchmarks/elastic_<mode>`; committed results under
`benchmarks/results` are written only when `--out-dir benchmarks/results` is given):
`elastic.json` (or `--json PATH`) and `elastic.md`. Run dirs and logs go to `--work-dir`
(default: a temporary folder, removed after a passing run and kept, and named, otherwise).
Exit status 0 when every acceptance check passed, 1 otherwise.

Run `python -m benchmarks.elastic --help`.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from importlib.metadata import version

if __package__ in (None, ""):  # `python benchmarks/elastic.py`
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import _common as common
from benchmarks._elastic.analysis import analyse
from benchmarks._elastic.attack import attacked_run
from benchmarks._elastic.launcher import reference_run
from benchmarks._elastic.observe import Failed
from benchmarks._elastic.report import render_markdown
from benchmarks._elastic.settings import (
    CHECKPOINT_EVERY,
    DRAIN_S,
    GRACE_S,
    ISLANDS,
    MODES,
    NAME,
    REJOIN_AFTER_S,
    REPO,
    TAU,
    TRAIN_SEED,
    H,
    P,
    child_env,
    train_flags,
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.elastic", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_mode_flags(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill driver's moments (default 0)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="bound in seconds on the whole benchmark (default: smoke 600, quick 1800, full 3600)")
    parser.add_argument("--out-dir", type=pathlib.Path, default=None,
                        help="output folder (default runs/benchmarks/elastic_<mode>; committed results under "
                             "benchmarks/results only when given explicitly)")
    parser.add_argument("--json", type=pathlib.Path, default=None, help="JSON output (default <out-dir>/elastic.json)")
    parser.add_argument("--work-dir", type=pathlib.Path, default=None,
                        help="run dirs, logs and the compilation cache (default: a temporary folder, removed after "
                             "a passing run)")
    parser.add_argument("--revision", default=None,
                        help="code revision recorded in the results (default: git rev-parse HEAD of the repo)")
    args = parser.parse_args(argv)
    mode_name = args.mode or "quick"
    mode = MODES[mode_name]
    timeout_s = args.timeout or mode.timeout_s
    out_dir = args.out_dir or REPO / "runs" / "benchmarks" / f"{NAME}_{mode_name}"
    json_path = args.json or out_dir / f"{NAME}.json"
    log = lambda msg: print(msg, flush=True)
    work = args.work_dir or pathlib.Path(tempfile.mkdtemp(prefix="eqx_diloco_elastic_"))
    for sub in ("reference", "reference_logs", "elastic", "elastic_logs"):
        shutil.rmtree(work / sub, ignore_errors=True)  # a leftover run dir would be resumed
    work.mkdir(parents=True, exist_ok=True)
    env = child_env(work / "jax_cache", keep_xla_flags=mode_name == "smoke")
    deadline = time.monotonic() + timeout_s
    started = time.time()
    command = " ".join(["python -m benchmarks.elastic", f"--{mode_name}"]
                       + (["--seed", str(args.seed)] if args.seed else []))
    log(f"{NAME} ({mode_name}): {mode.kills} kill(s) of 1 of {ISLANDS} islands over {mode.steps} steps, bound "
        f"{timeout_s:.0f} s; work dir {work}")
    attack = attacked_run(work, mode, env, deadline, random.Random(args.seed), log)
    failure, reference = attack["failure"], None
    if failure:
        log(f"FAILED: {failure}")
    elif mode.reference:
        try:
            reference = reference_run(work, mode.steps, env, deadline)
            log(f"uninterrupted run: eval loss {reference['final_eval_loss']:.4f} in {reference['wall_s']:.0f} s")
        except Failed as e:
            failure = str(e)
            log(f"FAILED: {failure}")
    summary = analyse(attack, reference, mode)
    if failure:
        summary["checks"]["no failure"] = False
        summary["passed"] = False
    result = {
        "benchmark": NAME,
        "mode": mode_name,
        "command": command,
        "revision": args.revision or common.revision(),
        "seed": args.seed,
        "settings": {"islands": ISLANDS, "steps": mode.steps, "kills": mode.kills, "sync_period": H,
                     "num_fragments": P, "overlap_steps": TAU, "checkpoint_every": CHECKPOINT_EVERY,
                     "rejoin_after_s": REJOIN_AFTER_S, "drain_s": DRAIN_S, "grace_s": GRACE_S,
                     "train_seed": TRAIN_SEED, "timeout_s": timeout_s,
                     "train_flags": train_flags(pathlib.Path("<run-dir>"), mode.steps)},
        "summary": summary,
        "passed": summary["passed"],
        "failure": failure,
        "kills": attack["kills"],
        "elastic": {k: v for k, v in attack.items() if k not in ("kills", "run_dir", "failure")},
        "reference": reference,
        "elapsed_s": time.time() - started,
        "machine": {"cpu_count": os.cpu_count(), "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
                    "platform": platform.platform(), "python": platform.python_version(), "jax": version("jax")},
    }
    written = [common.write_json(json_path, result), common.write_text(out_dir / f"{NAME}.md", render_markdown(result))]
    print()
    print(render_markdown(result))
    print(f"wrote {', '.join(map(str, written))}")
    if summary["passed"] and args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    else:
        log(f"work dir kept: {work}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
