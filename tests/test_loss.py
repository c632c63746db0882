"""The LM loss as logsumexp minus the target's logit: equal to log_softmax + take_along_axis."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import Transformer, TransformerConfig
from models.transformer import lm_loss, token_cross_entropy


def log_softmax_cross_entropy(logits, targets):
    """The formula the loss replaced: float32 log-probabilities, then the target's."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]


def test_token_cross_entropy_equals_log_softmax_with_its_gradient():
    logits = jax.random.normal(jax.random.key(0), (3, 7, 50)) * 4
    targets = jax.random.randint(jax.random.key(1), (3, 7), 0, 50)
    np.testing.assert_allclose(token_cross_entropy(logits, targets), log_softmax_cross_entropy(logits, targets),
                               rtol=0, atol=1e-6)
    new = jax.grad(lambda x: jnp.mean(token_cross_entropy(x, targets)))(logits)
    old = jax.grad(lambda x: jnp.mean(log_softmax_cross_entropy(x, targets)))(logits)
    np.testing.assert_allclose(new, old, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_lm_loss_and_gradients_equal_the_log_softmax_loss_within_1e_6(kind):
    config = TransformerConfig(num_layers=2, dim=32, num_heads=2, mlp_ratio=2, vocab_size=97, kind=kind,
                               dtype="float32")
    model = Transformer(config, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (4, 17), 0, config.vocab_size)

    def reference(m):
        logits, aux = jax.vmap(m.apply)(tokens[:, :-1])
        ce = jnp.mean(log_softmax_cross_entropy(logits, tokens[:, 1:]))
        aux = jax.tree.map(lambda a: jnp.mean(a, axis=0), aux)
        loss = ce + (config.aux_loss_weight * jnp.sum(aux["load_balance_loss"]) if kind == "moe" else 0.0)
        return loss, ce

    (loss, aux), grads = eqx.filter_value_and_grad(lambda m: lm_loss(m, tokens), has_aux=True)(model)
    (ref_loss, ref_ce), ref_grads = eqx.filter_value_and_grad(reference, has_aux=True)(model)
    np.testing.assert_allclose(loss, ref_loss, rtol=0, atol=1e-6)
    np.testing.assert_allclose(aux["ce"], ref_ce, rtol=0, atol=1e-6)
    for new, old in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(new, old, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", ["uint16", "uint32", "int32"])
def test_token_ids_of_any_integer_type_pick_their_logit(dtype):
    """Token files hold uint16 or uint32 ids."""
    logits = jax.random.normal(jax.random.key(0), (2, 5, 40))
    targets = jax.random.randint(jax.random.key(1), (2, 5), 0, 40).astype(dtype)
    np.testing.assert_allclose(token_cross_entropy(logits, targets),
                               log_softmax_cross_entropy(logits, targets.astype(jnp.int32)), rtol=0, atol=1e-6)
