"""Configuration dataclasses (the CLI is generated from them by tyro) and their validation."""

import dataclasses
from pathlib import Path
from typing import Literal

from models import TransformerConfig

Algorithm = Literal["diloco", "ddp"]
QuantizeFormat = Literal["none", "bf16", "fp8", "int8", "int4", "e3m0"]


class ConfigError(ValueError):
    """A user-facing configuration mistake. Its message is one line naming the flag and the rule."""


@dataclasses.dataclass(frozen=True)
class DiLoCoConfig:
    """Outer loop: replicas, sync period, outer optimizer, fragments, overlap, quantization.

    **Arguments:**

    - `num_replicas`: R, the number of independently training replicas ("islands").
    - `sync_period`: H, inner steps between two outer syncs of the same parameters.
    - `outer_lr`: learning rate of the outer SGD optimizer.
    - `outer_momentum`: momentum of the outer SGD optimizer (0 disables it).
    - `nesterov`: use Nesterov momentum in the outer optimizer.
    - `num_fragments`: P, total number of Streaming DiLoCo fragments (1 = plain DiLoCo).
      Fragment 0 holds everything outside the layer stack; fragments 1..P-1 hold layers.
    - `fragment_pattern`: `strided` (fragment f holds layers f-1, f-1+(P-1), ...) or
      `sequential` (contiguous blocks of layers).
    - `overlap_steps`: tau, inner steps a fragment's sync overlaps before it is merged.
    - `alpha`: merge weight: replica = alpha * replica + (1 - alpha) * new global.
    - `quantize`: wire format of each replica's outer gradient.
    - `error_feedback`: keep each replica's quantization residual and add it to its next
      outer gradient of the same fragment.
    - `router_sync_period`: K > 0 gives MoE router parameters their own outer step every
      K inner steps (0 = off; router leaves then sync with their fragment).
    """

    num_replicas: int = 2
    sync_period: int = 20
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    num_fragments: int = 1
    fragment_pattern: Literal["strided", "sequential"] = "strided"
    overlap_steps: int = 0
    alpha: float = 0.0
    quantize: QuantizeFormat = "none"
    error_feedback: bool = False
    router_sync_period: int = 0


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Inner optimization and the loop.

    **Arguments:**

    - `steps`: total inner steps.
    - `batch_size`: sequences per replica per step (split over the `data` mesh axis).
    - `seq_len`: tokens per sequence (each sample holds seq_len + 1 tokens for the shift).
    - `lr`: peak learning rate of the inner AdamW.
    - `warmup_steps`: linear warm-up steps of the inner learning rate.
    - `min_lr_ratio`: final learning rate of the cosine decay, as a fraction of `lr`.
    - `weight_decay`: decoupled AdamW weight decay (norm gains are not decayed).
    - `b1`, `b2`: AdamW moment decay rates.
    - `grad_clip`: global gradient norm clip (0 disables clipping).
    - `seed`: seed for weights, data order and dropout.
    - `log_every`: steps between metrics lines.
    - `eval_every`: steps between evaluations of the global model (0 = only at the end).
    - `eval_sequences`: held-out sequences per evaluation.
    - `on_nonfinite`: what to do when a replica's loss or outer gradient is NaN/Inf:
      `stop` with an error, or `skip` that replica's step or sync contribution.
    """

    steps: int = 200
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 10
    eval_every: int = 50
    eval_sequences: int = 32
    on_nonfinite: Literal["stop", "skip"] = "stop"


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from.

    **Arguments:**

    - `source`: `corpus` (embedded: the Python standard library's own source, byte-level),
      `text` (a file or a folder of text files, byte-level), `tokens` (a flat binary file
      of uint16 token ids) or `synthetic` (a learnable pattern, for tests).
    - `path`: the file or folder for `text` and `tokens`.
    - `eval_fraction`: share of the tokens held out for evaluation (taken from the end).
    - `max_corpus_bytes`: cap on the embedded corpus size.
    """

    source: Literal["corpus", "text", "tokens", "synthetic"] = "corpus"
    path: Path | None = None
    eval_fraction: float = 0.05
    max_corpus_bytes: int = 8_000_000


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device layout.

    **Arguments:**

    - `data`: devices per replica on the `data` mesh axis (ordinary data parallelism inside
      a replica). The `diloco` axis gets one device per replica.
    """

    data: int = 1


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints.

    **Arguments:**

    - `every`: steps between checkpoints (0 disables checkpointing).
    - `keep`: how many recent checkpoints to keep.
    - `dir`: checkpoint folder (default: `<run-dir>/checkpoints`).
    """

    every: int = 100
    keep: int = 3
    dir: Path | None = None


