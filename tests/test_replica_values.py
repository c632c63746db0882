"""The per-step exchange of replica values between processes (`eqx_diloco._replica_values`),
with a stand-in for the coordinator's key-value store: a slow peer holds up the future a
gather returns, never the caller, and the exchanges keep their call order; what a peer
publishes is decoded as `_wire` bytes, never unpickled, and checked before it is used."""

import os
import pickle
import shlex
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_diloco import _replica_values as replica_values
from eqx_diloco._replica_values import ReplicaGather, _rows_payload
from eqx_diloco._wire import WireFormatError, decode, encode


class SlowPeerStore:
    """The key-value client of process 0 of 2; process 1 publishes a call only when released."""

    def __init__(self):
        self.store: dict[str, bytes] = {}
        self.released: dict[int, threading.Event] = {}
        self.deleted: list[str] = []
        self.lock = threading.Lock()

    def release(self, call: int, rows: dict[str, dict[int, np.ndarray]]) -> None:
        """Process 1 publishes `rows` (per name, row index -> row) for `call`, as the real one would."""
        self.release_bytes(call, encode(_rows_payload(rows)))

    def release_bytes(self, call: int, value: bytes) -> None:
        """Process 1 publishes any bytes for `call` (what someone who can reach the coordinator could do)."""
        with self.lock:
            self.store[f"eqx_diloco/replica_values/{call}/1"] = value
            self.released.setdefault(call, threading.Event()).set()

    def key_value_set_bytes(self, key: str, value: bytes) -> None:
        assert isinstance(key, str) and isinstance(value, bytes)  # the runtime's client takes exactly these
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
    # This process holds replica row 0 of 2 (of a one-process array, row 1 stands for the peer's shard).
    monkeypatch.setattr(replica_values, "_local_rows", lambda x: {0: np.asarray(x)[0]})
    return store


def test_a_slow_peer_holds_up_the_future_not_the_caller(two_processes):
    gather = ReplicaGather(timeout_s=30)
    first = gather.submit({"loss": jnp.array([1.5, 0.0], jnp.float32)})
    second = gather.submit({"loss": jnp.array([2.5, 0.0], jnp.float32)})
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
    future = gather.submit({"loss": jnp.array([1.0, 0.0], jnp.float32)})
    with pytest.raises(TimeoutError, match="replica_values/0/1"):
        future.result(timeout=10)


def test_a_single_process_gathers_at_once():
    gather = ReplicaGather()
    future = gather.submit({"loss": jnp.array([1.0, 2.0], jnp.float32)})
    assert future.done()
    np.testing.assert_array_equal(future.result()["loss"], [1.0, 2.0])
    np.testing.assert_array_equal(gather({"x": jnp.arange(3)})["x"], [0, 1, 2])


def test_what_this_process_publishes_decodes_to_its_rows(two_processes):
    gather = ReplicaGather(timeout_s=30)
    future = gather.submit({"loss": jnp.array([1.5, 0.0], jnp.float32), "finite": jnp.array([True, False])})
    two_processes.release(0, {"loss": {1: np.float32(3.0)}, "finite": {1: np.bool_(True)}})
    out = future.result(timeout=10)
    np.testing.assert_array_equal(out["loss"], [1.5, 3.0])
    assert out["finite"].dtype == np.bool_ and out["finite"].tolist() == [True, True]
    mine = decode(two_processes.store["eqx_diloco/replica_values/0/0"], source="test")
    assert mine["loss"]["index"] == [0] and mine["loss"]["rows"][0].shape == () and mine["loss"]["rows"][0] == 1.5
    assert mine["finite"]["rows"][0].dtype == np.bool_


