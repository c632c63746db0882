"""Mixture-of-experts feed-forward block, a drop-in replacement for `MLP`.

`MoE` is what `make_ffn` builds when `TransformerConfig.kind == "moe"`. Like `MLP` it maps
a `(seq, dim)` sequence to `(seq, dim)` and returns an aux dict alongside; here the dict
carries the load-balancing loss that `lm_loss` adds to the training loss and the per-expert
usage for diagnostics.
"""

import math
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ._config import TransformerConfig


def load_balance_loss(
    router_probs: Float[Array, "seq experts"], top1: Int[Array, " seq"]
) -> Float[Array, ""]:
    """Switch-Transformer load-balancing loss for one sequence.

    `num_experts * sum_e f_e * P_e`, where `f_e` is the fraction of tokens whose first
    choice is expert `e` and `P_e` is the mean router probability of `e`. It equals 1.0
    when either factor is uniform and grows to `num_experts` when every token goes to one
    expert with certainty. Gradients flow through `P_e` only (`f_e` is a count).
    """
    num_experts = router_probs.shape[-1]
    fraction = jnp.mean(jax.nn.one_hot(top1, num_experts, dtype=router_probs.dtype), axis=0)
    mean_prob = jnp.mean(router_probs, axis=0)
    return num_experts * jnp.sum(fraction * mean_prob)


def usage_entropy(usage: Float[Array, "... experts"]) -> Float[Array, "..."]:
    """Entropy (nats) of an expert-usage distribution, divided by `log(num_experts)`.

    1.0 means perfectly balanced usage, 0.0 means every assignment went to one expert.
    `usage` is normalized over its last axis first, so counts work as well as fractions.
    With a single expert the result is 1.0 (trivially balanced).
    """
    num_experts = usage.shape[-1]
    if num_experts == 1:
        return jnp.ones(usage.shape[:-1], usage.dtype)
    p = usage / jnp.sum(usage, axis=-1, keepdims=True)
    entropy = -jnp.sum(jax.scipy.special.xlogy(p, p), axis=-1)
    return entropy / math.log(num_experts)


class MoE(eqx.Module):
    """Top-k routed mixture of GELU experts.

    **Arguments:**

    - `config`: a `TransformerConfig`; uses `dim`, `mlp_ratio`, `num_layers`,
      `num_experts` and `top_k` (1 or 2).
    - `key`: a JAX PRNG key (keyword-only).

    Each token's router logits `x @ router` go through a softmax; the token is sent to its
    `top_k` most probable experts, weighted by their probabilities renormalized to sum to 1
    over the chosen experts. With `top_k=1` the weight is exactly 1.0, so an MoE whose
    experts all equal an `MLP` reproduces that `MLP`. (A consequence: with `top_k=1` the
    gate is constant and the router learns only from the load-balancing loss; with
    `top_k=2` the task loss also reaches it through the relative weights.)

    Computation is dropless and dense: every expert runs on every token (one einsum over
    the stacked expert weights) and the outputs are combined with the sparse gate matrix,
    which is zero outside each token's top-k. Nothing is dropped, there is no capacity
    factor and no Python loop over tokens or experts; the price is `num_experts` times the
    FLOPs of a dense MLP, which is fine for the small expert counts used here.

    The aux dict holds `load_balance_loss` (a scalar, see `load_balance_loss`) and
    `expert_usage`, of shape `(num_experts,)`: the fraction of the `seq * top_k` routed
    assignments that went to each expert (sums to 1).

    The experts run in the input's dtype (the float32 weights are cast to it); the router,
    its softmax and the load-balancing loss run in float32.

    `router_fields` names the fields that are router parameters, so that code treating the
    router specially finds its leaves without matching on names.
    """

    router: Float[Array, "dim experts"]
    up: Float[Array, "experts dim hidden"]
    down: Float[Array, "experts hidden dim"]
    top_k: int = eqx.field(static=True)
    num_experts: int = eqx.field(static=True)

    router_fields: ClassVar[tuple[str, ...]] = ("router",)

    def __init__(self, config: TransformerConfig, *, key: PRNGKeyArray):
        if config.top_k not in (1, 2):
            raise ValueError(f"top_k must be 1 or 2, got {config.top_k}")
        if config.top_k > config.num_experts:
            raise ValueError(f"top_k={config.top_k} exceeds num_experts={config.num_experts}")
        k_router, k_up, k_down = jax.random.split(key, 3)
        hidden = config.mlp_ratio * config.dim
        experts = config.num_experts
        self.router = 0.02 * jax.random.normal(k_router, (config.dim, experts), jnp.float32)
        self.up = 0.02 * jax.random.normal(k_up, (experts, config.dim, hidden), jnp.float32)
        down_std = 0.02 / math.sqrt(2 * config.num_layers)
        self.down = down_std * jax.random.normal(k_down, (experts, hidden, config.dim), jnp.float32)
        self.top_k = config.top_k
        self.num_experts = experts

    def route(
        self, x: Float[Array, "seq dim"]
    ) -> tuple[Float[Array, "seq experts"], Float[Array, "seq k"], Int[Array, "seq k"]]:
        """Router probabilities, renormalized top-k gate weights and the chosen expert ids."""
        logits = x.astype(jnp.float32) @ self.router.astype(jnp.float32)
        probs = jax.nn.softmax(logits, axis=-1)
        top_probs, top_idx = jax.lax.top_k(probs, self.top_k)
        if self.top_k == 1:
            # p / p is 1.0 in value but its gradient is round-off noise; use an exact constant.
            weights = jnp.ones_like(top_probs)
        else:
            weights = top_probs / jnp.sum(top_probs, axis=-1, keepdims=True)
        return probs, weights, top_idx

    def __call__(self, x: Float[Array, "seq dim"]) -> tuple[Float[Array, "seq dim"], dict[str, Array]]:
        probs, weights, top_idx = self.route(x)
        # (seq, k, experts) one-hot of each choice; never two equal experts per token.
        choice = jax.nn.one_hot(top_idx, self.num_experts, dtype=probs.dtype)
        gates = jnp.einsum("sk,ske->se", weights, choice)

        hidden = jax.nn.gelu(jnp.einsum("sd,edh->seh", x, self.up.astype(x.dtype)))
        expert_out = jnp.einsum("seh,ehd->sed", hidden, self.down.astype(x.dtype))
        y = jnp.einsum("se,sed->sd", gates.astype(expert_out.dtype), expert_out)

        usage = jnp.mean(jnp.sum(choice, axis=1), axis=0) / self.top_k
        aux = {
            "load_balance_loss": load_balance_loss(probs, top_idx[:, 0]),
            "expert_usage": usage,
        }
        return y, aux