@dataclasses.dataclass(frozen=True)
class Config:
    """eqx_diloco trainer: DiLoCo / Streaming DiLoCo / data-parallel training of a transformer LM.

    **Arguments:**

    - `algorithm`: `diloco` (Streaming DiLoCo when `--diloco.num-fragments` > 1) or `ddp`
      (gradients averaged over all replicas every step).
    - `run_dir`: where metrics.jsonl, config.json and checkpoints go.
    """

    algorithm: Algorithm = "diloco"
    run_dir: Path = Path("runs/default")
    model: TransformerConfig = TransformerConfig()
    diloco: DiLoCoConfig = DiLoCoConfig()
    train: TrainConfig = TrainConfig()
    data: DataConfig = DataConfig()
    mesh: MeshConfig = MeshConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def validate(config: Config) -> None:
    """Raise `ConfigError` with a one-line message for the first rule `config` breaks."""
    m, d, t, data = config.model, config.diloco, config.train, config.data
    for flag, value in [
        ("--model.num-layers", m.num_layers),
        ("--model.dim", m.dim),
        ("--model.num-heads", m.num_heads),
        ("--model.mlp-ratio", m.mlp_ratio),
        ("--model.vocab-size", m.vocab_size),
        ("--diloco.num-replicas", d.num_replicas),
        ("--diloco.sync-period", d.sync_period),
        ("--diloco.num-fragments", d.num_fragments),
        ("--train.steps", t.steps),
        ("--train.batch-size", t.batch_size),
        ("--train.seq-len", t.seq_len),
        ("--train.log-every", t.log_every),
        ("--train.eval-sequences", t.eval_sequences),
        ("--mesh.data", config.mesh.data),
    ]:
        _require(value >= 1, f"{flag} must be >= 1 (got {value})")
    for flag, value in [
        ("--train.lr", t.lr),
        ("--diloco.outer-lr", d.outer_lr),
    ]:
        _require(value > 0, f"{flag} must be > 0 (got {value})")
    for flag, value in [
        ("--train.warmup-steps", t.warmup_steps),
        ("--train.eval-every", t.eval_every),
        ("--train.weight-decay", t.weight_decay),
        ("--train.grad-clip", t.grad_clip),
        ("--diloco.overlap-steps", d.overlap_steps),
        ("--diloco.router-sync-period", d.router_sync_period),
        ("--checkpoint.every", config.checkpoint.every),
    ]:
        _require(value >= 0, f"{flag} must be >= 0 (got {value})")
    _require(config.checkpoint.keep >= 1, f"--checkpoint.keep must be >= 1 (got {config.checkpoint.keep})")
    _require(0 <= d.outer_momentum < 1, f"--diloco.outer-momentum must be in [0, 1) (got {d.outer_momentum})")
    _require(0 <= t.min_lr_ratio <= 1, f"--train.min-lr-ratio must be in [0, 1] (got {t.min_lr_ratio})")
    _require(0 <= m.dropout < 1, f"--model.dropout must be in [0, 1) (got {m.dropout})")
    _require(
        m.dim % m.num_heads == 0,
        f"--model.dim must be divisible by --model.num-heads (got {m.dim} and {m.num_heads})",
    )
    _require(
        (m.dim // m.num_heads) % 2 == 0,
        f"--model.dim / --model.num-heads must be even for rotary embeddings (got {m.dim // m.num_heads})",
    )
    if m.kind == "moe":
        _require(m.num_experts >= 2, f"--model.num-experts must be >= 2 (got {m.num_experts})")
        _require(m.top_k in (1, 2), f"--model.top-k must be 1 or 2 (got {m.top_k})")
        _require(m.top_k <= m.num_experts, f"--model.top-k must be <= --model.num-experts (got {m.top_k})")
    _require(
        t.batch_size % config.mesh.data == 0,
        f"--train.batch-size must be divisible by --mesh.data (got {t.batch_size} and {config.mesh.data})",
    )
    _require(0 < data.eval_fraction < 1, f"--data.eval-fraction must be in (0, 1) (got {data.eval_fraction})")
    if data.source in ("text", "tokens"):
        _require(data.path is not None, f"--data.path is required with --data.source {data.source}")
        _require(data.path.exists(), f"--data.path does not exist: {data.path}")

    if config.algorithm == "ddp":
        streaming = {
            "--diloco.num-fragments": d.num_fragments != 1,
            "--diloco.overlap-steps": d.overlap_steps != 0,
            "--diloco.alpha": d.alpha != 0.0,
            "--diloco.quantize": d.quantize != "none",
            "--diloco.error-feedback": d.error_feedback,
            "--diloco.router-sync-period": d.router_sync_period != 0,
        }
        for flag, set_ in streaming.items():
            _require(not set_, f"{flag} applies to --algorithm diloco only, not ddp")
        return

    P, H = d.num_fragments, d.sync_period
    if P > 1:
        _require(
            m.num_layers % (P - 1) == 0,
            f"--model.num-layers must be divisible by --diloco.num-fragments - 1 "
            f"(got {m.num_layers} layers for {P - 1} layer fragments)",
        )
    _require(H % P == 0, f"--diloco.sync-period must be divisible by --diloco.num-fragments (got H={H}, P={P})")
    _require(
        d.overlap_steps < H // P,
        f"--diloco.overlap-steps must be < sync-period / num-fragments (got tau={d.overlap_steps}, H/P={H // P})",
    )
    _require(0 <= d.alpha <= 1, f"--diloco.alpha must be in [0, 1] (got {d.alpha})")
    _require(
        not d.error_feedback or d.quantize != "none",
        "--diloco.error-feedback needs a lossy --diloco.quantize format (got none)",
    )
    if d.router_sync_period:
        _require(m.kind == "moe", "--diloco.router-sync-period needs --model.kind moe")
        _require(
            H % d.router_sync_period == 0,
            f"--diloco.router-sync-period must divide --diloco.sync-period (got K={d.router_sync_period}, H={H})",
        )
