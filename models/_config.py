"""The model's shape, shared by the dense and mixture-of-experts blocks (no model code here)."""

import dataclasses
from pathlib import Path
from typing import Literal

Dtype = Literal["auto", "float32", "bfloat16"]
AttentionImpl = Literal["auto", "xla", "cudnn"]
Remat = Literal["none", "block", "dots"]
MlpKind = Literal["gelu", "swiglu"]
ScanUnroll = int | Literal["auto"]

# `scan_unroll="auto"` unrolls stacks up to this depth. On CPU an unrolled stack stepped 1.28-1.56x
# faster than the rolled scan at 2 to 24 layers; it compiled within 1.04x of the rolled scan's time
# up to 6 layers, 1.15-1.5x at 12 and 2.0-2.2x at 24 (benchmarks/scan_unroll.py). Deeper stacks keep
# the rolled scan, whose compile time is flat in depth.
AUTO_UNROLL_MAX_LAYERS = 16


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Shape of the model."""

    vocab_size: int = 256
    """number of token ids (256 for the byte-level tokenizer)."""
    num_layers: int = 6
    """number of blocks in the stack."""
    dim: int = 128
    """width of the residual stream."""
    num_heads: int = 4
    """attention heads; must divide `dim`."""
    mlp_ratio: int = 4
    """hidden width of the feed-forward block as a multiple of `dim` (unless `ffn_dim` is set)."""
    ffn_dim: int | None = None
    """hidden width of the feed-forward block (Llama's `intermediate_size`); None = `mlp_ratio * dim`. Dense blocks only."""
    mlp: MlpKind = "gelu"
    """feed-forward block of the dense layout: `gelu` (two matrices, GELU) or `swiglu` (Llama's: `down(silu(gate(x)) * up(x))`, three matrices)."""
    num_kv_heads: int | None = None
    """key/value heads (grouped-query attention: each serves `num_heads / num_kv_heads` query heads, so it must divide `num_heads`); None = `num_heads` (plain multi-head attention)."""
    qkv_bias: bool = False
    """learned biases on the query, key and value projections (Qwen2's layout)."""
    norm_eps: float = 1e-6
    """epsilon added to the mean square in every RMSNorm (Llama's `rms_norm_eps`)."""
    tie_embeddings: bool = False
    """reuse the token embedding as the output head."""
    dropout: float = 0.0
    """dropout rate on each block's residual branches (0 disables it)."""
    rope_base: float = 10000.0
    """base of the rotary position embedding frequencies."""
    kind: Literal["dense", "moe"] = "dense"
    """`dense` feed-forward blocks or `moe` (mixture of experts)."""
    num_experts: int = 4
    """experts per MoE block (`kind=moe` only)."""
    top_k: int = 2
    """experts each token is routed to (`kind=moe` only; 1 or 2)."""
    aux_loss_weight: float = 0.01
    """weight of the MoE load-balancing loss in the training loss."""
    dtype: Dtype = "auto"
    """compute dtype of matmuls and activations: `bfloat16` or `float32`; `auto` = bfloat16 on GPU and TPU, float32 on CPU. Parameters (so optimizer state and DiLoCo's outer state) stay float32 and are cast at use; norm statistics, softmax, the logits' log-softmax and the loss run in float32."""
    attention: AttentionImpl = "auto"
    """attention kernel, `jax.nn.dot_product_attention(..., is_causal=True)`: `xla` (any backend), `cudnn` (cuDNN flash attention: NVIDIA GPUs with a bfloat16 compute dtype and a head dim <= 128 and a multiple of 8) or `auto` (cudnn where it can run, xla elsewhere)."""
    scan_unroll: ScanUnroll = "auto"
    """layers applied per iteration of the `jax.lax.scan` over the stacked blocks: an int >= 1, 0 = all layers (fully unrolled), or `auto` = all layers for stacks of up to 16 layers, 1 above (see `layers_per_iteration`). The stack stays stored stacked either way. Unrolled, XLA schedules and fuses across layers and drops the loop's per-layer slicing and copies: faster steps on CPU and GPU; a rolled scan (1) keeps compile time flat in depth."""
    init_from: Path | None = None
    """a local Hugging Face model folder (Llama, Mistral or Qwen2 layout, safetensors) whose weights the run starts from: every replica and the global model. Its config.json gives the model's shape. Read by the trainer (`eqx_diloco.lm.hf`); `Transformer` itself always initialises randomly."""
    remat: Remat = "none"
    """rematerialisation of each block in the backward pass (`jax.checkpoint` around the scanned block): `none` saves every activation (fastest; fine while activations fit), `block` saves only each block's input and recomputes the rest (least memory, about one more forward pass of compute), `dots` saves the matmul outputs and recomputes the elementwise work in between."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def kv_heads(self) -> int:
        """The resolved `num_kv_heads` (`num_heads` when unset)."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def ffn_hidden(self) -> int:
        """The resolved hidden width of a dense feed-forward block (`ffn_dim`, else `mlp_ratio * dim`)."""
        return self.mlp_ratio * self.dim if self.ffn_dim is None else self.ffn_dim

    def compute_dtype(self):
        """The resolved compute dtype (a `jnp.dtype`): `auto` asks JAX for its default backend."""
        import jax
        import jax.numpy as jnp

        if self.dtype == "auto":
            return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
        return jnp.dtype(self.dtype)

    def layers_per_iteration(self) -> int:
        """The resolved `scan_unroll`: how many layers one iteration of the scan applies (1 to
        `num_layers`; `num_layers` is fully unrolled)."""
        unroll = self.scan_unroll
        if unroll == "auto":
            unroll = 0 if self.num_layers <= AUTO_UNROLL_MAX_LAYERS else 1
        return self.num_layers if unroll == 0 else min(unroll, self.num_layers)

    def attention_impl(self) -> Literal["xla", "cudnn"]:
        """The resolved attention kernel; `cudnn` asked for where it cannot run raises `ValueError`
        (the CLI checks the same rule first, see `attention_rule`)."""
        import jax

        problem = attention_rule(self, cudnn_backend(jax.devices()[0]), str(self.compute_dtype()))
        if self.attention == "auto":
            return "xla" if problem else "cudnn"
        if self.attention == "cudnn" and problem:
            raise ValueError(f"attention='cudnn' {problem}")
        return self.attention

    def num_params(self) -> int:
        """Parameters of `Transformer(self)`, from the shapes alone (all float32; equal to the
        model's array count, tested), so a size can be stated without building anything."""
        d, kv = self.dim, self.kv_heads * self.head_dim
        attention = 2 * d * d + 2 * d * kv + (d + 2 * kv if self.qkv_bias else 0)  # q and out; k and v; biases
        if self.kind == "moe":
            ffn = d * self.num_experts + 2 * self.num_experts * d * self.mlp_ratio * d
        else:
            ffn = (3 if self.mlp == "swiglu" else 2) * d * self.ffn_hidden
        block = 2 * d + attention + ffn  # two RMSNorm weights
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.num_layers * block + d + head


def cudnn_backend(device) -> bool:
    """Whether `device` is an NVIDIA GPU (cuDNN present), not a CPU, a TPU or a ROCm GPU."""
    if device.platform not in ("gpu", "cuda"):
        return False
    version = getattr(device.client, "platform_version", "") or ""
    return "rocm" not in version.lower()


def attention_rule(config: TransformerConfig, nvidia_gpu: bool, dtype: str) -> str | None:
    """Why cuDNN flash attention cannot run this model (a phrase), or None when it can.

    `nvidia_gpu`: the backend is an NVIDIA GPU; `dtype`: the resolved compute dtype's name."""
    if not nvidia_gpu:
        return "needs an NVIDIA GPU (cuDNN); use xla or auto elsewhere"
    if dtype not in ("bfloat16", "float16"):
        return f"needs a bfloat16 compute dtype (got {dtype}); use xla or auto for float32"
    head_dim = config.dim // config.num_heads
    if head_dim > 128 or head_dim % 8:
        return f"needs a head dim <= 128 and a multiple of 8 (got {head_dim}); use xla or auto"
    return None


def layout_rule(config: TransformerConfig) -> tuple[str, str] | None:
    """(field, why) for the first rule of the attention / feed-forward layout `config` breaks, or None.

    The CLI checks the same rules first with its flags' names (`eqx_diloco.lm.config.validate`)."""
    if config.num_kv_heads is not None and not (
        config.num_kv_heads >= 1 and config.num_heads % config.num_kv_heads == 0
    ):
        return "num_kv_heads", f"must divide num_heads (got {config.num_kv_heads} and {config.num_heads})"
    if config.ffn_dim is not None and config.ffn_dim < 1:
        return "ffn_dim", f"must be >= 1 (got {config.ffn_dim})"
    if config.kind == "moe" and config.mlp != "gelu":
        return "mlp", f"{config.mlp} applies to kind='dense' (MoE experts are GELU)"
    if config.kind == "moe" and config.ffn_dim is not None:
        return "ffn_dim", "applies to kind='dense' (MoE experts are mlp_ratio * dim wide)"
    if not config.norm_eps > 0 or config.norm_eps == float("inf"):
        return "norm_eps", f"must be a finite number > 0 (got {config.norm_eps})"
    return None
