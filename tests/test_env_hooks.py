"""The benchmark knobs that emulate islands of other speeds (`eqx_diloco/lm/_env_hooks.py`)."""


import pytest

from eqx_diloco.lm._env_hooks import SLOW_ISLANDS_ENV, STEP_PERIODS_ENV, IslandSpeed, island_speed


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv(SLOW_ISLANDS_ENV, raising=False)
    monkeypatch.delenv(STEP_PERIODS_ENV, raising=False)
    island_speed.cache_clear()
    yield
    island_speed.cache_clear()


def test_the_knobs_are_read_by_island(monkeypatch):
    monkeypatch.setenv(SLOW_ISLANDS_ENV, "3:0.05,1:0.01")
    monkeypatch.setenv(STEP_PERIODS_ENV, "0:0.1,1:0.1,3:0.2")
    three, one, two = island_speed((3,)), island_speed((1,)), island_speed((2,))
    assert (three.extra_s, three.period_s) == (0.05, 0.2)
    assert (one.extra_s, one.period_s) == (0.01, 0.1)
    assert (two.extra_s, two.period_s) == (0.0, 0.0)
    assert island_speed((3,)) is three  # one per process: the pace goes on from step to step


def test_a_bad_spec_names_the_variable(monkeypatch):
    monkeypatch.setenv(STEP_PERIODS_ENV, "island3=0.2")
    with pytest.raises(ValueError, match=r"\$EQX_DILOCO_STEP_PERIODS must be K:SECONDS"):
        island_speed((3,))


class _Clock:
    """Stands in for `time` in the module under test: sleeping moves the clock, nothing else does."""

    def __init__(self):
        self.now, self.slept = 0.0, []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    from eqx_diloco.lm import _env_hooks

    fake = _Clock()
    monkeypatch.setattr(_env_hooks, "time", fake)
    return fake


def test_a_period_paces_steps_from_end_to_end(clock):
    speed = IslandSpeed(period_s=0.1)
    ends = []
    for work_s in (0.0, 0.03, 0.0, 0.15, 0.0):  # what happens between two holds: a step, a sync
        clock.now += work_s
        speed.hold(1.0)
        ends.append(clock.now)
    gaps = [round(b - a, 9) for a, b in zip(ends, ends[1:])]
    # 30 ms of work fits inside the period (no more wait than the rest of it); 150 ms is not padded.
    assert gaps == [0.1, 0.1, 0.15, 0.1]


def test_no_knob_holds_nothing(clock):
    speed = IslandSpeed()
    for _ in range(3):
        speed.hold(1.0)
    assert clock.slept == []


def test_a_slow_island_sleeps_after_each_step(clock):
    speed = IslandSpeed(extra_s=0.02)
    for _ in range(3):
        clock.now += 0.05
        speed.hold(1.0)
    assert clock.slept == [0.02, 0.02, 0.02]
