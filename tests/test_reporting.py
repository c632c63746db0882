"""The trainer's reporting across processes (`eqx_diloco.lm._reporting.Reporter`): the per-step
values travel `--dist.metrics-lag` steps at a time, one exchange per batch, and every step is
still emitted, in order, no earlier than `lag` steps after it was published."""

from concurrent.futures import Future

import numpy as np
import optax
import pytest

from eqx_diloco.lm._finite import FiniteChecks
from eqx_diloco.lm._reporting import Reporter
from eqx_diloco.lm._signals import StopSignals
from eqx_diloco.lm.config import Config, TrainConfig


class RecordingGather:
    """Stands in for `ReplicaGather`: records each batch and answers it at once with the values."""

    def __init__(self):
        self.batches: list[list[int]] = []  # the steps of each exchange

    def submit_many(self, batch):
        self.batches.append([int(arrays["step"][0]) for arrays in batch])
        futures = []
        for arrays in batch:
            done: Future = Future()
            done.set_result({k: np.asarray(v) for k, v in arrays.items()})
            futures.append(done)
        return futures


class Lines:
    def __init__(self):
        self.records = []

    def write(self, record):
        self.records.append(record)


class Quiet:
    interactive = False

    def log(self, line):
        pass

    def update(self, step, status):
        pass


def reporter(lag: int, steps: int, gather) -> tuple[Reporter, Lines]:
    lines = Lines()
    config = Config(train=TrainConfig(steps=steps, log_every=1))
    report = Reporter(config, (lines,), Quiet(), gather, lag=lag, signals=StopSignals(),
                      checks=FiniteChecks("stop"), mesh=None, lr_schedule=optax.constant_schedule(0.1),
                      tokens_per_step=8, start_time=0.0, start_step=0)
    return report, lines


def pending(t: int) -> dict:
    metrics = {"loss": np.full((2,), float(t), np.float32), "grad_norm": np.ones((2,), np.float32),
               "finite": np.ones((2,), bool), "step": np.full((2,), t, np.int32)}
    return {"step": t, "metrics": metrics, "finite": None, "synced": None, "applied": None, "sent": 0, "wire": 0,
            "peak": 0, "router_drift": None, "global_finite": None}


@pytest.mark.parametrize("lag", [0, 1, 3, 8])
def test_steps_travel_lag_at_a_time_and_are_emitted_in_order_lag_steps_late(lag):
    steps, gather = 20, RecordingGather()
    report, lines = reporter(lag, steps, gather)
    emitted_when = {}
    for t in range(1, steps + 1):  # as the training loop does: publish step t, then flush down to the lag
        report.publish(pending(t))
        before = len(lines.records)
        report.flush(keep=lag)
        for record in lines.records[before:]:
            emitted_when[record["step"]] = t
    report.flush()
    chunk = max(1, lag)
    assert gather.batches == [list(range(s, min(s + chunk, steps + 1))) for s in range(1, steps + 1, chunk)]
    assert [r["step"] for r in lines.records] == list(range(1, steps + 1))
    assert [r["loss"] for r in lines.records] == [float(t) for t in range(1, steps + 1)]
    assert all(when - t >= lag for t, when in emitted_when.items())
    assert all(when - t <= 2 * chunk - 1 for t, when in emitted_when.items())


def test_a_full_flush_sends_what_is_left_at_once():
    gather = RecordingGather()
    report, lines = reporter(8, 100, gather)
    for t in (1, 2, 3):
        report.publish(pending(t))
        report.flush(keep=8)
    assert gather.batches == [] and lines.records == []
    report.flush()  # before an evaluation or a checkpoint: everything, now
    assert gather.batches == [[1, 2, 3]] and [r["step"] for r in lines.records] == [1, 2, 3]


def test_each_record_has_the_schedules_learning_rate_across_blocks(monkeypatch):
    from eqx_diloco.lm import _reporting

    monkeypatch.setattr(_reporting, "LR_BLOCK", 4)  # several blocks in a short run
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, warmup_steps=5, decay_steps=20, end_value=1e-4)
    lines = Lines()
    report = Reporter(Config(train=TrainConfig(steps=20, log_every=1)), (lines,), Quiet(), RecordingGather(), lag=0,
                      signals=StopSignals(), checks=FiniteChecks("stop"), mesh=None, lr_schedule=schedule,
                      tokens_per_step=8, start_time=0.0, start_step=3)  # a resumed run: its first block is not 0
    for t in range(4, 21):
        report.publish(pending(t))
        report.flush()
    assert [r["step"] for r in lines.records] == list(range(4, 21))
    np.testing.assert_allclose([r["lr"] for r in lines.records], [float(schedule(t - 1)) for t in range(4, 21)],
                               rtol=1e-6)
