"""The trainer's reporting across processes (`eqx_diloco.lm._reporting.Reporter`): the per-step
values travel `--dist.metrics-lag` steps at a time, one exchange per batch, and every step is
still emitted, in order, no earlier than `lag` steps after it was published."""

import threading
import time
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

    def __init__(self, peer_seconds_per_step: float | None = None):
        self.batches: list[list[int]] = []  # the steps of each exchange
        self.sent_seconds: list[float] = []  # this process's seconds per step, per exchange
        self.peer = peer_seconds_per_step  # a second process's seconds per step, if any

    def read(self, arrays):
        return arrays

    def submit_many(self, batch, per_process=None):
        self.batches.append([int(arrays["step"][0]) for arrays in batch])
        futures = []
        for i, arrays in enumerate(batch):
            done: Future = Future()
            values = {k: np.asarray(v) for k, v in arrays.items()}
            if per_process and "seconds_per_step" in per_process and i == len(batch) - 1:
                mine = per_process["seconds_per_step"]
                self.sent_seconds.append(mine)
                values["seconds_per_step"] = np.array([mine] + ([self.peer] if self.peer is not None else []))
            done.set_result(values)
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


def reporter(lag: int, steps: int, gather, interval_s: float = 0.0) -> tuple[Reporter, Lines]:
    lines = Lines()
    config = Config(train=TrainConfig(steps=steps, log_every=1))
    report = Reporter(config, (lines,), Quiet(), gather, lag=lag, signals=StopSignals(),
                      checks=FiniteChecks("stop"), mesh=None, lr_schedule=optax.constant_schedule(0.1),
                      tokens_per_step=8, start_time=0.0, start_step=0, interval_s=interval_s)
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


@pytest.mark.parametrize("lag", [1, 3, 8])
def test_the_loop_writes_at_most_two_records_a_step_and_none_early(lag):
    """An exchange brings `lag` steps at once; the loop spreads writing them over the next steps
    (`most=2`) instead of writing them all in one, and every step is still emitted, in order."""
    steps, gather = 60, RecordingGather()
    report, lines = reporter(lag, steps, gather)
    emitted_when, per_step = {}, []
    for t in range(1, steps + 1):
        report.publish(pending(t))
        before = len(lines.records)
        report.flush(keep=lag, most=2)
        per_step.append(len(lines.records) - before)
        for record in lines.records[before:]:
            emitted_when[record["step"]] = t
    report.flush()
    assert max(per_step) <= 2 and sum(per_step) >= steps - 2 * lag  # the rest at the final flush
    assert [r["step"] for r in lines.records] == list(range(1, steps + 1))
    assert all(when - t >= lag for t, when in emitted_when.items())
    # A batch is drained at two a step: its last step is written within half a batch of the old bound.
    assert all(when - t <= 2 * lag - 1 + (lag + 1) // 2 for t, when in emitted_when.items())


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


@pytest.mark.parametrize(("peer", "expected_lag"), [(None, 25), (0.02, 13)])
def test_short_steps_travel_more_at_a_time_and_the_slowest_process_sets_how_many(monkeypatch, peer, expected_lag):
    """Steps of 10 ms with `interval_s` 0.25: after the first two exchanges of `lag` = 4 steps, exchanges carry
    25 steps (0.25 s of them); a second process at 20 ms per step makes it 13 (every process computes the
    same lag from the same gathered values, so all batch the same steps)."""
    from eqx_diloco.lm import _reporting

    clock = iter(np.arange(1000) * 0.01)
    # `time` is the module every thread shares: only this test's thread reads the fake clock (a thread
    # another test left running, e.g. a gRPC channel's, would otherwise take ticks from it).
    real, caller = time.perf_counter, threading.get_ident()
    monkeypatch.setattr(_reporting.time, "perf_counter",
                        lambda: float(next(clock)) if threading.get_ident() == caller else real())
    gather = RecordingGather(peer_seconds_per_step=peer)
    report, lines = reporter(4, 120, gather, interval_s=0.25)
    for t in range(1, 121):
        report.publish(pending(t))
        before = len(lines.records)
        report.flush(keep=report.current_lag, most=2)  # as the training loop does
        assert len(lines.records) - before <= 2
    report.flush()
    sizes = [len(b) for b in gather.batches]
    # The first exchange is read `lag` steps after it is sent, when the second is already on its way.
    assert sizes[:2] == [4, 4] and set(sizes[2:-1]) == {expected_lag} and sizes[-1] <= expected_lag
    np.testing.assert_allclose(gather.sent_seconds, 0.01)  # this process's own steps: 10 ms apart
    assert [r["step"] for r in lines.records] == list(range(1, 121))


def test_the_lag_never_drops_below_the_flag_nor_adapts_without_an_interval():
    report, _ = reporter(8, 10, RecordingGather(), interval_s=0.25)
    report._adapt_lag(np.array([1.0, 2.0]))  # long steps: the flag's lag stays
    assert report.current_lag == 8
    report._adapt_lag(np.array([1e-9]))  # absurdly short ones: capped
    assert report.current_lag == _reporting_max_lag()
    gather = RecordingGather()
    report, _ = reporter(3, 30, gather)  # interval 0: the flag's lag, no seconds sent
    for t in range(1, 31):
        report.publish(pending(t))
        report.flush(keep=report.current_lag)
    assert {len(b) for b in gather.batches} == {3} and gather.sent_seconds == []


def _reporting_max_lag() -> int:
    from eqx_diloco.lm import _reporting

    return _reporting.MAX_LAG


class SlowPeerGather(RecordingGather):
    """A second process whose clock runs `ahead_s` ahead of this one's at every exchange."""

    def __init__(self, ahead_s: float):
        super().__init__()
        self.ahead_s, self.sent_clocks = ahead_s, []

    def submit_many(self, batch, per_process=None):
        futures = super().submit_many(batch, per_process)
        mine = per_process["clock_s"]
        self.sent_clocks.append(mine)
        futures[-1].result()["clock_s"] = np.array([mine, mine + self.ahead_s])
        return futures


@pytest.mark.parametrize("lag", [0, 3])
def test_every_process_reads_the_same_clock_the_slowest_one(lag):
    """A schedule by time (checkpoints) decides from `clock_s`: the most any process measured, as of the
    newest emitted exchange, so every process decides on the same step."""
    gather = SlowPeerGather(ahead_s=100.0)
    report, _ = reporter(lag, 12, gather)
    for t in range(1, 13):
        report.publish(pending(t))
        report.flush(keep=lag)
        if gather.sent_clocks and not report._inflight:  # every exchange sent so far emitted
            assert report.clock_s == gather.sent_clocks[-1] + 100.0
    report.flush()
    assert report.clock_s == gather.sent_clocks[-1] + 100.0 > 100.0
