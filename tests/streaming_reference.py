"""Plain (Streaming) DiLoCo for any model, written without shard_map, the fragments module or
optax's outer optimizer: a jax.vmap over replicas, a boolean mask per fragment built from layer
indices, the Nesterov momentum written out, and the schedule of `eqx_diloco.schedule`:

    at t = sync step of fragment p:    Delta = theta_g - mean_r theta_r   (on p's elements)
                                       v <- mu v + Delta;  theta_g <- theta_g - lr (Delta + mu v)
                                       (plain momentum: theta_g <- theta_g - lr v)
    at t = that step + tau:            theta_r <- alpha theta_r + (1 - alpha) theta_g  (on p's elements)
"""

import jax
import jax.numpy as jnp
import numpy as np

from eager_reference import group_masks, replica_inner_steps
from eqx_diloco import schedule


def reference_streaming(params, *, inner_opt, grad_fn, batches, R, H, P, tau, alpha, lr, mu, nesterov, depth,
                        in_stack, steps, pattern="strided"):
    """Losses (steps, R) and the final (replica params (R, ...), global params) as flat leaf lists.

    - `params`: the model's trainable part; `grad_fn(params, batch) -> (loss, grads)` for one replica.
    - `batches(step)`: every replica's batch at `step` (leading R axis).
    - `depth`, `in_stack`: the layer stack's depth and, per leaf, whether it is in the stack.
    """
    treedef = jax.tree.structure(params)
    theta = [jnp.broadcast_to(x, (R, *x.shape)) for x in jax.tree.leaves(params)]
    opt_state = jax.vmap(lambda p: inner_opt.init(jax.tree.unflatten(treedef, p)))(theta)
    global_params = [jnp.asarray(x) for x in jax.tree.leaves(params)]
    momentum = [jnp.zeros_like(x) for x in global_params]
    masks = group_masks(params, P, depth, in_stack, pattern=pattern)
    inner = replica_inner_steps(treedef, inner_opt, grad_fn)

    losses = []
    for step in range(steps):
        t = step + 1
        theta, opt_state, loss = inner(theta, opt_state, batches(step))
        losses.append(np.asarray(loss))
        synced = schedule.synced_fragment(t, H, P)
        if synced is not None:
            mask = masks[synced]
            delta = [g - jnp.mean(r, axis=0) for g, r in zip(global_params, theta)]
            momentum = [jnp.where(k, mu * v + d, v) for k, v, d in zip(mask, momentum, delta)]
            direction = [d + mu * v if nesterov else v for d, v in zip(delta, momentum)]
            global_params = [jnp.where(k, g - lr * u, g) for k, g, u in zip(mask, global_params, direction)]
        applied = schedule.applied_fragment(t, H, P, tau)
        if applied is not None:
            mask = masks[applied]
            theta = [jnp.where(jnp.broadcast_to(k, r.shape), alpha * r + (1 - alpha) * jnp.broadcast_to(g, r.shape), r)
                     for k, r, g in zip(mask, theta, global_params)]
    return np.stack(losses), theta, global_params
