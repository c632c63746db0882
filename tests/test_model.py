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


# The Llama layout: SwiGLU, two query heads per key/value head, Qwen2's q/k/v biases, its own eps.
LLAMA = dict(mlp="swiglu", num_kv_heads=2, qkv_bias=True, ffn_dim=40, norm_eps=1e-5)


@pytest.mark.parametrize("tie,layout", [(False, {}), pytest.param(True, {}, marks=pytest.mark.slow), (False, LLAMA)])
def test_scan_equals_unrolled_loop(tie, layout):
    config = TransformerConfig(num_layers=3, dim=32, num_heads=4, mlp_ratio=2, tie_embeddings=tie, **layout)
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


def test_llama_layout_shapes_and_parameter_count():
    config = TransformerConfig(num_layers=3, dim=32, num_heads=4, **LLAMA)
    model = Transformer(config, key=jax.random.key(0))
    assert model.blocks.attn.k.shape == model.blocks.attn.v.shape == (3, 32, 16)  # 2 kv heads of 8
    assert model.blocks.attn.q_bias.shape == (3, 32) and model.blocks.attn.k_bias.shape == (3, 16)
    assert model.blocks.ffn.gate.shape == model.blocks.ffn.up.shape == (3, 32, 40)
    assert model.blocks.attn_norm.eps == model.final_norm.eps == 1e-5
    for c in (config, TransformerConfig(num_layers=2, dim=32, num_heads=4, num_kv_heads=1, mlp="swiglu")):
        model = Transformer(c, key=jax.random.key(0))
        assert c.num_params() == sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    mask = model.weight_decay_mask()
    assert mask.blocks.ffn.gate is True and mask.blocks.attn_norm.weight is False
    assert Transformer(config, key=jax.random.key(0)).weight_decay_mask().blocks.attn.q_bias is False


def test_grouped_query_attention_equals_multi_head_attention_with_shared_key_value_heads():
    """Query head h reads key/value head h // 2 (Llama's grouping): the same model with each key/value
    head's columns repeated for its group of query heads gives the same logits."""
    gqa = Transformer(TransformerConfig(num_layers=2, dim=32, num_heads=4, **LLAMA), key=jax.random.key(3))
    gqa = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(x.size), x.shape), gqa)  # biases too
    mha = Transformer(TransformerConfig(num_layers=2, dim=32, num_heads=4, **{**LLAMA, "num_kv_heads": None}),
                      key=jax.random.key(0))

    def repeat_heads(x):  # (..., 2 heads * 8) -> (..., 4 heads * 8): head j serves query heads 2j and 2j+1
        heads = x.reshape(*x.shape[:-1], 2, 8)
        return jnp.repeat(heads, 2, axis=-2).reshape(*x.shape[:-1], 32)

    attn = gqa.blocks.attn
    mha = eqx.tree_at(lambda m: (m.embed, m.head, m.final_norm, m.blocks.attn_norm, m.blocks.ffn_norm, m.blocks.ffn,
                                 m.blocks.attn.q, m.blocks.attn.out, m.blocks.attn.q_bias, m.blocks.attn.k,
                                 m.blocks.attn.v, m.blocks.attn.k_bias, m.blocks.attn.v_bias), mha,
                      (gqa.embed, gqa.head, gqa.final_norm, gqa.blocks.attn_norm, gqa.blocks.ffn_norm, gqa.blocks.ffn,
                       attn.q, attn.out, attn.q_bias, *(repeat_heads(x) for x in (attn.k, attn.v, attn.k_bias,
                                                                                   attn.v_bias))))
    tokens = jax.random.randint(jax.random.key(2), (20,), 0, 256)
    np.testing.assert_allclose(gqa(tokens), mha(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("changes,message", [
    (dict(num_kv_heads=3), "TransformerConfig.num_kv_heads must divide num_heads (got 3 and 4)"),
    (dict(num_kv_heads=0), "TransformerConfig.num_kv_heads must divide num_heads (got 0 and 4)"),
    (dict(kind="moe", mlp="swiglu"), "TransformerConfig.mlp swiglu applies to kind='dense'"),
    (dict(ffn_dim=0), "TransformerConfig.ffn_dim must be >= 1"),
    (dict(norm_eps=0.0), "TransformerConfig.norm_eps must be a finite number > 0"),
])
def test_a_layout_that_cannot_be_built_is_refused_naming_the_field(changes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Transformer(TransformerConfig(num_layers=1, dim=32, num_heads=4, **changes), key=jax.random.key(0))