class RunsCode:
    """Unpickling this runs a shell command that creates `marker` (what an attacker's payload would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def test_a_pickle_from_the_coordinator_is_refused_not_run(two_processes, tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(RunsCode(marker))
    pickle.loads(payload)  # the payload is live: unpickled, it does run
    assert marker.exists()
    marker.unlink()
    future = ReplicaGather(timeout_s=30).submit({"loss": jnp.array([1.0, 0.0], jnp.float32)})
    two_processes.release_bytes(0, payload)
    with pytest.raises(WireFormatError, match=r"^the replica values of process 1 \(coordinator key "
                                              r"eqx_diloco/replica_values/0/1\) is not a valid eqx_diloco payload"):
        future.result(timeout=10)
    assert not marker.exists()


@pytest.mark.parametrize("rows, message", [
    ({"loss": {1: np.float64(3.0)}}, "'loss': a row of float64[], this process's are"),
    ({"loss": {1: np.zeros(2, np.float32)}}, "'loss': a row of float32[2]"),
    ({"other": {1: np.float32(3.0)}}, "values ['other'], expected ['loss']"),
])
def test_well_encoded_rows_of_another_shape_are_refused(two_processes, rows, message):
    future = ReplicaGather(timeout_s=30).submit({"loss": jnp.array([1.0, 0.0], jnp.float32)})
    two_processes.release(0, rows)
    with pytest.raises(WireFormatError, match=r"^the replica values of process 1 .* are malformed") as error:
        future.result(timeout=10)
    assert message in str(error.value)


@pytest.mark.parametrize("payload, message", [
    ([1, 2], "values list, expected ['loss']"),
    ({"loss": {"index": [1, 2], "rows": [np.float32(1)]}}, "index is not a list of row numbers as long as rows"),
    ({"loss": {"index": [True], "rows": [np.float32(1)]}}, "index is not a list of row numbers"),
    ({"loss": {"index": [1], "rows": ["3.0"]}}, "a row of str"),
    ({"loss": {"index": [1]}}, "exactly the keys index and rows"),
])
def test_rows_in_another_layout_are_refused(two_processes, payload, message):
    future = ReplicaGather(timeout_s=30).submit({"loss": jnp.array([1.0, 0.0], jnp.float32)})
    two_processes.release_bytes(0, encode(payload))
    with pytest.raises(WireFormatError) as error:
        future.result(timeout=10)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_missing_row_is_an_error_not_a_shorter_array(two_processes):
    future = ReplicaGather(timeout_s=30).submit({"loss": jnp.array([1.0, 0.0], jnp.float32)})
    two_processes.release(0, {"loss": {}})  # the peer publishes no row: row 1 would be missing
    with pytest.raises(RuntimeError, match=r"gathering 'loss': the processes hold rows \[0\], not 0..1"):
        future.result(timeout=10)


def test_a_batch_travels_in_one_exchange_and_each_dict_gets_its_own_values(two_processes):
    gather = ReplicaGather(timeout_s=30)
    futures = gather.submit_many([{"loss": jnp.array([1.5, 0.0], jnp.float32)},
                                  {"loss": jnp.array([2.5, 0.0], jnp.float32), "finite": jnp.array([True, False])}])
    two_processes.release(0, {"0/loss": {1: np.float32(3.0)}, "1/loss": {1: np.float32(4.0)},
                              "1/finite": {1: np.bool_(False)}})
    first, second = (f.result(timeout=10) for f in futures)
    # One key for the whole batch: one set and one get per peer, not one per dict.
    assert sorted(two_processes.store) == ["eqx_diloco/replica_values/0/0", "eqx_diloco/replica_values/0/1"]
    assert set(first) == {"loss"} and set(second) == {"loss", "finite"}
    np.testing.assert_array_equal(first["loss"], [1.5, 3.0])
    np.testing.assert_array_equal(second["loss"], [2.5, 4.0])
    assert second["finite"].tolist() == [True, False]
    assert gather.submit_many([]) == []


def test_per_process_values_travel_with_the_last_dict_of_a_batch(two_processes):
    gather = ReplicaGather(timeout_s=30)
    futures = gather.submit_many([{"loss": jnp.array([1.5, 0.0], jnp.float32)}] * 2,
                                 per_process={"seconds_per_step": 0.25})
    two_processes.release(0, {"0/loss": {1: np.float32(3.0)}, "1/loss": {1: np.float32(4.0)},
                              "seconds_per_step": {1: np.float64(0.5)}})  # process 1's own number
    first, second = (f.result(timeout=10) for f in futures)
    assert set(first) == {"loss"}
    assert second["seconds_per_step"].tolist() == [0.25, 0.5] and second["seconds_per_step"].dtype == np.float64
    with pytest.raises(ValueError, match=r"per-process names \['loss'\] are also array names"):
        gather.submit({"loss": jnp.array([1.0, 0.0], jnp.float32)}, per_process={"loss": 1.0})


def test_rows_read_step_by_step_gather_as_the_arrays_would(two_processes):
    gather = ReplicaGather(timeout_s=30)
    read = gather.read({"loss": jnp.array([1.5, 0.0], jnp.float32)})
    assert isinstance(read["loss"], replica_values.LocalRows) and read["loss"].num_rows == 2
    assert gather.read(read) == read  # reading what was read changes nothing
    future = gather.submit(read)
    two_processes.release(0, {"loss": {1: np.float32(3.0)}})
    np.testing.assert_array_equal(future.result(timeout=10)["loss"], [1.5, 3.0])
    assert read["loss"].rows.keys() == {0}  # the exchange filled a copy, not what was read


def test_rows_read_step_by_step_travel_as_one_array_per_name(two_processes):
    gather = ReplicaGather(timeout_s=30)
    steps = [gather.read({"loss": jnp.array([1.5 + t, 0.0], jnp.float32)}) for t in range(3)]
    steps.append(gather.read({"loss": jnp.array([9.0, 0.0], jnp.float32), "finite": jnp.array([True, False])}))
    futures = gather.submit_many(steps)
    # The peer's rows, packed as this process packs its own: the three steps with only a loss, stacked, then
    # the step that also has a finite flag.
    two_processes.release(0, {"0/loss": {1: np.array([3.0, 4.0, 5.0], np.float32)},
                              "1/loss": {1: np.array([6.0], np.float32)}, "1/finite": {1: np.array([True])}})
    got = [f.result(timeout=10) for f in futures]
    assert [g["loss"].tolist() for g in got] == [[1.5, 3.0], [2.5, 4.0], [3.5, 5.0], [9.0, 6.0]]
    assert set(got[0]) == {"loss"} and got[3]["finite"].tolist() == [True, True]
    payload = decode(two_processes.store["eqx_diloco/replica_values/0/0"], source="this process")
    assert sorted(payload) == ["0/loss", "1/finite", "1/loss"]  # one array per name and kind of step


def test_a_peer_without_its_per_process_value_is_refused(two_processes):
    future = ReplicaGather(timeout_s=30).submit({"loss": jnp.array([1.0, 0.0], jnp.float32)},
                                                per_process={"seconds_per_step": 0.1})
    two_processes.release(0, {"loss": {1: np.float32(3.0)}})  # a peer that sent no seconds_per_step
    with pytest.raises(WireFormatError, match="malformed"):
        future.result(timeout=10)


def test_a_failed_batch_fails_every_dict_of_it(two_processes):
    futures = ReplicaGather(timeout_s=0).submit_many([{"loss": jnp.array([1.0, 0.0], jnp.float32)}] * 3)
    for future in futures:
        with pytest.raises(TimeoutError, match="replica_values/0/1"):
            future.result(timeout=10)
