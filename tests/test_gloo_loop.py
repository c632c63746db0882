"""gloo's network thread is found by the call it waits in and put at idle priority."""

import os
import select
import threading

import pytest

from eqx_diloco.lm._gloo_loop import gloo_loop_threads, idle_gloo_loop

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task") or not hasattr(os, "SCHED_IDLE"),
                                reason="needs Linux's /proc and SCHED_IDLE")


class _Poller(threading.Thread):
    """A thread that waits in epoll_wait(fd, events, `max_events`, 10 ms) until stopped: gloo's loop's
    call for 64 events."""

    def __init__(self, max_events: int):
        super().__init__(daemon=True)
        self.max_events, self.stop, self.started_polling = max_events, threading.Event(), threading.Event()

    def run(self):
        self.tid = threading.get_native_id()
        with select.epoll() as ep:
            self.started_polling.set()
            while not self.stop.is_set():
                ep.poll(0.01, self.max_events)


@pytest.fixture
def pollers():
    started = []

    def start(max_events):
        poller = _Poller(max_events)
        poller.start()
        poller.started_polling.wait(5)
        started.append(poller)
        return poller

    yield start
    for poller in started:
        poller.stop.set()
        poller.join(5)


def test_the_thread_in_gloos_epoll_call_and_no_other_is_put_at_idle_priority(pollers):
    gloo_like, other = pollers(64), pollers(100)  # gRPC's threads wait for 100 events
    assert gloo_loop_threads() == {gloo_like.tid}
    assert idle_gloo_loop() == 1
    assert os.sched_getscheduler(gloo_like.tid) == os.SCHED_IDLE
    assert os.sched_getscheduler(other.tid) == os.SCHED_OTHER
    assert os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER


def test_a_process_without_gloos_thread_changes_nothing(pollers):
    pollers(100)
    assert gloo_loop_threads(looks=3) == set()
    assert idle_gloo_loop() == 0
