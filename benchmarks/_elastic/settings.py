"""What `python -m benchmarks.elastic` pins in every mode: islands, schedule, launcher
flags, the trainer's command line, and the environment of its processes."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sys
from collections.abc import Sequence

from benchmarks import _common as common

NAME = "elastic"
REPO = common.REPO

ISLANDS = 3
H, P, TAU = 6, 3, 1  # sync period, fragments, overlap steps
CHECKPOINT_EVERY = 5
REJOIN_AFTER_S, DRAIN_S, GRACE_S = 1.0, 3.0, 10.0
TRAIN_SEED = 0
# The CLI's default outer optimizer since 391fda0, pinned: its Nesterov buffer is outer state that
# every re-formed run must carry over.
OUTER = ["--diloco.outer-lr", "1.0", "--diloco.outer-momentum", "0.3", "--diloco.nesterov"]
LOSS_TOLERANCE = 0.02  # final eval loss within 2% of the uninterrupted run
KINDS = ("checkpoint", "sync", "any")
ORBAX_TMP = ".orbax-checkpoint-tmp"


@dataclasses.dataclass(frozen=True)
class Mode:
    kills: int
    steps: int
    timeout_s: float  # the whole benchmark
    reference: bool = True  # also run uninterrupted and compare the final eval losses


MODES = {
    "smoke": Mode(kills=1, steps=36, timeout_s=600.0, reference=False),
    "quick": Mode(kills=3, steps=120, timeout_s=1800.0),
    "full": Mode(kills=10, steps=240, timeout_s=3600.0),
}


def train_flags(run_dir: pathlib.Path, steps: int) -> list[str]:
    return ["--run-dir", str(run_dir), "--elastic.enabled", "--elastic.min-replicas", "2",
            "--model.num-layers", "2", "--model.dim", "32", "--model.num-heads", "2",
            "--train.seq-len", "32", "--train.batch-size", "4", "--data.source", "corpus",
            "--data.max-corpus-bytes", "1000000", "--train.eval-sequences", "16",
            "--diloco.sync-period", str(H), "--diloco.num-fragments", str(P), "--diloco.overlap-steps", str(TAU),
            "--train.steps", str(steps), "--train.eval-every", str(steps), "--train.log-every", "1",
            "--checkpoint.every", str(CHECKPOINT_EVERY), "--train.seed", str(TRAIN_SEED), *OUTER]


def launch_command(run_dir: pathlib.Path, log_dir: pathlib.Path, steps: int, max_restarts: int) -> list[str]:
    return [sys.executable, "-m", "eqx_diloco.launch", "--num-processes", str(ISLANDS),
            "--max-restarts", str(max_restarts), "--rejoin-after-s", f"{REJOIN_AFTER_S:g}",
            "--drain-s", f"{DRAIN_S:g}", "--grace-s", f"{GRACE_S:g}", "--log-dir", str(log_dir),
            "--", *train_flags(run_dir, steps)]


def display_command(cmd: Sequence[str], work: pathlib.Path) -> str:
    text = " ".join(["python", *cmd[1:]])
    return text.replace(str(work), "<work>")


def child_env(cache: pathlib.Path, keep_xla_flags: bool = False) -> dict[str, str]:
    """The islands' environment: this one's, without `XLA_FLAGS` (unless `keep_xla_flags`), with the
    compilation cache in `cache` unless one is set already."""
    env = {k: v for k, v in os.environ.items() if keep_xla_flags or k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(cache))  # a test session's cache is kept
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    env["PYTHONUNBUFFERED"] = "1"
    return env
