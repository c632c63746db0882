"""The model's shape, shared by the dense and mixture-of-experts blocks (no model code here)."""

import dataclasses
from typing import Literal


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
    """hidden width of the feed-forward block as a multiple of `dim`."""
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

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    def num_params(self) -> int:
        """Parameters of `Transformer(self)`, from the shapes alone (all float32; equal to the
        model's array count, tested), so a size can be stated without building anything."""
        d, hidden = self.dim, self.mlp_ratio * self.dim
        attention = d * 3 * d + d * d
        if self.kind == "moe":
            ffn = d * self.num_experts + 2 * self.num_experts * d * hidden
        else:
            ffn = 2 * d * hidden
        block = 2 * d + attention + ffn  # two RMSNorm weights
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.num_layers * block + d + head
