"""Small PyTree utilities shared by the inner step and the outer sync."""

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool

PyTree = Any


def all_finite(tree: PyTree) -> Bool[Array, ""]:
    """Whether every element of every leaf of `tree` is finite (a scalar bool; True for no leaves)."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.bool_(True)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def row_finite(tree: PyTree) -> Bool[Array, " R"]:
    """Per row of the leading axis: whether every element of that row of every leaf is finite.

    Reduces only within rows, so leaves sharded by row (per-replica values) need no
    cross-device communication.
    """
    rows = [jnp.all(jnp.isfinite(x.reshape(x.shape[0], -1)), axis=1) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(rows), axis=0)


def squeeze_replica(tree: PyTree) -> PyTree:
    """Drop the local replica axis (of length 1) that every leaf carries inside a shard_map body."""
    return jax.tree.map(lambda x: x[0], tree)


def unsqueeze_replica(tree: PyTree) -> PyTree:
    """Add back the local replica axis of length 1."""
    return jax.tree.map(lambda x: x[None], tree)


def broadcast_replicas(tree: PyTree, num_replicas: int) -> PyTree:
    """Every leaf repeated along a new leading replica axis."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (num_replicas, *x.shape)), tree)
