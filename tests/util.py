import json
from pathlib import Path

import pytest

from eqx_diloco import Checkpointer


def slow_except(cases, fast):
    """`cases` for `pytest.mark.parametrize`, every one not in `fast` marked slow: the fast tier
    keeps a representative few of a family whose cases differ only in sizes or formats; the
    full suite runs them all (same ids either way)."""
    return [case if case in fast else pytest.param(*(case if isinstance(case, tuple) else (case,)),
                                                   marks=pytest.mark.slow) for case in cases]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


def resume_through_a_checkpoint(first, state, make, model, directory: Path, *, keep: int = 2, **save_kwargs):
    """Save `first`'s `state` with Orbax and restore it into a fresh `make()` object, as a new
    process would. `model` is the model the objects were bound with; `save_kwargs` go to `save`.

    **Returns:** `(second, restored_state)`.
    """
    checkpointer = Checkpointer(directory, every=1, keep=keep)
    first.save(checkpointer, state, **save_kwargs)
    checkpointer.wait()
    second = make()
    return second, second.restore(Checkpointer(directory, every=1, keep=keep), model)
