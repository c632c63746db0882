"""A decoder-only transformer whose blocks live in one stacked module.

Every array leaf of `Transformer.blocks` has a leading layer axis of size `num_layers`.
The stack is built with `eqx.filter_vmap` and applied with `jax.lax.scan`, so compile
time does not grow with depth, and code that needs "layers 3 and 7" (fragments of
Streaming DiLoCo) slices arrays instead of walking a Python list.

How it runs is set by four `TransformerConfig` fields that do not change the parameters:
`dtype` (the compute dtype; parameters stay float32 and are cast where they are used),
`attention` (the `jax.nn.dot_product_attention` kernel), `scan_unroll` (layers per scan
iteration) and `remat` (what the backward pass saves of each block).
"""

import math
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ._config import TransformerConfig, layout_rule
from ._norm import RMSNorm
from .moe import MoE


def _normal(key: PRNGKeyArray, shape: tuple[int, ...], std: float) -> Array:
    return std * jax.random.normal(key, shape, jnp.float32)


def _dropout(x: Array, rate: float, key: PRNGKeyArray | None) -> Array:
    if rate == 0.0 or key is None:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def rotary_tables(seq_len: int, head_dim: int, base: float) -> tuple[Array, Array]:
    """cos and sin tables of shape (seq_len, head_dim // 2) for rotary embeddings."""
    inv_freq = 1.0 / (base ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(
    x: Float[Array, "seq heads head_dim"], cos: Float[Array, "seq half"], sin: Float[Array, "seq half"]
) -> Float[Array, "seq heads head_dim"]:
    """Rotate channel pairs (i, i + head_dim/2) by position-dependent angles (in float32; the
    result has `x`'s dtype)."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


def _checkpointed(fn, remat: str):
    """`fn` wrapped in `jax.checkpoint` for `TransformerConfig.remat` (`none` returns it as is)."""
    if remat == "none":
        return fn
    policies = {
        "block": jax.checkpoint_policies.nothing_saveable,
        # Saves the projections' outputs but not the attention's per-head (batched) score matmuls,
        # whose (T, T) outputs are what fills memory.
        "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    }
    return jax.checkpoint(fn, policy=policies[remat], prevent_cse=False)


class Attention(eqx.Module):
    """Causal self-attention with rotary position embeddings and, when `num_kv_heads <
    num_heads`, grouped-query attention (query head h reads key/value head
    h // (num_heads / num_kv_heads), as Llama does).

    **Arguments:**

    - `config`: a `TransformerConfig`; uses `dim`, `num_heads`, `num_kv_heads`, `qkv_bias` and
      `num_layers`.
    - `key`: a JAX PRNG key (keyword-only).

    Calling it with `x` of shape `(seq, dim)` runs in `x`'s dtype (the weights are cast to
    it); the scores and their softmax are float32 inside `jax.nn.dot_product_attention`,
    which applies the causal mask without building a float (T, T) mask and reads each key/value
    head once per group of query heads (no repeated copies).
    """

    q: Float[Array, "dim dim"]
    k: Float[Array, "dim kv_dim"]
    v: Float[Array, "dim kv_dim"]
    out: Float[Array, "dim dim"]
    q_bias: Float[Array, " dim"] | None
    k_bias: Float[Array, " kv_dim"] | None
    v_bias: Float[Array, " kv_dim"] | None
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)

    def __init__(self, config: TransformerConfig, *, key: PRNGKeyArray):
        kq, kk, kv, k2 = jax.random.split(key, 4)
        kv_dim = config.kv_heads * config.head_dim
        # Separate projections, not one fused matrix: split by columns over a tensor axis, each
        # device then holds whole heads of q, k and v alike.
        self.q = _normal(kq, (config.dim, config.dim), 0.02)
        self.k, self.v = (_normal(k, (config.dim, kv_dim), 0.02) for k in (kk, kv))
        # Residual-branch outputs are scaled down with depth so the stream's variance stays flat.
        self.out = _normal(k2, (config.dim, config.dim), 0.02 / math.sqrt(2 * config.num_layers))
        biases = (jnp.zeros((n,), jnp.float32) if config.qkv_bias else None for n in (config.dim, kv_dim, kv_dim))
        self.q_bias, self.k_bias, self.v_bias = biases
        self.num_heads, self.num_kv_heads = config.num_heads, config.kv_heads

    def __call__(
        self,
        x: Float[Array, "seq dim"],
        cos: Float[Array, "seq half"],
        sin: Float[Array, "seq half"],
        *,
        implementation: Literal["xla", "cudnn"] = "xla",
    ) -> Float[Array, "seq dim"]:
        """`implementation`: the `jax.nn.dot_product_attention` kernel (`cudnn` needs an NVIDIA
        GPU and a bfloat16 `x`)."""
        seq, dim = x.shape
        head_dim = dim // self.num_heads
        q, k, v = (x @ w.astype(x.dtype) for w in (self.q, self.k, self.v))
        if self.q_bias is not None:  # broadcast_to is explicit: rank promotion is an error in tests
            q, k, v = (t + jnp.broadcast_to(b.astype(x.dtype), t.shape)
                       for t, b in ((q, self.q_bias), (k, self.k_bias), (v, self.v_bias)))
        q = q.reshape(seq, self.num_heads, head_dim)
        k, v = (t.reshape(seq, self.num_kv_heads, head_dim) for t in (k, v))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
        return out.reshape(seq, dim) @ self.out.astype(x.dtype)


class MLP(eqx.Module):
    """Two-layer GELU feed-forward block. Returns its output and an empty aux dict.

    **Arguments:**

    - `config`: a `TransformerConfig`; uses `dim`, `ffn_dim` (else `mlp_ratio`) and `num_layers`.
    - `key`: a JAX PRNG key (keyword-only).

    Runs in its input's dtype (the float32 weights are cast to it).
    """

    up: Float[Array, "dim hidden"]
    down: Float[Array, "hidden dim"]

    def __init__(self, config: TransformerConfig, *, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        hidden = config.ffn_hidden
        self.up = _normal(k1, (config.dim, hidden), 0.02)
        self.down = _normal(k2, (hidden, config.dim), 0.02 / math.sqrt(2 * config.num_layers))

    def __call__(self, x: Float[Array, "seq dim"]) -> tuple[Float[Array, "seq dim"], dict[str, Array]]:
        return jax.nn.gelu(x @ self.up.astype(x.dtype)) @ self.down.astype(x.dtype), {}


class SwiGLU(eqx.Module):
    """Llama's gated feed-forward block, `down(silu(x @ gate) * (x @ up))`. Returns its output and
    an empty aux dict.

    **Arguments:**

    - `config`: a `TransformerConfig`; uses `dim`, `ffn_dim` (else `mlp_ratio`) and `num_layers`.
    - `key`: a JAX PRNG key (keyword-only).

    Runs in its input's dtype (the float32 weights are cast to it).
    """

    gate: Float[Array, "dim hidden"]
    up: Float[Array, "dim hidden"]
    down: Float[Array, "hidden dim"]

    def __init__(self, config: TransformerConfig, *, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        hidden = config.ffn_hidden
        self.gate = _normal(k1, (config.dim, hidden), 0.02)
        self.up = _normal(k2, (config.dim, hidden), 0.02)
        self.down = _normal(k3, (hidden, config.dim), 0.02 / math.sqrt(2 * config.num_layers))

    def __call__(self, x: Float[Array, "seq dim"]) -> tuple[Float[Array, "seq dim"], dict[str, Array]]:
        gated = jax.nn.silu(x @ self.gate.astype(x.dtype)) * (x @ self.up.astype(x.dtype))
        return gated @ self.down.astype(x.dtype), {}


def make_ffn(config: TransformerConfig, *, key: PRNGKeyArray) -> "MLP | SwiGLU | MoE":
    if config.kind == "moe":
        return MoE(config, key=key)
    return SwiGLU(config, key=key) if config.mlp == "swiglu" else MLP(config, key=key)


class Block(eqx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + ffn(norm(x)).

    **Arguments:**

    - `config`: a `TransformerConfig` (`kind` and `mlp` pick `MLP`, `SwiGLU` or `MoE` as the
      feed-forward block).
    - `key`: a JAX PRNG key (keyword-only).
    """

    attn_norm: RMSNorm
    attn: Attention
    ffn_norm: RMSNorm
    ffn: "MLP | SwiGLU | MoE"
    dropout: float = eqx.field(static=True)

    def __init__(self, config: TransformerConfig, *, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attn = Attention(config, key=k1)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn = make_ffn(config, key=k2)
        self.dropout = config.dropout

    def __call__(
        self,
        x: Float[Array, "seq dim"],
        cos: Float[Array, "seq half"],
        sin: Float[Array, "seq half"],
        *,
        key: PRNGKeyArray | None = None,
        attention: Literal["xla", "cudnn"] = "xla",
    ) -> tuple[Float[Array, "seq dim"], dict[str, Array]]:
        """`key`: dropout's key (None: no dropout); `attention`: the attention kernel."""
        k1, k2 = (None, None) if key is None else jax.random.split(key)
        x = x + _dropout(self.attn(self.attn_norm(x), cos, sin, implementation=attention), self.dropout, k1)
        y, aux = self.ffn(self.ffn_norm(x))
        return x + _dropout(y, self.dropout, k2), aux


class Transformer(eqx.Module):
    """Decoder-only language model.

    **Arguments:**

    - `config`: a `TransformerConfig`.
    - `key`: a JAX PRNG key for the initial weights (keyword-only).

    `blocks` is one `Block` whose array leaves carry a leading layer axis (pass
    `layers=lambda m: m.blocks` to `DiLoCo` so its fragments slice that axis). `router_mask`
    marks, inside a block, the leaves that belong to an MoE router (none for dense models).

    Parameters are float32 whatever `config.dtype` says: `apply` casts each weight to the
    compute dtype where it is used, so optimizer state and DiLoCo's outer state stay float32.
    The logits come out float32 (computed in the compute dtype, as PyTorch's autocast and MaxText
    do, then cast up for the log-softmax and the loss)."""

    embed: Float[Array, "vocab dim"]
    blocks: Block
    final_norm: RMSNorm
    head: Float[Array, "dim vocab"] | None
    config: TransformerConfig = eqx.field(static=True)

    def __init__(self, config: TransformerConfig, *, key: PRNGKeyArray):
        problem = layout_rule(config)
        if problem is not None:
            raise ValueError(f"TransformerConfig.{problem[0]} {problem[1]}")
        k_embed, k_blocks, k_head = jax.random.split(key, 3)
        self.config = config
        self.embed = _normal(k_embed, (config.vocab_size, config.dim), 0.02)
        block_keys = jax.random.split(k_blocks, config.num_layers)
        self.blocks = eqx.filter_vmap(lambda k: Block(config, key=k))(block_keys)
        self.final_norm = RMSNorm(config.dim, config.norm_eps)
        self.head = None if config.tie_embeddings else _normal(k_head, (config.dim, config.vocab_size), 0.02)

    def apply(
        self, tokens: Int[Array, " seq"], *, key: PRNGKeyArray | None = None
    ) -> tuple[Float[Array, "seq vocab"], dict[str, Array]]:
        """Float32 logits for one sequence, plus per-layer auxiliary outputs stacked on axis 0.

        `key`: dropout's key (None: no dropout)."""
        config = self.config
        dtype, attention = config.compute_dtype(), config.attention_impl()
        cos, sin = rotary_tables(tokens.shape[0], config.head_dim, config.rope_base)
        x = self.embed[tokens].astype(dtype)
        params, static = eqx.partition(self.blocks, eqx.is_array)
        layer_keys = None if key is None else jax.random.split(key, config.num_layers)

        def layer(x, inputs):
            block_params, layer_key = inputs
            block = eqx.combine(block_params, static)
            return block(x, cos, sin, key=layer_key, attention=attention)

        x, aux = jax.lax.scan(_checkpointed(layer, config.remat), x, (params, layer_keys),
                              unroll=config.layers_per_iteration())
        x = self.final_norm(x)
        head = self.embed.T if self.head is None else self.head
        # Logits in the compute dtype (their gradient matmuls too), cast up to float32 for the log-softmax.
        return (x @ head.astype(dtype)).astype(jnp.float32), aux

    def __call__(self, tokens: Int[Array, " seq"], *, key: PRNGKeyArray | None = None) -> Float[Array, "seq vocab"]:
        """Logits of shape (seq, vocab) for a sequence of token ids of shape (seq,)."""
        return self.apply(tokens, key=key)[0]

    def router_mask(self) -> "Transformer":
        """A tree of bools: True for MoE router parameters (fields a module lists in `router_fields`)."""

        def mark(node):
            fields = getattr(type(node), "router_fields", None)
            if fields is None:
                return jax.tree.map(lambda _: False, node)
            falses = jax.tree.map(lambda _: False, node)
            return eqx.tree_at(
                lambda m: [getattr(m, f) for f in fields], falses, replace_fn=lambda sub: jax.tree.map(lambda _: True, sub)
            )

        return jax.tree.map(mark, self, is_leaf=lambda n: hasattr(type(n), "router_fields"))

    def tensor_specs(self, axis: str = "tensor") -> "Transformer":
        """Tensor-parallel rules (Megatron's layout): a tree like the model with a PartitionSpec per array.

        The attention's q, k and v projections and the MLP's up (and SwiGLU's gate) projections
        are split by output columns over `axis` and their partners (the attention output, the
        MLP's down projection) by input rows, so each device holds whole heads (when `num_heads`
        and `num_kv_heads` are divisible by the axis size) and a block needs one reduction of its output. MoE experts are split over `axis` (whole
        experts per device; `num_experts` must be divisible by the axis size). The head is
        split over the vocabulary; the embedding table, norms and routers are replicated.
        Dimensions left free can take FSDP on top (`eqx_diloco.fsdp_specs(..., base=...)`).
        """
        specs = jax.tree.map(lambda _: PartitionSpec(), self)
        columns, rows = PartitionSpec(None, None, axis), PartitionSpec(None, axis)  # after the layer axis
        blocks = specs.blocks
        blocks = eqx.tree_at(lambda b: (b.attn.q, b.attn.k, b.attn.v, b.attn.out), blocks,
                             (columns, columns, columns, rows))
        if self.blocks.attn.q_bias is not None:  # split with their projections' columns
            blocks = eqx.tree_at(lambda b: (b.attn.q_bias, b.attn.k_bias, b.attn.v_bias), blocks, (rows, rows, rows))
        if isinstance(self.blocks.ffn, MoE):
            blocks = eqx.tree_at(lambda b: (b.ffn.up, b.ffn.down), blocks, (rows, rows))  # the expert axis
        else:
            blocks = eqx.tree_at(lambda b: (b.ffn.up, b.ffn.down), blocks, (columns, rows))
            if isinstance(self.blocks.ffn, SwiGLU):
                blocks = eqx.tree_at(lambda b: b.ffn.gate, blocks, columns)
        specs = eqx.tree_at(lambda m: m.blocks, specs, blocks)
        if self.head is not None:
            specs = eqx.tree_at(lambda m: m.head, specs, PartitionSpec(None, axis))
        return specs

    def weight_decay_mask(self) -> "Transformer":
        """A tree of bools: True for matrices that weight decay should shrink, False for norms and biases."""
        mask = jax.tree.map(lambda _: True, self)
        mask = jax.tree.map(
            lambda m: jax.tree.map(lambda _: False, m) if isinstance(m, RMSNorm) else m,
            mask,
            is_leaf=lambda m: isinstance(m, RMSNorm),
        )
        if self.blocks.attn.q_bias is None:
            return mask
        return eqx.tree_at(lambda m: (m.blocks.attn.q_bias, m.blocks.attn.k_bias, m.blocks.attn.v_bias), mask,
                           (False, False, False))


def lm_loss(
    model: Transformer, tokens: Int[Array, "batch seq_plus_one"], *, key: PRNGKeyArray | None = None
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """Mean next-token cross entropy over a batch, plus weighted auxiliary losses.

    Returns `(loss, aux)` where `aux["ce"]` is the plain cross entropy and `aux` also holds
    the model's per-layer auxiliary outputs averaged over the batch.
    """
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    keys = None if key is None else jax.random.split(key, tokens.shape[0])
    logits, aux = jax.vmap(lambda t, k: model.apply(t, key=k))(inputs, keys)
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    ce = -jnp.mean(jnp.take_along_axis(logprobs, targets[..., None], axis=-1))
    aux = jax.tree.map(lambda a: jnp.mean(a, axis=0), aux)
    loss = ce
    if "load_balance_loss" in aux:
        loss = loss + model.config.aux_loss_weight * jnp.sum(aux["load_balance_loss"])
    return loss, {"ce": ce, **aux}
