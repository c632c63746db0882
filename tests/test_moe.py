import jax

jax.config.update("jax_numpy_dtype_promotion", "strict")

import math  # noqa: E402

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from models.moe import MoE, load_balance_loss, usage_entropy  # noqa: E402
from models.transformer import MLP, Transformer, TransformerConfig, lm_loss  # noqa: E402


def _config(**kw):
    base = dict(num_layers=2, dim=32, num_heads=2, num_experts=4, top_k=2)
    base.update(kw)
    return TransformerConfig(**base)


def _moe_like_mlp(config, mlp, key):
    """An MoE with a random router whose experts are all copies of `mlp`."""
    moe = MoE(config, key=key)
    e = config.num_experts
    up = jnp.broadcast_to(mlp.up, (e, *mlp.up.shape))
    down = jnp.broadcast_to(mlp.down, (e, *mlp.down.shape))
    return eqx.tree_at(lambda m: (m.up, m.down), moe, (up, down))


def test_shapes_and_fields():
    config = _config()
    moe = MoE(config, key=jax.random.key(0))
    hidden = config.mlp_ratio * config.dim
    assert moe.router.shape == (config.dim, config.num_experts)
    assert moe.up.shape == (config.num_experts, config.dim, hidden)
    assert moe.down.shape == (config.num_experts, hidden, config.dim)
    assert MoE.router_fields == ("router",)
    for name in MoE.router_fields:
        assert isinstance(getattr(moe, name), jax.Array)
    # router_fields is a class attribute, not a pytree leaf/field.
    assert len(jax.tree.leaves(moe)) == 3
    assert moe.top_k == 2 and moe.num_experts == 4
    # Same init scale as MLP.
    np.testing.assert_allclose(jnp.std(moe.up), 0.02, rtol=0.05)
    np.testing.assert_allclose(jnp.std(moe.down), 0.02 / math.sqrt(2 * config.num_layers), rtol=0.05)


