"""When the CLI checkpoints: every `--checkpoint.every` steps, or by time (`--checkpoint.every-minutes`,
by default on GPU and TPU), and what one checkpoint weighs."""

from typing import TYPE_CHECKING

import jax

from models._config import Platform

if TYPE_CHECKING:
    from .config import Config

# On an accelerator a step of a large model is short and a save writes the whole train state (R replicas'
# parameters and optimizer state, theta_g, the outer optimizer's): at 24 x 2048 with R = 2 about 43 GB,
# which every 100 steps on an H200 would have been every 30 s. A few minutes bounds the work a crash loses.
ACCELERATOR_MINUTES = 5.0


def checkpoint_minutes(config: "Config", platform: Platform) -> float:
    """Minutes between checkpoints on `platform` (0: by steps, `--checkpoint.every`, or none at all)."""
    ck = config.checkpoint
    if ck.every <= 0:
        return 0.0  # checkpointing is off
    if ck.every_minutes is not None:
        return float(ck.every_minutes)
    return 0.0 if platform == "cpu" else ACCELERATOR_MINUTES


def checkpoint_nbytes(state) -> int:
    """Bytes of one checkpoint of `state` (arrays or their abstract stand-ins): every array, whole."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))


def schedule_phrase(config: "Config", minutes: float) -> str:
    """How often the run saves, for the banner."""
    if config.checkpoint.every <= 0:
        return "off (--checkpoint.every 0)"
    if minutes <= 0:
        return f"every {config.checkpoint.every} steps"
    where = "" if config.checkpoint.every_minutes is not None else ", the GPU and TPU default"
    return f"every {minutes:g} minutes (--checkpoint.every-minutes{where})"
