"""TensorBoard event files beside metrics.jsonl, so `tensorboard --logdir runs` shows every run.

Written with tensorboardX (no TensorFlow or PyTorch needed). Every numeric scalar of a
metrics record becomes a scalar series under its key (`loss`, `eval_loss`, `sent_bytes`,
...) at the record's `step`; a list of numbers (`replica_losses`, `expert_balance`) becomes
one series per entry (`replica_losses/0`, `replica_losses/1`, ...). Booleans, strings and
None (e.g. `synced_fragment` at a step without a sync) are not scalars and are left out.
"""

from __future__ import annotations

import numbers
import time
from pathlib import Path
from typing import Any, Iterator


def scalars(record: dict[str, Any]) -> Iterator[tuple[str, float]]:
    """(tag, value) for every numeric scalar of `record` except `step`."""
    for key, value in record.items():
        if key == "step":
            continue
        if _is_number(value):
            yield key, float(value)
        elif isinstance(value, (list, tuple)) and value and all(_is_number(v) for v in value):
            for i, v in enumerate(value):
                yield f"{key}/{i}", float(v)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


class TensorBoardLog:
    """Writes metrics records as TensorBoard scalars into `run_dir` (beside metrics.jsonl).

    **Arguments:**

    - `run_dir`: the run folder (created if missing); event files are
      `<run_dir>/events.out.tfevents.*`.
    - `resume_step`: on resume, TensorBoard hides the events of steps after this one that an
      earlier, killed process wrote (as `MetricsLog` drops those lines), so the curves read
      like one uninterrupted run.
    - `enabled`: False on every process but process 0 (then nothing is written).
    - `flush_secs`: at most this many seconds between writes to disk while training.
    """

    def __init__(self, run_dir: Path | str, *, resume_step: int = 0, enabled: bool = True, flush_secs: int = 10):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self._writer = None
        if not enabled:
            return
        from tensorboardX import SummaryWriter

        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(
            logdir=str(self.run_dir),
            purge_step=resume_step + 1 if resume_step > 0 else None,
            flush_secs=flush_secs,
            # tensorboardX names files by the second: a resumed run started within the same second
            # would overwrite the first file. Nanoseconds keep the name unique and in write order.
            filename_suffix=f".{time.time_ns()}",
        )

    def write(self, record: dict[str, Any]) -> None:
        """Add every numeric scalar of `record` at `record["step"]` (non-finite values are kept:
        TensorBoard shows NaN/Inf as such)."""
        if self._writer is None:
            return
        step = int(record["step"])
        for tag, value in scalars(record):
            self._writer.add_scalar(tag, value, global_step=step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file (safe to call twice)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
