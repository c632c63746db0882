"""Diagnostics of how replicas drift apart between syncs."""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float


def router_drift(params, router_flags: tuple[bool, ...]) -> Float[Array, ""]:
    """Mean cosine distance between replicas' MoE router weights, per layer and replica pair.

    **Arguments:**

    - `params`: the replicas' models (every leaf with a leading replica axis R).
    - `router_flags`: per leaf of `params` (flatten order), whether it is a router leaf
      (`Transformer.router_mask()`); router leaves have shape (R, layers, ...).

    0 means every replica routes with the same weights; 1 means orthogonal weights.
    """
    distances = []
    for x, is_router in zip(jax.tree.leaves(params), router_flags):
        if not is_router:
            continue
        R, layers = x.shape[:2]
        if R < 2:
            return jnp.float32(0.0)
        v = x.reshape(R, layers, -1)
        v = v / jnp.maximum(jnp.linalg.norm(v, axis=-1, keepdims=True), 1e-12)
        cos = jnp.einsum("rln,sln->lrs", v, v)
        i, j = np.triu_indices(R, 1)
        distances.append(jnp.mean(1.0 - cos[:, i, j]))
    return jnp.mean(jnp.stack(distances))
