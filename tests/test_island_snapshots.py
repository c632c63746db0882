"""Island snapshots through the public core (one process, one island): a run re-formed from the
snapshot of a sync boundary continues exactly like the run that wrote it; snapshots of another
shape are refused with one line; a write is atomic and old snapshots are pruned; a snapshot
file is `_wire` bytes, and anything else in its place (a pickle above all) is refused, not run."""

import os
import pickle
import shlex

import jax
import ml_dtypes
import numpy as np
import optax
import pytest

from custom_model import StackedMLP, loss_fn, make_batch
from eqx_diloco import ConfigError, DiLoCo, IslandSnapshots
from eqx_diloco._wire import MAGIC, WireFormatError, encode


def _core(**overrides) -> DiLoCo:
    kwargs = dict(loss_fn=loss_fn, layers=lambda m: m.blocks, num_replicas=1, sync_period=6, num_fragments=3,
                  overlap_steps=1, alpha=0.5, quantize="int4", error_feedback=True,
                  inner_optimizer=optax.adam(1e-2), outer_optimizer=optax.sgd(0.7, momentum=0.9, nesterov=True))
    return DiLoCo(**{**kwargs, **overrides})


def _leaves(state) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(state)]


@pytest.mark.slow
def test_reformed_run_continues_exactly_like_the_run_that_wrote_the_snapshot(tmp_path):
    snapshots = IslandSnapshots(tmp_path / "island-0", keep=100)
    diloco = _core()
    model = StackedMLP(key=jax.random.key(0))
    state = diloco.init(model)
    boundaries = []
    for step in range(13):
        state, metrics = diloco.step(state, make_batch(step, 1))
        if (metrics["synced_fragment"] is not None or metrics["applied_fragment"] is not None) and diloco.settled:
            snapshots.write(diloco.island_snapshot(state, island=0))
            boundaries.append(step + 1)
    snapshots.wait()
    assert snapshots.steps() == boundaries and boundaries  # merges (tau = 1) leave nothing in flight
    S = boundaries[-1]

    # The original run, from S on, against a fresh core re-formed from the snapshot of S.
    original = _core()
    state = original.init(model)
    for step in range(S):
        state, _ = original.step(state, make_batch(step, 1))
    reformed_core = _core()
    reformed_core.abstract(model)
    reformed = reformed_core.reform(snapshots, island=0, key=jax.random.key(9))
    assert int(reformed.step) == S
    for a, b in zip(_leaves(state), _leaves(reformed)):
        np.testing.assert_array_equal(a, b)
    for step in range(S, S + 6):
        state, _ = original.step(state, make_batch(step, 1))
        reformed, _ = reformed_core.step(reformed, make_batch(step, 1))
    for a, b in zip(_leaves(original.global_params(state)), _leaves(reformed_core.global_params(reformed))):
        np.testing.assert_array_equal(a, b)


def test_snapshot_needs_a_sync_boundary_and_reform_needs_snapshots(tmp_path):
    diloco = _core(num_fragments=1, overlap_steps=0, alpha=0.0, quantize="none", error_feedback=False)
    model = StackedMLP(key=jax.random.key(0))
    assert diloco.abstract(model) is not None
    assert diloco.reform(IslandSnapshots(tmp_path / "none"), island=0, key=jax.random.key(0)) is None
    streaming = _core()
    state = streaming.init(model)
    for step in range(12):  # until a sync is in flight (tau = 1: launched at one step, merged at the next)
        state, metrics = streaming.step(state, make_batch(step, 1))
        if not streaming.settled:
            break
    assert not streaming.settled
    with pytest.raises(ValueError, match="sync boundary"):
        streaming.island_snapshot(state, island=0)


def test_snapshots_of_another_shape_are_refused(tmp_path):
    snapshots = IslandSnapshots(tmp_path / "island-0")
    diloco = _core(num_fragments=1, overlap_steps=0, alpha=0.0, quantize="none", error_feedback=False, sync_period=2)
    model = StackedMLP(key=jax.random.key(0))
    state = diloco.init(model)
    for step in range(2):
        state, _ = diloco.step(state, make_batch(step, 1))
    snapshots.write(diloco.island_snapshot(state, island=0), wait=True)
    other = _core(num_fragments=1, overlap_steps=0, alpha=0.0, quantize="int8", error_feedback=True, sync_period=2)
    other.abstract(model)
    with pytest.raises(ConfigError, match="written by a run of another shape"):
        other.reform(snapshots, island=0, key=jax.random.key(0))


