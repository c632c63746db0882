"""The per-step exchange of replica values between processes (`eqx_diloco._replica_values`),
with a stand-in for the coordinator's key-value store: a slow peer holds up the future a
gather returns, never the caller, and the exchanges keep their call order."""

import pickle
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_diloco import _replica_values as replica_values
from eqx_diloco._replica_values import ReplicaGather


class SlowPeerStore:
    """The key-value client of process 0 of 2; process 1 publishes a call only when released."""

    def __init__(self):
        self.store: dict[str, bytes] = {}
        self.released: dict[int, threading.Event] = {}
        self.deleted: list[str] = []
        self.lock = threading.Lock()

    def release(self, call: int, rows: dict[str, dict[int, np.ndarray]]) -> None:
        with self.lock:
            self.store[f"eqx_diloco/replica_values/{call}/1"] = pickle.dumps(rows)
            self.released.setdefault(call, threading.Event()).set()

    def key_value_set_bytes(self, key: str, value: bytes) -> None:
        with self.lock:
            self.store[key] = value

    def blocking_key_value_get_bytes(self, key: str, timeout_ms: int) -> bytes:
        call = int(key.split("/")[-2])
        with self.lock:
            event = self.released.setdefault(call, threading.Event())
        if not event.wait(timeout_ms / 1000):
            raise TimeoutError(key)
        with self.lock:
            return self.store[key]

    def key_value_delete(self, key: str) -> None:
        with self.lock:
            self.deleted.append(key)
            self.store.pop(key, None)


@pytest.fixture
def two_processes(monkeypatch):
    store = SlowPeerStore()
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    monkeypatch.setattr(replica_values, "_kv_client", lambda: store)
    return store


def test_a_slow_peer_holds_up_the_future_not_the_caller(two_processes):
    gather = ReplicaGather(timeout_s=30)
    # This process holds replica row 0 of 2 (a one-device array stands for its shard).
    first = gather.submit({"loss": jnp.array([1.5], jnp.float32)})
    second = gather.submit({"loss": jnp.array([2.5], jnp.float32)})
    assert not first.done() and not second.done()  # the peer has published nothing yet
    two_processes.release(1, {"loss": {1: np.float32(4.0)}})  # out of order: call 1 before call 0
    assert not first.done()
    two_processes.release(0, {"loss": {1: np.float32(3.0)}})
    np.testing.assert_array_equal(first.result(timeout=10)["loss"], [1.5, 3.0])
    np.testing.assert_array_equal(second.result(timeout=10)["loss"], [2.5, 4.0])
    # After call 1 everyone has read call 0: only then is this process's call-0 key removed.
    assert two_processes.deleted == ["eqx_diloco/replica_values/0/0"]


def test_a_failed_exchange_reaches_the_reader(two_processes):
    gather = ReplicaGather(timeout_s=0)  # the peer never answers: the get times out at once
    future = gather.submit({"loss": jnp.array([1.0], jnp.float32)})
    with pytest.raises(TimeoutError, match="replica_values/0/1"):
        future.result(timeout=10)


def test_a_single_process_gathers_at_once():
    gather = ReplicaGather()
    future = gather.submit({"loss": jnp.array([1.0, 2.0], jnp.float32)})
    assert future.done()
    np.testing.assert_array_equal(future.result()["loss"], [1.0, 2.0])
    np.testing.assert_array_equal(gather({"x": jnp.arange(3)})["x"], [0, 1, 2])
