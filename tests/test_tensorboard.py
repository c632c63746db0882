"""TensorBoard event files: written by TensorBoardLog, read back with TensorBoard's own reader."""

import errno
import math
import os
import re
import threading

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from eqx_diloco.lm._tensorboard import TensorBoardLog, scalars
from eqx_diloco.lm.metrics import LogWriteError


def read(run_dir) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return acc


def series(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def record(step, loss, sent):
    return {"step": step, "time": 0.5 * step, "loss": loss, "replica_losses": [loss - 0.1, loss + 0.1],
            "lr": 1e-3, "sent_bytes": sent, "synced_fragment": None, "applied_fragment": 1 if step % 2 else None,
            "note": "text", "flag": True}


def test_scalars_skip_step_none_bool_and_strings():
    got = dict(scalars(record(3, 2.0, 100)))
    assert got == {"time": 1.5, "loss": 2.0, "replica_losses/0": 1.9, "replica_losses/1": 2.1, "lr": 1e-3,
                   "sent_bytes": 100.0, "applied_fragment": 1.0}


def test_records_read_back(tmp_path):
    log = TensorBoardLog(tmp_path)
    for step in range(1, 6):
        log.write(record(step, 5.0 - step * 0.5, step * 1000))
    log.write({"step": 5, "eval_loss": 2.25})
    log.write({"step": 6, "loss": float("nan")})
    log.close()
    log.close()  # twice is fine
    assert list(tmp_path.glob("events.out.tfevents.*"))
    acc = read(tmp_path)
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "eval_loss", "sent_bytes", "replica_losses/0", "replica_losses/1", "lr", "time",
            "applied_fragment"} <= tags
    assert not {"step", "synced_fragment", "note", "flag"} & tags
    loss = series(acc, "loss")
    assert [s for s, _ in loss] == [1, 2, 3, 4, 5, 6]
    assert [v for _, v in loss[:5]] == pytest.approx([4.5, 4.0, 3.5, 3.0, 2.5])
    assert math.isnan(loss[5][1])
    assert series(acc, "eval_loss") == [(5, pytest.approx(2.25))]
    assert series(acc, "sent_bytes") == [(s, pytest.approx(s * 1000)) for s in range(1, 6)]
    assert [s for s, _ in series(acc, "applied_fragment")] == [1, 3, 5]


def test_resume_hides_steps_after_the_checkpoint(tmp_path):
    first = TensorBoardLog(tmp_path)
    for step in range(1, 7):  # a run killed after step 6, last checkpoint at step 4
        first.write({"step": step, "loss": 10.0 + step})
    first.close()
    resumed = TensorBoardLog(tmp_path, resume_step=4)
    for step in range(5, 9):
        resumed.write({"step": step, "loss": 20.0 + step})
    resumed.close()
    got = series(read(tmp_path), "loss")
    assert [s for s, _ in got] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [v for _, v in got] == pytest.approx([11, 12, 13, 14, 25, 26, 27, 28])


def test_disabled_writes_nothing(tmp_path):
    log = TensorBoardLog(tmp_path / "run", enabled=False)
    log.write({"step": 1, "loss": 1.0})
    log.close()
    assert not (tmp_path / "run").exists()


class _FullDisk:
    """An event file that fails as a full disk does."""

    def __init__(self, file):
        self.file = file

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def flush(self):
        self.file.flush()

    def close(self):
        self.file.close()


def test_a_failed_write_raises_once_naming_the_file_and_later_records_are_dropped(tmp_path):
    """Written in the caller's thread: the failure reaches the trainer as one `LogWriteError` (tensorboardX's
    writer thread died with a traceback instead, and its full queue then blocked the next writes)."""
    threads = threading.active_count()
    log = TensorBoardLog(tmp_path)
    log.write({"step": 1, "loss": 1.0})
    assert threading.active_count() == threads  # no writer thread of its own
    log._file = _FullDisk(log._file)
    full = rf"^writing {re.escape(str(log.path))} failed \(No space left on device\)$"
    with pytest.raises(LogWriteError, match=full):
        log.write({"step": 2, "loss": 2.0})
    log.write({"step": 3, "loss": 3.0})  # the run is stopping: dropped, no second error
    log.close()
    log.close()
    assert series(read(tmp_path), "loss") == [(1, 1.0)]
