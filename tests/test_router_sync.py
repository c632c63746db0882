"""MoE routers with their own outer step every K inner steps, and routing diagnostics."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_diloco.lm import Trainer
from eqx_diloco.lm.diagnostics import router_drift
from util import read_metrics

MOE = dict(kind="moe", num_experts=4, top_k=2)


@pytest.mark.slow  # the trainer end to end
def test_router_leaves_step_every_k_and_only_once_at_h(make_config):
    K, H, lr, mu = 2, 6, 0.7, 0.9
    config = make_config(model=MOE, diloco=dict(num_replicas=2, sync_period=H, router_sync_period=K))
    trainer = Trainer(config, verbose=False)
    flags = jax.tree.leaves(trainer.abstract_state.global_params.router_mask())
    assert sum(flags) == 1 and trainer.router_group == 1
    state, _ = trainer.initial_state()
    c = jnp.array([0.01, 0.03])
    drift = jax.jit(lambda s: dataclasses.replace(
        s, params=jax.tree.map(lambda p: p - c.reshape((-1,) + (1,) * (p.ndim - 1)), s.params)))
    pick = lambda tree, router: [x for x, f in zip(jax.tree.leaves(tree), flags) if f == router]  # noqa: E731
    before = jax.device_get(state.global_params)
    g, m = pick(before, True)[0], 0.0
    for t in range(1, 2 * H + 1):
        state = drift(state)
        state, _, _, _ = trainer.outer_steps(state, t)
        after = jax.device_get(state.global_params)
        router_changed = not np.array_equal(pick(after, True)[0], pick(before, True)[0])
        others_changed = any(not np.array_equal(a, b) for a, b in zip(pick(after, False), pick(before, False)))
        assert router_changed == (t % K == 0), t
        assert others_changed == (t % H == 0), t
        if t % K == 0:
            # alpha = 0 resets replicas at every router sync: each sync sees delta = K * mean(c).
            d = K * float(c.mean())
            m = mu * m + d
            g = g - lr * (d + mu * m)
            np.testing.assert_allclose(pick(after, True)[0], g, rtol=1e-5, atol=1e-6)
        before = after


def test_router_drift_is_zero_for_equal_replicas_and_grows_apart():
    x = jax.random.normal(jax.random.key(0), (1, 3, 8, 4))
    same = jnp.concatenate([x, x])
    assert float(router_drift([same], (True,))) < 1e-6
    other = jnp.concatenate([x, -x])
    np.testing.assert_allclose(router_drift([other], (True,)), 2.0, rtol=1e-6)


@pytest.mark.slow
def test_moe_diloco_run_logs_balance_and_drift(make_config):
    config = make_config(model=MOE, diloco=dict(num_replicas=2, sync_period=4, num_fragments=2, router_sync_period=2),
                         train=dict(steps=8))
    trainer = Trainer(config, verbose=False)
    trainer.run()
    lines = [r for r in read_metrics(config.run_dir) if "loss" in r]
    assert all(len(r["expert_balance"]) == 2 and 0 < min(r["expert_balance"]) <= 1 for r in lines)
    drift_steps = [r["step"] for r in lines if "router_drift" in r]
    assert drift_steps == [2, 4, 6, 8]
    assert all(r["router_drift"] >= 0 for r in lines if "router_drift" in r)
    assert lines[-1]["loss"] < lines[0]["loss"]
    # sent bytes, derived from the model alone (float32, not quantized): with H=4 and P=2 a fragment
    # syncs every 2 steps, so in 8 steps each of the 2 fragments syncs twice (together: every
    # non-router parameter twice); the router group syncs every K=2 steps, 4 times.
    model = trainer.abstract_state.global_params
    sizes = [4 * x.size for x in jax.tree.leaves(model)]
    router = sum(s for s, f in zip(sizes, jax.tree.leaves(model.router_mask())) if f)
    assert 0 < router < sum(sizes)
    assert lines[-1]["sent_bytes"] == 2 * (sum(sizes) - router) + 4 * router
    assert trainer.sent_bytes_at(2) == trainer.group_bytes[0] + trainer.group_bytes[2]  # fragment 0 + routers
    assert trainer.sent_bytes_at(4) == trainer.group_bytes[1] + trainer.group_bytes[2]  # fragment 1 + routers
