import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import Transformer, TransformerConfig
from models.transformer import lm_loss, rotary_tables


def unrolled_logits(model: Transformer, tokens):
    """The same forward pass with a Python loop over layers (the reference for scan)."""
    cos, sin = rotary_tables(tokens.shape[0], model.config.head_dim, model.config.rope_base)
    x = model.embed[tokens]
    for i in range(model.config.num_layers):
        block = jax.tree.map(lambda a: a[i], model.blocks)
        x, _ = block(x, cos, sin)
    x = model.final_norm(x)
    head = model.embed.T if model.head is None else model.head
    return x @ head


@pytest.mark.parametrize("tie", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_scan_equals_unrolled_loop(tie):
    config = TransformerConfig(num_layers=3, dim=32, num_heads=4, mlp_ratio=2, tie_embeddings=tie)
    model = Transformer(config, key=jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (24,), 0, config.vocab_size)
    np.testing.assert_allclose(model(tokens), unrolled_logits(model, tokens), rtol=1e-5, atol=1e-5)


def test_stacked_leaves_have_layer_axis_and_tied_head_is_absent():
    config = TransformerConfig(num_layers=5, dim=16, num_heads=2, tie_embeddings=True)
    model = Transformer(config, key=jax.random.key(0))
    assert all(x.shape[0] == 5 for x in jax.tree.leaves(model.blocks))
    assert model.head is None


def test_causality_future_tokens_do_not_change_past_logits():
    config = TransformerConfig(num_layers=2, dim=32, num_heads=2)
    model = Transformer(config, key=jax.random.key(0))
    a = jnp.arange(16, dtype=jnp.int32)
    b = a.at[10:].set(7)
    np.testing.assert_allclose(model(a)[:10], model(b)[:10], atol=1e-6)
    assert not np.allclose(model(a)[10:], model(b)[10:])


def test_initial_loss_is_near_uniform_and_gradients_flow():
    config = TransformerConfig(num_layers=2, dim=32, num_heads=2)
    model = Transformer(config, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(3), (4, 17), 0, 256)
    (loss, aux), grads = eqx.filter_jit(eqx.filter_value_and_grad(lm_loss, has_aux=True))(model, tokens)
    assert abs(float(loss) - np.log(256)) < 0.1
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))


def test_dropout_needs_a_key_and_changes_output():
    config = TransformerConfig(num_layers=2, dim=32, num_heads=2, dropout=0.5)
    model = Transformer(config, key=jax.random.key(0))
    tokens = jnp.arange(8, dtype=jnp.int32)
    np.testing.assert_array_equal(model(tokens), model(tokens))  # no key: deterministic
    assert not np.allclose(model(tokens, key=jax.random.key(1)), model(tokens))
