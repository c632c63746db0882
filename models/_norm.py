import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


class RMSNorm(eqx.Module):
    """Root-mean-square layer norm with a learned per-channel gain.

    **Arguments:**

    - `dim`: the size of the channel (last) axis.
    - `eps`: added to the mean square before the reciprocal square root.
    """

    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, eps: float = 1e-6):
        self.weight = jnp.ones((dim,), jnp.float32)
        self.eps = eps

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        """Normalised `x`, computed in float32 and returned in `x`'s dtype."""
        xf = x.astype(jnp.float32)
        scale = jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + self.eps)
        # broadcast_to is explicit: rank promotion is an error in tests
        out = xf * scale * jnp.broadcast_to(self.weight.astype(jnp.float32), x.shape)
        return out.astype(x.dtype)
