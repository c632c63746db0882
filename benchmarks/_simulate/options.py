"""The command line of `python -m benchmarks.simulate` (parsed by tyro) and the local model it describes."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Literal

from benchmarks._simulate.comm import ModelComm, paper_model, real_model


@dataclasses.dataclass
class Args:
    """Bandwidth needed for a compute utilization, per method (Streaming DiLoCo Table 4 style)."""

    paper_variants: tuple[str, ...] = ("32:0", "16:0.667")
    """Paper tables to print, each BITS:BACKWARD_FRACTION. BITS: bits per value of gradients / outer gradients
    (fp4 column: --fp4-bits). BACKWARD_FRACTION 0: payload released at the end of the step (our trainer);
    0.667: released layer by layer over the backward pass, taken as 2/3 of the step (the paper's assumption).
    "32:0" is float32 with end-of-step release; "16:0.667" (bf16, overlapped with backward) fits the paper."""
    fp4_bits: float = 4
    """Bits per value of the *_fp4 columns (streaming_overlap_fp4, eager_fp4, streaming_eager_fp4)."""
    paper_tau: int = 1
    """Overlap steps of streaming_overlap in the paper tables."""
    replicas: int = 2
    """Replicas R (ring all-reduce factor 2 (R - 1) / R)."""
    latency_s: float = 0.0
    """Fixed latency added to every transfer."""
    local: bool = True
    """Also simulate the local model."""
    local_config: LocalModel = dataclasses.field(default_factory=lambda: LocalModel())
    local_step_s: float = 0.15
    """Step time of the local model."""
    local_sync_every: int = 20
    """H of the local model."""
    local_fragments: int = 4
    """P of the local model (fragment 0 = embeddings, final norm, head)."""
    local_tau: int = 1
    """tau of the local model's streaming_overlap."""
    local_bits: float = 32
    """Bits per value of the local model (float32 params)."""
    local_backward_fraction: float = 0.0
    """Backward release fraction of the local model (0: our trainer syncs after the step)."""
    local_params: float | None = None
    """Use this parameter count instead of the real config: spread evenly over --local-config.num-layers,
    cut into --local-fragments strided layer groups (no separate embedding fragment, as the paper tables)."""
    json: pathlib.Path | None = None
    """Write all results here."""


@dataclasses.dataclass
class LocalModel:
    """Shape of the local model (fields of models.TransformerConfig)."""

    vocab_size: int = 256
    num_layers: int = 6
    dim: int = 128
    num_heads: int = 4
    mlp_ratio: int = 4
    tie_embeddings: bool = False
    kind: Literal["dense", "moe"] = "dense"
    num_experts: int = 4
    top_k: int = 2


def local_comm(args: Args) -> ModelComm:
    cfg = args.local_config
    if args.local_params is not None:
        if cfg.num_layers % (args.local_fragments):
            raise ValueError(f"--local-config.num-layers {cfg.num_layers} not divisible by --local-fragments")
        return paper_model("local", params=args.local_params, layers=cfg.num_layers, fragments=args.local_fragments)
    import models

    config = models.TransformerConfig(**dataclasses.asdict(cfg))
    return real_model(config, args.local_fragments)


def parse_variant(text: str) -> tuple[float, float]:
    try:
        bits, backward = (float(x) for x in text.split(":"))
    except ValueError:
        raise SystemExit(f"--paper-variants: expected BITS:BACKWARD_FRACTION such as 16:0.667, got {text!r}") from None
    if bits <= 0 or not 0.0 <= backward <= 1.0:
        raise SystemExit(f"--paper-variants: need BITS > 0 and 0 <= BACKWARD_FRACTION <= 1, got {text!r}")
    return bits, backward
