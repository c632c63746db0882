"""Streaming DiLoCo against a plain reference, a closed form, and its own invariants."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_diloco import schedule
from eqx_diloco.lm import Trainer
from reference import reference_diloco
from util import read_metrics, train_losses


@pytest.mark.slow  # the same math on DiLoCo itself: test_core_equivalence.py
@pytest.mark.parametrize(
    "diloco",
    [
        dict(num_fragments=1, sync_period=3),  # plain DiLoCo
        dict(num_fragments=3, sync_period=6),  # streaming, immediate replacement
        dict(num_fragments=3, sync_period=6, overlap_steps=1, alpha=0.5, fragment_pattern="sequential"),
        dict(num_fragments=2, sync_period=4, overlap_steps=1, nesterov=False),
    ],
    ids=["P1", "P3", "P3-tau1-alpha.5-seq", "P2-tau1-sgdm"],
)
def test_trainer_matches_plain_reference(make_config, diloco):
    config = make_config(model=dict(num_layers=4), diloco=diloco, train=dict(steps=13, final_sync=False))
    trainer = Trainer(config, verbose=False)
    trainer.run()
    losses, global_params, replicas = reference_diloco(trainer, 13)
    np.testing.assert_allclose(train_losses(config.run_dir), losses, rtol=2e-5)
    # Adam divides tiny gradients of rarely seen embedding rows by tiny second moments, which
    # turns float rounding differences into small weight differences: bound max and mean.
    for ours, ref in [(trainer.state.global_params, global_params), (trainer.state.params, replicas)]:
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
            diff = np.abs(np.asarray(a) - np.asarray(b))
            assert diff.max() < 1e-4 and diff.mean() < 1e-6, (diff.max(), diff.mean())


@pytest.mark.slow  # the trainer end to end; the core's P = 1 case: test_core_equivalence.py
@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_one_fragment_no_overlap_is_plain_diloco(make_config, alpha):
    """P=1, tau=0: every leaf syncs at once, every H steps, by Nesterov SGD on the mean replica delta.

    Replicas move by a constant -c_r per inner step, so plain DiLoCo has a closed form.
    """
    H, lr, mu, steps = 4, 0.7, 0.9, 9
    config = make_config(diloco=dict(num_replicas=2, sync_period=H, num_fragments=1, overlap_steps=0, alpha=alpha))
    trainer = Trainer(config, verbose=False)
    state, _ = trainer.initial_state()
    x = [np.asarray(v, np.float64) for v in jax.tree.leaves(jax.device_get(state.global_params))]
    c = jnp.array([0.01, 0.03])
    drift = jax.jit(lambda s: dataclasses.replace(
        s, params=jax.tree.map(lambda p: p - c.reshape((-1,) + (1,) * (p.ndim - 1)), s.params)))
    c = np.asarray(c, np.float64)
    # Plain DiLoCo by hand: first sync at H, second at 2H; replicas merge at once (tau = 0).
    d1 = H * c.mean()
    m1 = d1
    g1 = [v - lr * (d1 + mu * m1) for v in x]
    merged = [[alpha * (v - H * cr) + (1 - alpha) * g for v, g in zip(x, g1)] for cr in c]
    before_2 = [[v - H * cr for v in merged[r]] for r, cr in enumerate(c)]
    d2 = [g - (a + b) / 2 for g, a, b in zip(g1, *before_2)]
    m2 = [mu * m1 + d for d in d2]
    g2 = [g - lr * (d + mu * m) for g, d, m in zip(g1, d2, m2)]
    expected_global = {t: x if t < H else g1 if t < 2 * H else g2 for t in range(1, steps + 1)}

    def check(actual, expected, t):
        for a, e in zip(actual, expected):
            np.testing.assert_allclose(np.asarray(a), e, rtol=1e-5, atol=1e-6, err_msg=f"step {t}")

    for t in range(1, steps + 1):
        state = drift(state)
        state, _, _, _ = trainer.outer_steps(state, t)
        check(jax.tree.leaves(jax.device_get(state.global_params)), expected_global[t], t)
        replicas = jax.tree.leaves(jax.device_get(state.params))
        if t == H:
            for r in range(2):
                check([v[r] for v in replicas], merged[r], t)
        if t == 2 * H:
            for r in range(2):
                check([v[r] for v in replicas], [alpha * b + (1 - alpha) * g for b, g in zip(before_2[r], g2)], t)


def _constant_drift_run(make_config, tau, alpha, steps):
    """Replicas move by a constant -c_r per step (no data); the outer loop runs as in training."""
    config = make_config(
        model=dict(num_layers=2), diloco=dict(num_replicas=2, num_fragments=3, sync_period=9, overlap_steps=tau,
                                              alpha=alpha)
    )
    trainer = Trainer(config, verbose=False)
    state, _ = trainer.initial_state()
    x0 = jax.device_get(state.global_params)
    c = jnp.array([0.01, 0.03])
    drift = jax.jit(lambda s: dataclasses.replace(
        s, params=jax.tree.map(lambda p: p - c.reshape((-1,) + (1,) * (p.ndim - 1)), s.params)))
    history = {}
    for t in range(1, steps + 1):
        state = drift(state)
        state, _, _, _ = trainer.outer_steps(state, t)
        history[t] = jax.device_get(state)
    return trainer, x0, np.asarray(c), history


@pytest.mark.slow
@pytest.mark.parametrize("tau", [0, 1, 2])
@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_closed_form_with_constant_inner_updates(make_config, tau, alpha):
    H, lr, mu = 9, 0.7, 0.9
    trainer, x0, c, hist = _constant_drift_run(make_config, tau, alpha, steps=2 * H + 3 + tau)
    frag = trainer.fragmenter
    cbar = c.mean()
    for p in range(3):
        t1 = (p + 1) * H // 3
        t2 = t1 + H
        x = frag.get(x0, p)
        # First sync at t1: delta = t1 * cbar; Nesterov: step = delta + mu * momentum.
        d1 = t1 * cbar
        m1 = d1
        g1 = [v - lr * (d1 + mu * m1) for v in x]
        # Merge at t1 + tau, then H - tau more steps of drift before the second sync.
        merged = [[alpha * (v - (t1 + tau) * cr) + (1 - alpha) * g for v, g in zip(x, g1)] for cr in c]
        before_2 = [[m - (H - tau) * cr for m in merged[r]] for r, cr in enumerate(c)]
        mean_2 = [(a + b) / 2 for a, b in zip(*before_2)]
        d2 = [g - m for g, m in zip(g1, mean_2)]
        m2 = [mu * m1 + d for d in d2]
        g2 = [g - lr * (d + mu * m) for g, d, m in zip(g1, d2, m2)]

        def check(actual, expected):
            for a, e in zip(actual, expected):
                np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)

        # With tau > 0 the sync runs in the background and is installed at t + tau.
        check(frag.get(hist[t1 + tau].global_params, p), g1)
        check(frag.get(hist[t2 + tau].global_params, p), g2)
        trace = hist[t2 + tau].outer_states[p][0].trace  # optax sgd: (TraceState, ...)
        check(trace, m2)
        # Replicas: untouched until t1 + tau, then merged.
        if tau:
            check([v[0] for v in frag.get(hist[t1].params, p, layer_axis=1)], [v - t1 * c[0] for v in x])
        check([v[1] for v in frag.get(hist[t1 + tau].params, p, layer_axis=1)], merged[1])
        after_2 = [[alpha * (b + (-tau) * cr) + (1 - alpha) * g for b, g in zip(before_2[r], g2)]
                   for r, cr in enumerate(c)]
        check([v[0] for v in frag.get(hist[t2 + tau].params, p, layer_axis=1)], after_2[0])


@pytest.mark.slow
@pytest.mark.parametrize("diloco", [dict(num_fragments=3, overlap_steps=1, alpha=0.5),
                                    dict(num_fragments=2, overlap_steps=0), dict(num_fragments=3, quantize="int4")])
def test_all_replicas_hold_identical_global_params_and_outer_state_every_step(make_config, diloco):
    config = make_config(model=dict(num_layers=2), diloco=dict(num_replicas=4, sync_period=6, **diloco))
    trainer = Trainer(config, verbose=False)
    state, _ = trainer.initial_state()
    for step in range(8):
        state, _ = trainer.inner_step(state, jax.device_put(trainer.batches.batch(step), trainer.batch_sharding))
        state, _, _, _ = trainer.outer_steps(state, step + 1)
        for leaf in jax.tree.leaves((state.global_params, state.outer_states)):
            shards = [np.asarray(s.data) for s in leaf.addressable_shards]
            assert len(shards) == 4
            for s in shards[1:]:
                np.testing.assert_array_equal(s, shards[0])


@pytest.mark.slow
def test_metrics_name_synced_and_applied_fragments_and_count_fragment_bytes(make_config):
    config = make_config(model=dict(num_layers=2), diloco=dict(num_fragments=3, sync_period=6, overlap_steps=1),
                         train=dict(steps=13, log_every=100))
    trainer = Trainer(config, verbose=False)
    trainer.run()
    lines = [r for r in read_metrics(config.run_dir) if "loss" in r]
    synced = {r["step"]: r["synced_fragment"] for r in lines if r["synced_fragment"] is not None}
    applied = {r["step"]: r["applied_fragment"] for r in lines if r["applied_fragment"] is not None}
    assert synced == {t: schedule.synced_fragment(t, 6, 3) for t in (2, 4, 6, 8, 10, 12)}
    assert applied == {t + 1: p for t, p in synced.items()}
    sizes = [trainer.fragmenter.nbytes(trainer.abstract_state.global_params, p) for p in range(3)]
    assert lines[-1]["sent_bytes"] == 2 * sum(sizes)
    assert lines[-1]["peak_sync_bytes"] == max(sizes) < sum(sizes)


@pytest.mark.slow
def test_sync_on_communication_devices_equals_sync_on_compute_devices(make_config):
    on = make_config(model=dict(num_layers=2), diloco=dict(num_fragments=3, sync_period=6, overlap_steps=1,
                                                           alpha=0.5, comm_device="on"), train=dict(steps=10))
    off = dataclasses.replace(on, run_dir=on.run_dir.parent / "off",
                              diloco=dataclasses.replace(on.diloco, comm_device="off"))
    a, b = Trainer(on, verbose=False), Trainer(off, verbose=False)
    assert a.comm_mesh is not None and b.comm_mesh is None
    assert set(a.comm_mesh.devices.flat).isdisjoint(a.mesh.devices.flat)
    a.run()
    b.run()
    assert train_losses(on.run_dir) == train_losses(off.run_dir)
    for x, y in zip(jax.tree.leaves(a.state), jax.tree.leaves(b.state)):
        np.testing.assert_array_equal(x, y)
