"""TensorBoard event files beside metrics.jsonl, so `tensorboard --logdir runs` shows every run.

Written with tensorboardX's event protocol buffers (no TensorFlow or PyTorch needed). Every
numeric scalar of a metrics record becomes a scalar series under its key (`loss`, `eval_loss`,
`sent_bytes`, ...) at the record's `step`; a list of numbers (`replica_losses`,
`expert_balance`) becomes one series per entry (`replica_losses/0`, `replica_losses/1`, ...).
Booleans, strings and None (e.g. `synced_fragment` at a step without a sync) are not scalars and
are left out.
"""

from __future__ import annotations

import numbers
import socket
import struct
import time
from pathlib import Path
from typing import Any, Iterator

from .metrics import LogWriteError


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

    - `run_dir`: the run folder (created if missing); the event file is
      `<run_dir>/events.out.tfevents.*`.
    - `resume_step`: on resume, TensorBoard hides the events of steps after this one that an
      earlier, killed process wrote (as `MetricsLog` drops those lines), so the curves read
      like one uninterrupted run.
    - `enabled`: False on every process but process 0 (then nothing is written).

    Each record is one event, written and flushed in the caller's thread like a metrics.jsonl
    line (tensorboardX's `SummaryWriter` writes from a thread of its own: a full or read-only
    disk killed that thread with a traceback, and its bounded queue then blocked training).
    A failed write raises `LogWriteError` naming the event file, once; later records are dropped.
    """

    def __init__(self, run_dir: Path | str, *, resume_step: int = 0, enabled: bool = True):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self._file = None
        if not enabled:
            return
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        self.run_dir.mkdir(parents=True, exist_ok=True)
        # tensorboardX's name (by the second), then nanoseconds: a resumed run started within the same
        # second would otherwise overwrite the first file, and the names sort in write order.
        self.path = self.run_dir / f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{time.time_ns()}"
        try:
            self._file = self.path.open("wb")
        except OSError as e:
            raise LogWriteError(self.path, e) from None
        self._event(Event(wall_time=time.time(), file_version="brain.Event:2"))
        if resume_step > 0:  # a session start at resume_step + 1 hides the earlier events from that step on
            self._event(Event(wall_time=time.time(), step=resume_step + 1,
                              session_log=SessionLog(status=SessionLog.START)))

    def write(self, record: dict[str, Any]) -> None:
        """Add every numeric scalar of `record` at `record["step"]` (non-finite values are kept:
        TensorBoard shows NaN/Inf as such)."""
        if self._file is None:
            return
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=tag, simple_value=value) for tag, value in scalars(record)]
        if values:
            self._event(Event(wall_time=time.time(), step=int(record["step"]), summary=Summary(value=values)))

    def _event(self, event) -> None:
        """Append one event as a TFRecord (length, its CRC, the bytes, their CRC) and flush it."""
        from tensorboardX.record_writer import masked_crc32c

        data = event.SerializeToString()
        header = struct.pack("Q", len(data))
        try:
            self._file.write(header + struct.pack("I", masked_crc32c(header)) + data +
                             struct.pack("I", masked_crc32c(data)))
            self._file.flush()
        except OSError as e:
            self._abandon()
            raise LogWriteError(self.path, e) from None

    def _abandon(self) -> None:
        """Close the file after a failed write, ignoring the failure of writing out what it still buffers."""
        file, self._file = self._file, None
        try:
            file.close()
        except OSError:
            pass

    def flush(self) -> None:
        """Nothing to do: every event is flushed as it is written (kept for callers)."""

    def close(self) -> None:
        """Close the event file (safe to call twice, and after a failed write)."""
        if self._file is not None:
            file, self._file = self._file, None
            try:
                file.close()
            except OSError as e:
                raise LogWriteError(self.path, e) from None
