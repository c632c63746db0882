"""Equivalence tests of the trainer (the CLI's path: config, data, LM model) against plain
references. `test_core_equivalence.py` checks the same math on `DiLoCo` itself, in the fast tier;
these run the trainer end to end and are marked slow."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from eqx_diloco.lm import Trainer
from eqx_diloco._outer import mean_outer_gradient
from util import train_losses


@pytest.mark.slow
def test_diloco_one_replica_h1_lr1_equals_plain_training(make_config):
    diloco = make_config(
        diloco=dict(num_replicas=1, sync_period=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
    )
    ddp = dataclasses.replace(diloco, algorithm="ddp", run_dir=diloco.run_dir.parent / "ddp")
    Trainer(diloco, verbose=False).run()
    Trainer(ddp, verbose=False).run()
    a, b = train_losses(diloco.run_dir), train_losses(ddp.run_dir)
    assert len(a) == 8
    np.testing.assert_allclose(a, b, rtol=1e-5)
    assert a[-1] < a[0]


def _place(trainer, tokens):
    return jax.device_put(tokens, trainer.batch_sharding)


@pytest.mark.slow
def test_ddp_r_replicas_equals_one_replica_with_r_times_batch(make_config):
    many = Trainer(make_config(algorithm="ddp", diloco=dict(num_replicas=2), train=dict(batch_size=4)), verbose=False)
    one = Trainer(make_config(algorithm="ddp", diloco=dict(num_replicas=1), train=dict(batch_size=8)), verbose=False)
    s_many, _ = many.initial_state()
    s_one, _ = one.initial_state()
    for step in range(3):
        tokens = many.batches.batch(step)  # (2, 4, S+1)
        s_many, m_many = many.inner_step(s_many, _place(many, tokens))
        s_one, m_one = one.inner_step(s_one, _place(one, tokens.reshape(1, 8, -1)))
        np.testing.assert_allclose(np.mean(m_many["loss"]), m_one["loss"][0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(s_many.params), jax.tree.leaves(s_one.params)):
        np.testing.assert_allclose(a[0], b[0], rtol=1e-4, atol=1e-6)
        np.testing.assert_array_equal(a[0], a[1])  # ddp keeps replicas identical


@pytest.mark.slow
def test_data_axis_splits_the_batch_without_changing_the_math(make_config):
    flat = make_config(diloco=dict(num_replicas=2, sync_period=4), train=dict(steps=6))
    grid = dataclasses.replace(flat, mesh=dataclasses.replace(flat.mesh, data=2), run_dir=flat.run_dir.parent / "2x2")
    Trainer(flat, verbose=False).run()
    Trainer(grid, verbose=False).run()
    np.testing.assert_allclose(train_losses(flat.run_dir), train_losses(grid.run_dir), rtol=1e-5)


@pytest.mark.parametrize("grid", [(4, 1), (2, 2)])
@pytest.mark.parametrize("exchange", ["auto", "gather", "two_phase"])
def test_shard_map_outer_mean_equals_vmap_reference(grid, exchange):
    R, D = grid
    mesh = jax.make_mesh(grid, ("diloco", "data"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    keys = jax.random.split(jax.random.key(0), 3)
    replicas = [jax.random.normal(keys[0], (R, 5, 3)), jax.random.normal(keys[1], (R, 7))]
    globals_ = [jax.random.normal(keys[2], (5, 3)), jax.numpy.zeros((7,))]
    replicas = jax.device_put(replicas, NamedSharding(mesh, P("diloco")))
    exchange = mean_outer_gradient(mesh, "none", skip_nonfinite=False, error_feedback=False, exchange=exchange)
    mean, finite, _, every_finite = jax.jit(exchange)(replicas, globals_, None)
    reference = jax.vmap(lambda r: [g - x for g, x in zip(globals_, r)])(replicas)
    for got, ref in zip(mean, reference):
        np.testing.assert_allclose(got, np.mean(ref, axis=0), rtol=1e-6, atol=1e-6)
    assert np.asarray(finite).tolist() == [True] * R and bool(every_finite)


@pytest.mark.slow
def test_sync_applies_nesterov_sgd_to_the_mean_outer_gradient(make_config):
    trainer = Trainer(make_config(diloco=dict(num_replicas=4, sync_period=3)), verbose=False)
    state, _ = trainer.initial_state()
    for step in range(3):
        state, _ = trainer.inner_step(state, _place(trainer, trainer.batches.batch(step)))
    g0 = jax.device_get(state.global_params)
    replicas = jax.device_get(state.params)
    state, _ = trainer.outer.sync_and_merge(state, 0)
    opt = optax.sgd(0.7, momentum=0.9, nesterov=True)
    delta = jax.tree.map(lambda g, r: g - np.mean(r, axis=0), g0, replicas)
    leaves = jax.tree.leaves(g0)
    updates, _ = opt.update(jax.tree.leaves(delta), opt.init(leaves), leaves)
    expected = optax.apply_updates(leaves, updates)
    for got, want in zip(jax.tree.leaves(state.global_params), expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(state.global_params)):
        np.testing.assert_array_equal(got, np.broadcast_to(want, got.shape))  # alpha = 0: replicas replaced