@pytest.mark.parametrize("top_k", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_identical_experts_equal_dense_mlp(top_k):
    config = _config(top_k=top_k)
    k_mlp, k_moe, k_x = jax.random.split(jax.random.key(1), 3)
    mlp = MLP(config, key=k_mlp)
    moe = _moe_like_mlp(config, mlp, k_moe)
    # Make the router opinionated so the gates are far from uniform.
    moe = eqx.tree_at(lambda m: m.router, moe, moe.router * 50.0)
    x = jax.random.normal(k_x, (16, config.dim), jnp.float32)
    y_mlp, aux_mlp = mlp(x)
    y_moe, aux = moe(x)
    assert aux_mlp == {}
    assert y_moe.shape == y_mlp.shape and y_moe.dtype == y_mlp.dtype
    np.testing.assert_allclose(y_moe, y_mlp, atol=1e-6, rtol=0)
    _, weights, top_idx = moe.route(x)
    assert weights.shape == (16, top_k)
    if top_k == 1:
        assert bool(jnp.all(weights == 1.0))
    else:
        np.testing.assert_allclose(jnp.sum(weights, axis=-1), 1.0, atol=1e-6)
        assert bool(jnp.all(top_idx[:, 0] != top_idx[:, 1]))
    assert aux["load_balance_loss"].shape == ()
    assert aux["expert_usage"].shape == (config.num_experts,)
    np.testing.assert_allclose(jnp.sum(aux["expert_usage"]), 1.0, atol=1e-6)


def test_distinct_experts_combine_gate_weighted():
    """With distinct experts the output is the gate-weighted sum of the chosen experts."""
    config = _config(top_k=2)
    k_moe, k_x = jax.random.split(jax.random.key(2))
    moe = MoE(config, key=k_moe)
    moe = eqx.tree_at(lambda m: m.router, moe, moe.router * 50.0)
    x = jax.random.normal(k_x, (8, config.dim), jnp.float32)
    y, _ = moe(x)
    _, weights, top_idx = moe.route(x)
    # Reference: gather each token's chosen experts' weights and apply them one choice at a time.
    expected = jnp.zeros_like(x)
    for j in range(config.top_k):
        up, down = moe.up[top_idx[:, j]], moe.down[top_idx[:, j]]
        out = jnp.einsum("sh,shd->sd", jax.nn.gelu(jnp.einsum("sd,sdh->sh", x, up)), down)
        expected = expected + weights[:, j, None] * out
    np.testing.assert_allclose(y, expected, atol=1e-6, rtol=1e-5)


def test_load_balance_loss_uniform_router_is_one():
    config = _config()
    moe = MoE(config, key=jax.random.key(3))
    moe = eqx.tree_at(lambda m: m.router, moe, jnp.zeros_like(moe.router))
    x = jax.random.normal(jax.random.key(4), (12, config.dim), jnp.float32)
    _, aux = moe(x)
    # Uniform probabilities: E * sum_e f_e / E = 1 whatever the tie-breaking did.
    np.testing.assert_allclose(aux["load_balance_loss"], 1.0, atol=1e-6)


def test_load_balance_loss_formula_crafted():
    e = 4
    # Token i sent to expert i % e with near-certain probability: balanced -> ~1.
    probs = jnp.full((8, e), 0.01, jnp.float32).at[jnp.arange(8), jnp.arange(8) % e].set(0.97)
    top1 = jnp.arange(8) % e
    np.testing.assert_allclose(load_balance_loss(probs, top1), 1.0, atol=1e-6)
    # Uniform probabilities with a skewed first choice: still exactly 1.
    uniform = jnp.full((8, e), 1.0 / e, jnp.float32)
    np.testing.assert_allclose(load_balance_loss(uniform, jnp.zeros(8, jnp.int32)), 1.0, atol=1e-6)
    # Everything to expert 0 with certainty: E.
    onehot = jax.nn.one_hot(jnp.zeros(8, jnp.int32), e, dtype=jnp.float32)
    np.testing.assert_allclose(load_balance_loss(onehot, jnp.zeros(8, jnp.int32)), float(e), atol=1e-6)
    # Hand-computed mixed case: f = [3/4, 1/4, 0, 0], P = mean of rows.
    p = jnp.array(
        [[0.7, 0.1, 0.1, 0.1], [0.4, 0.3, 0.2, 0.1], [0.5, 0.2, 0.2, 0.1], [0.1, 0.6, 0.2, 0.1]], jnp.float32
    )
    f = np.array([0.75, 0.25, 0.0, 0.0])
    expected = e * float(np.sum(f * np.asarray(p).mean(axis=0)))
    np.testing.assert_allclose(load_balance_loss(p, jnp.array([0, 0, 0, 1])), expected, atol=1e-6)


def test_usage_entropy():
    np.testing.assert_allclose(usage_entropy(jnp.full((4,), 0.25, jnp.float32)), 1.0, atol=1e-6)
    np.testing.assert_allclose(usage_entropy(jnp.array([1.0, 0.0, 0.0, 0.0])), 0.0, atol=1e-6)
    # Batched over leading axes (e.g. per layer), and counts are normalized.
    usage = jnp.array([[0.25, 0.25, 0.25, 0.25], [0.5, 0.5, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    ent = usage_entropy(usage)
    assert ent.shape == (3,)
    np.testing.assert_allclose(ent, [1.0, 0.5, 1.0], atol=1e-6)
    assert bool(jnp.all(jnp.isfinite(ent)))


def test_transformer_moe_loss_and_router_grad():
    config = _config(kind="moe")
    model = Transformer(config, key=jax.random.key(5))
    assert model.blocks.ffn.router.shape == (config.num_layers, config.dim, config.num_experts)
    tokens = jax.random.randint(jax.random.key(6), (3, 17), 0, config.vocab_size)

    @eqx.filter_jit
    def run(model, tokens):
        (loss, aux), grads = eqx.filter_value_and_grad(lm_loss, has_aux=True)(model, tokens)
        return model(tokens[0, :-1]), loss, aux, grads

    logits, loss, aux, grads = run(model, tokens)
    assert logits.shape == (16, config.vocab_size)
    assert bool(jnp.isfinite(loss))
    assert aux["expert_usage"].shape == (config.num_layers, config.num_experts)
    assert aux["load_balance_loss"].shape == (config.num_layers,)
    np.testing.assert_allclose(jnp.sum(aux["expert_usage"], axis=-1), 1.0, atol=1e-5)
    expected = aux["ce"] + config.aux_loss_weight * jnp.sum(aux["load_balance_loss"])
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    assert float(loss) > float(aux["ce"])  # the aux term is included and positive
    assert usage_entropy(aux["expert_usage"]).shape == (config.num_layers,)

    router_grad = grads.blocks.ffn.router
    assert router_grad.shape == model.blocks.ffn.router.shape
    assert bool(jnp.all(jnp.isfinite(router_grad)))
    assert float(jnp.max(jnp.abs(router_grad))) > 0.0
    assert float(jnp.max(jnp.abs(grads.blocks.ffn.up))) > 0.0


@pytest.mark.parametrize("top_k", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_router_task_gradient(top_k):
    """Without the aux loss, top_k=2 passes task gradient to the router; top_k=1 (gate 1.0) does not."""
    config = _config(top_k=top_k)
    k_moe, k_x, k_t = jax.random.split(jax.random.key(7), 3)
    moe = MoE(config, key=k_moe)
    x = jax.random.normal(k_x, (8, config.dim), jnp.float32)
    target = jax.random.normal(k_t, (8, config.dim), jnp.float32)
    grads = eqx.filter_grad(lambda m: jnp.sum(m(x)[0] * target))(moe)
    size = float(jnp.max(jnp.abs(grads.router)))
    if top_k == 2:
        assert size > 0.0
    else:
        assert size == 0.0
