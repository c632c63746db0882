"""The core owns the whole lifecycle: `finish`, the non-finite policy, `save`'s schedule, batch checks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from eqx_diloco import Checkpointer, ConfigError, DiLoCo, NonFiniteError

from custom_model import StackedMLP, loss_fn, make_batch


def _averaging(**overrides) -> DiLoCo:
    """Streaming DiLoCo whose outer step is plain averaging (outer lr 1, no momentum)."""
    kwargs = dict(loss_fn=loss_fn, layers=lambda m: m.blocks, num_replicas=2, sync_period=6,
                  inner_optimizer=optax.adamw(3e-3), outer_optimizer=optax.sgd(1.0), num_fragments=3)
    return DiLoCo(**{**kwargs, **overrides})


def _train(diloco: DiLoCo, steps: int):
    state = diloco.init(StackedMLP(key=jax.random.key(0)))
    for step in range(steps):
        state, _ = diloco.step(state, make_batch(step, 2))
    return state


def _replica_mean(state):
    return jax.tree.map(lambda x: np.asarray(x).mean(axis=0), jax.device_get(state.params))


@pytest.mark.parametrize("overlap_steps", [0, 1], ids=["tau0", "tau1"])
def test_finish_sends_every_inner_step_to_the_global_model(overlap_steps):
    # 14 steps, H = 6, P = 3: fragments sync at 2, 4, 6, 8, 10, 12, 14, ... so at step 14
    # fragment 0 has just synced (with tau = 1 still in flight) and fragments 1, 2 last synced at
    # 10 and 12. With plain averaging, a finished theta_g is the replicas' mean at step 14.
    diloco = _averaging(overlap_steps=overlap_steps)
    state = _train(diloco, 14)
    assert diloco.stale_groups(14) == [1, 2]
    before = jax.device_get(diloco.global_params(state))
    expected = _replica_mean(state)
    stale = jax.tree.leaves(before.blocks)
    assert any(not np.allclose(a, b, atol=1e-6) for a, b in zip(stale, jax.tree.leaves(expected.blocks)))
    state = diloco.finish(state)
    for got, want in zip(jax.tree.leaves(jax.device_get(state.global_params)), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got, want, atol=1e-6)
    model = diloco.global_model(state)
    assert isinstance(model, StackedMLP)


def test_finish_lands_eager_exchanges_and_a_second_finish_changes_nothing():
    diloco = _averaging(num_fragments=1, sync_period=4, outer_overlap="delayed")
    state = _train(diloco, 10)
    state = diloco.finish(state)
    once = jax.device_get(state.global_params)
    # delayed + plain averaging: after the drain theta_g is the replicas' mean at step 10
    # (the round 8 -> 10 is sent by finish, the exchange of step 8 and that one both land).
    for got, want in zip(jax.tree.leaves(once), jax.tree.leaves(_replica_mean(state))):
        np.testing.assert_allclose(got, want, atol=1e-5)
    again = jax.device_get(diloco.finish(state).global_params)
    for a, b in zip(jax.tree.leaves(once), jax.tree.leaves(again)):
        np.testing.assert_array_equal(a, b)


def _poison_replica(state, replica: int):
    """NaN in every parameter of one replica (as a diverged replica would have)."""
    def poison(x):
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            return x
        return x.at[replica].set(jnp.nan)
    return dataclasses.replace(state, params=jax.tree.map(poison, state.params))


def test_stop_raises_from_the_core_and_never_updates_the_global_model():
    diloco = _averaging(num_fragments=1, sync_period=4, check_losses=False)
    state = _train(diloco, 3)
    last_finite = jax.device_get(state.global_params)
    state = _poison_replica(state, 1)
    state, _ = diloco.step(state, make_batch(3, 2))  # step 4 syncs the NaN outer gradient
    kept = jax.device_get(state.global_params)
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(last_finite)):
        np.testing.assert_array_equal(a, b)  # not updated at all
    with pytest.raises(NonFiniteError, match=r"replica 1 at the sync after step 4"):
        diloco.step(state, make_batch(4, 2))


def test_skip_leaves_the_bad_replica_out_and_raises_only_when_all_are_out():
    diloco = _averaging(num_fragments=1, sync_period=4, on_nonfinite="skip", check_losses=False)
    state = _train(diloco, 3)
    state = _poison_replica(state, 1)
    state, _ = diloco.step(state, make_batch(3, 2))
    state, _ = diloco.step(state, make_batch(4, 2))  # one replica left: no error
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(state.global_params)))
    state = _poison_replica(_poison_replica(state, 0), 1)
    for step in range(5, 8):
        state, _ = diloco.step(state, make_batch(step, 2))
    with pytest.raises(NonFiniteError, match="every replica at the sync after step 8"):
        diloco.step(state, make_batch(8, 2))


def test_finish_raises_for_a_non_finite_last_sync():
    diloco = _averaging(num_fragments=1, sync_period=4, check_losses=False)
    state = _poison_replica(_train(diloco, 6), 0)
    with pytest.raises(NonFiniteError, match="replica 0 at the sync after step 6"):
        diloco.finish(state)


def test_save_honours_the_checkpointers_schedule(tmp_path):
    diloco = _averaging(num_fragments=1, sync_period=4)
    checkpointer = Checkpointer(tmp_path / "ckpt", every=3, keep=5)
    state = diloco.init(StackedMLP(key=jax.random.key(0)))
    for step in range(7):
        state, _ = diloco.step(state, make_batch(step, 2))
        state = diloco.save(checkpointer, state)
    state = diloco.save(checkpointer, state, force=True)  # the end of a run: step 7, off schedule
    checkpointer.wait()
    assert checkpointer.steps() == [7, 6, 3]
    never = Checkpointer(tmp_path / "never", every=0, keep=1)
    diloco.save(never, state, force=True)
    assert never.steps() == []


@pytest.mark.parametrize("rows", [1, 4], ids=["too-few", "2R"])
def test_a_batch_without_the_replica_axis_is_refused(rows):
    diloco = _averaging(num_fragments=1, sync_period=4)
    state = diloco.init(StackedMLP(key=jax.random.key(0)))
    x, y = make_batch(0, rows)
    with pytest.raises(ConfigError, match=r"leading replica axis of size num_replicas=2"):
        diloco.step(state, (x, y))


def test_a_bare_scalar_loss_is_accepted():
    diloco = _averaging(num_fragments=1, sync_period=2,
                        loss_fn=lambda model, batch, key: loss_fn(model, batch, key)[0])
    state = diloco.init(StackedMLP(key=jax.random.key(0)))
    state, metrics = diloco.step(state, make_batch(0, 2))
    assert metrics["loss"].shape == (2,)