def test_writes_are_atomic_and_old_snapshots_pruned(tmp_path):
    snapshots = IslandSnapshots(tmp_path / "island-3", keep=2)
    for step in (4, 8, 12):
        snapshots.write({"step": step, "island": 3, "shared": {}, "own": {}})
    snapshots.wait()
    assert snapshots.steps() == [8, 12] and snapshots.load(12)["step"] == 12
    (tmp_path / "island-3" / "16.snapshot.tmp").write_bytes(b"torn")  # a write a kill interrupted
    assert snapshots.newest() == 12
    snapshots.write({"step": 20, "island": 3, "shared": {}, "own": {}}, wait=True)  # the next write clears it
    assert sorted(p.name for p in (tmp_path / "island-3").iterdir()) == ["12.snapshot", "20.snapshot"]


def test_a_snapshot_round_trips_every_kind_of_leaf(tmp_path):
    snapshots = IslandSnapshots(tmp_path / "island-1")
    payload = {"step": 6, "island": 1,
               "shared": {"global_params": [np.arange(6, dtype=np.float32).reshape(2, 3),
                                            np.arange(4, dtype=np.float32).astype(ml_dtypes.bfloat16)],
                          "outer_states": [np.asarray(3, np.int32), np.zeros((0, 4), np.float32)],
                          "mail_mean": []},
               "own": {"params": [np.ones(3, np.float16)], "opt_state": [np.asarray(6, np.int32)],
                       "keys": [np.array([7, 2**32 - 1], np.uint32)], "residuals": []}}
    snapshots.write(payload, wait=True)
    assert (tmp_path / "island-1" / "6.snapshot").read_bytes().startswith(MAGIC)
    loaded = snapshots.load(6)
    assert loaded.keys() == payload.keys() and (loaded["step"], loaded["island"]) == (6, 1)
    for part in ("shared", "own"):
        assert loaded[part].keys() == payload[part].keys()
        for name in payload[part]:
            for a, b in zip(payload[part][name], loaded[part][name], strict=True):
                assert (a.dtype, a.shape) == (b.dtype, b.shape)
                np.testing.assert_array_equal(a, b)
    loaded["own"]["params"][0][0] = 5.0  # writable host arrays, as pickle gave
    with pytest.raises(TypeError, match="dtype object"):  # refused before anything is written
        snapshots.write({**payload, "step": 8, "own": {"params": [np.array([None])]}})
    assert snapshots.steps() == [6]


class RunsCode:
    """Unpickling this runs a shell command that creates `marker` (what an attacker's payload would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def test_a_pickle_in_the_run_folder_is_refused_not_run(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(RunsCode(marker))
    pickle.loads(payload)  # the payload is live: unpickled, it does run
    assert marker.exists()
    marker.unlink()
    folder = tmp_path / "island-0"
    folder.mkdir()
    (folder / "4.snapshot").write_bytes(payload)
    snapshots = IslandSnapshots(folder)
    with pytest.raises(WireFormatError, match=f"^the island snapshot {folder / '4.snapshot'} is not a valid"):
        snapshots.load(4)
    # Through the core: re-forming from the folder's newest snapshot refuses it, with one line.
    diloco = _core(num_fragments=1, overlap_steps=0, alpha=0.0, quantize="none", error_feedback=False)
    diloco.abstract(StackedMLP(key=jax.random.key(0)))
    with pytest.raises(ConfigError, match="4.snapshot is not a valid eqx_diloco payload") as error:
        diloco.reform(snapshots, island=0, key=jax.random.key(0))
    assert "\n" not in str(error.value)
    assert not marker.exists()


@pytest.mark.parametrize("content, message", [
    (lambda: encode({"step": 8, "island": 0, "shared": {}, "own": {}}), "its step is 8"),
    (lambda: encode({"step": 4, "island": 0, "shared": {}}), "exactly the keys step, island, shared and own"),
    (lambda: encode({"step": 4, "island": "0", "shared": {}, "own": {}}), "its island is '0'"),
    (lambda: encode({"step": 4, "island": 0, "shared": {"x": [1.0]}, "own": {}}), "its shared part"),
    (lambda: encode({"step": 4, "island": 0, "shared": {}, "own": np.zeros(2)}), "its own part"),
    (lambda: encode({"step": 4, "island": 0, "shared": {}, "own": {"p": [np.zeros(3)]}})[:-5], "truncated"),
    (lambda: b"", "wrong magic"),
])
def test_a_malformed_snapshot_is_refused_with_one_line(tmp_path, content, message):
    (tmp_path / "4.snapshot").write_bytes(content())
    with pytest.raises(WireFormatError) as error:
        IslandSnapshots(tmp_path).load(4)
    text = str(error.value)
    assert text.startswith(f"the island snapshot {tmp_path / '4.snapshot'} ") and message in text and "\n" not in text
