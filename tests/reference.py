"""A plain (Streaming) DiLoCo written without shard_map, fragments or optax's outer optimizer.

It uses jax.vmap over replicas, boolean masks per fragment built from the layer indices
directly, and the Nesterov momentum formula written out. The trainer must match it.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from eqx_diloco import schedule
from models import Transformer
from models.transformer import lm_loss


def fragment_masks(model: Transformer, num_fragments: int, pattern: str) -> list:
    """Per fragment, a tree of boolean arrays shaped like `model` marking its elements."""
    L = model.config.num_layers
    masks = []
    for p in range(num_fragments):
        if num_fragments == 1:
            masks.append(jax.tree.map(lambda x: np.ones(x.shape, bool), model))
            continue
        groups = num_fragments - 1
        layer_in = np.array([(l % groups if pattern == "strided" else l // (L // groups)) == p - 1 for l in range(L)])
        mask = jax.tree.map(lambda x: np.full(x.shape, p == 0), model)
        blocks = jax.tree.map(lambda x: np.broadcast_to(layer_in.reshape((L,) + (1,) * (x.ndim - 1)), x.shape),
                              model.blocks)
        masks.append(eqx.tree_at(lambda m: m.blocks, mask, blocks))
    return masks


def reference_diloco(trainer, steps: int):
    """Run `steps` steps of (Streaming) DiLoCo the plain way. Returns (mean losses, global, replicas)."""
    cfg, d = trainer.config, trainer.config.diloco
    model = Transformer(cfg.model, key=jax.random.split(jax.random.key(cfg.train.seed))[0])
    R, P, H, tau = d.num_replicas, d.num_fragments, d.sync_period, d.overlap_steps
    params = jax.tree.map(lambda x: jnp.broadcast_to(x, (R, *x.shape)), model)
    opt_state = jax.vmap(trainer.inner_opt.init)(params)
    masks = fragment_masks(model, P, d.fragment_pattern)
    global_params, momentum = model, jax.tree.map(jnp.zeros_like, model)
    lr, mu, alpha = d.outer_lr, d.outer_momentum, d.alpha

    @jax.jit
    @jax.vmap
    def inner(p, o, tokens):
        (loss, _), grads = eqx.filter_value_and_grad(lm_loss, has_aux=True)(p, tokens)
        with jax.numpy_dtype_promotion("standard"):
            updates, o = trainer.inner_opt.update(grads, o, p)
        return jax.tree.map(lambda a, b: a + b, p, updates), o, loss

    losses = []
    for step in range(steps):
        t = step + 1
        params, opt_state, loss = inner(params, opt_state, jnp.asarray(trainer.batches.batch(step)))
        losses.append(float(jnp.mean(loss)))
        synced = schedule.synced_fragment(t, H, P)
        if synced is not None:
            m = masks[synced]
            delta = jax.tree.map(lambda g, r: g - jnp.mean(r, axis=0), global_params, params)
            momentum = jax.tree.map(lambda k, v, dl: jnp.where(k, mu * v + dl, v), m, momentum, delta)
            step_dir = jax.tree.map(lambda dl, v: dl + mu * v if d.nesterov else v, delta, momentum)
            global_params = jax.tree.map(lambda k, g, u: jnp.where(k, g - lr * u, g), m, global_params, step_dir)
        applied = schedule.applied_fragment(t, H, P, tau)
        if applied is not None:
            m = masks[applied]
            merge = lambda k, r, g: jnp.where(  # noqa: E731
                jnp.broadcast_to(k, r.shape), alpha * r + (1 - alpha) * jnp.broadcast_to(g, r.shape), r
            )
            params = jax.tree.map(merge, m, params, global_params)
    return losses, global_params, params
