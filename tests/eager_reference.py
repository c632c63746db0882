"""Delayed and eager outer updates (arXiv 2502.12996) written straight from the equations.

A jax.vmap over replicas; no shard_map, no fragments module, no optax outer optimizer (the
Nesterov momentum is written out), float32 exchanges. Per group g synced at its round k:

    Delta_m   = a_m - theta_m                        (fresh outer gradient of replica m)
    Dbar      = mean_r Delta_r of the previous round of g   (0 at the first round)
    delayed:  a <- NesterovSGD(a, Dbar)              (one shared anchor)
    eager:    a_m <- NesterovSGD_m(a_m, Delta_m / R + Dbar - Delta_m(prev) / R)
    theta_m[g] <- a_m[g];  the exchange of this round's Delta's goes in flight.

With `drain` (the trainer's final sync), after the last step every group whose last sync is
older than it takes one more outer step as above; then every group's last exchange lands:
the remainder no step used (eager: Dbar - Delta_m / R; delayed: Dbar) amends the last outer
step, which for Nesterov SGD means a -= lr (1 + mu) rem, and theta_m[g] <- a_m[g].
"""

import jax
import jax.numpy as jnp
import numpy as np

from eqx_diloco import schedule


def group_masks(params, num_fragments: int, depth: int, in_stack, pattern: str = "strided") -> list:
    """Per group, a list (flatten order) of boolean arrays marking that group's elements: group 0
    holds every leaf outside the stack, groups 1..P-1 the layers dealt `strided` (layer l to group
    1 + l % (P - 1)) or `sequential` (consecutive runs of depth / (P - 1) layers)."""
    groups = max(num_fragments - 1, 1)
    leaves = jax.tree.leaves(params)
    masks = []
    for g in range(num_fragments):
        mask = []
        for x, stacked in zip(leaves, in_stack):
            if num_fragments == 1:
                mask.append(np.ones(x.shape, bool))
            elif not stacked:
                mask.append(np.full(x.shape, g == 0))
            else:
                dealt = [layer % groups if pattern == "strided" else layer // (depth // groups)
                         for layer in range(depth)]
                layers = np.array([d == g - 1 for d in dealt])
                mask.append(np.broadcast_to(layers.reshape((depth,) + (1,) * (x.ndim - 1)), x.shape))
        masks.append(mask)
    return masks


def replica_inner_steps(treedef, inner_opt, grad_fn):
    """One inner step of every replica: a jitted vmap over flat leaf lists with a leading R axis,
    `(params, opt_state, batch) -> (params, opt_state, loss)`."""

    @jax.jit
    @jax.vmap
    def inner(p, o, batch):
        loss, grads = grad_fn(jax.tree.unflatten(treedef, p), batch)
        with jax.numpy_dtype_promotion("standard"):
            updates, o = inner_opt.update(grads, o, jax.tree.unflatten(treedef, p))
        return [a + b for a, b in zip(p, jax.tree.leaves(updates))], o, loss

    return inner


def reference_overlapped(mode, params, *, inner_opt, grad_fn, batches, R, H, P, lr, mu, depth, in_stack, steps,
                         drain=False):
    """Losses (steps, R) and the final (replica params, anchors) as flat leaf lists with a leading R axis."""
    theta = [jnp.broadcast_to(x, (R, *x.shape)) for x in jax.tree.leaves(params)]
    treedef = jax.tree.structure(params)
    opt_state = jax.vmap(lambda p: inner_opt.init(jax.tree.unflatten(treedef, p)))(theta)
    anchor = [jnp.array(x) for x in theta]  # eager: per replica; delayed: all rows equal
    momentum = [jnp.zeros_like(x) for x in theta]
    masks = group_masks(params, P, depth, in_stack)
    in_flight = {}  # group -> (mean Delta over replicas, each replica's own Delta), per leaf
    inner = replica_inner_steps(treedef, inner_opt, grad_fn)

    def sync(g, theta, anchor, momentum):
        delta = [a - x for a, x in zip(anchor, theta)]
        zeros = ([jnp.zeros_like(d[0]) for d in delta], [jnp.zeros_like(d) for d in delta])
        mean_prev, own_prev = in_flight.get(g, zeros)
        if mode == "eager":
            grad = [d / R + (jnp.broadcast_to(m, d.shape) - o / R) for d, m, o in zip(delta, mean_prev, own_prev)]
        else:
            grad = [jnp.broadcast_to(m, d.shape) for d, m in zip(delta, mean_prev)]
        new_momentum = [mu * v + gr for v, gr in zip(momentum, grad)]
        new_anchor = [a - lr * (gr + mu * v) for a, gr, v in zip(anchor, grad, new_momentum)]
        mask = masks[g]
        momentum = [jnp.where(k, v1, v0) for k, v1, v0 in zip(mask, new_momentum, momentum)]
        anchor = [jnp.where(k, a1, a0) for k, a1, a0 in zip(mask, new_anchor, anchor)]
        theta = [jnp.where(k, a, x) for k, a, x in zip(mask, anchor, theta)]
        in_flight[g] = ([jnp.mean(d, axis=0) for d in delta], delta)
        return theta, anchor, momentum

    losses, last_sync = [], {}
    for step in range(steps):
        theta, opt_state, loss = inner(theta, opt_state, batches(step))
        losses.append(np.asarray(loss))
        g = schedule.synced_fragment(step + 1, H, P)
        if g is not None:
            theta, anchor, momentum = sync(g, theta, anchor, momentum)
            last_sync[g] = step + 1
    if drain:
        for g in range(P):  # the final sync: groups with inner steps after their last sync step once more
            if last_sync.get(g, 0) < steps:
                theta, anchor, momentum = sync(g, theta, anchor, momentum)
        for g, (mean, own) in sorted(in_flight.items()):
            rem = [jnp.broadcast_to(m, o.shape) - (o / R if mode == "eager" else 0) for m, o in zip(mean, own)]
            new_anchor = [a - lr * (1 + mu) * r for a, r in zip(anchor, rem)]
            anchor = [jnp.where(k, a1, a0) for k, a1, a0 in zip(masks[g], new_anchor, anchor)]
            theta = [jnp.where(k, a, x) for k, a, x in zip(masks[g], anchor, theta)]
    return np.stack(losses), theta, anchor
