"""Checksums of array leaves, computed where the arrays live, to verify a checkpoint on restore."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any

_GOLDEN = np.uint32(0x9E3779B1)


def _leaf_checksum(x: jax.Array) -> jax.Array:
    """A position-weighted wrapping uint32 sum of the leaf's bits (order independent of sharding)."""
    x = jax.device_put(x, jax.memory.Space.Device)  # a leaf kept in host memory (outer_state_memory="host")
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    width = x.dtype.itemsize
    if width == 8:
        u = jax.lax.bitcast_convert_type(x, jnp.uint32)  # trailing axis of 2
    else:
        u = jax.lax.bitcast_convert_type(x, {4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}[width]).astype(jnp.uint32)
    u = u.reshape(-1)
    weights = jnp.arange(u.size, dtype=jnp.uint32) * _GOLDEN + np.uint32(1)  # odd: every change shows
    return jnp.sum(u * weights, dtype=jnp.uint32)


@jax.jit
def _checksums(leaves: list[jax.Array]) -> jax.Array:
    if not leaves:
        return jnp.zeros((0,), jnp.uint32)
    return jnp.stack([_leaf_checksum(x) for x in leaves])


def checksums(tree: PyTree) -> list[int]:
    """One uint32 checksum per array leaf of `tree` (computed where the arrays live)."""
    out = _checksums(jax.tree.leaves(tree))
    if not out.is_fully_addressable:  # multi-process: every process gets the global value
        from jax.experimental import multihost_utils

        out = multihost_utils.process_allgather(out, tiled=True)
    return [int(c) for c in np.asarray(out)]
