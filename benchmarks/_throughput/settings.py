"""The model, batch and budget of a throughput measurement, and the model's FLOPs per token."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Settings:
    num_layers: int = 4
    dim: int = 128
    num_heads: int = 4
    mlp_ratio: int = 4
    seq_len: int = 128
    batch_size: int = 8
    warmup_steps: int = 3  # untimed steps of each variant (>= 2: the second call may compile again)
    steps_per_round: int = 4
    rounds: int = 6
    with_r2: bool = True
    compile_layers: tuple[int, ...] = (4, 12, 24)
    compile_trainer_step: bool = True
    compile_reps: int = 2
    matmul_sizes: tuple[int, ...] = (1024, 2048)
    matmul_reps: int = 5


SMOKE = Settings(num_layers=2, dim=16, num_heads=2, mlp_ratio=2, seq_len=16, batch_size=2, warmup_steps=2,
                 steps_per_round=1, rounds=2, with_r2=False, compile_layers=(2,), compile_trainer_step=False,
                 compile_reps=1, matmul_sizes=(64,), matmul_reps=2)


def model_config(s: Settings, num_layers: int | None = None):
    """The model measured: the rolled scan (`scan_unroll=1`), whose compile time (b) compares with
    the hand-unrolled loop; `benchmarks/scan_unroll.py` measures the model's own unrolled scan."""
    from models import TransformerConfig

    return TransformerConfig(num_layers=num_layers or s.num_layers, dim=s.dim, num_heads=s.num_heads,
                             mlp_ratio=s.mlp_ratio, scan_unroll=1)


def train_config(s: Settings):
    from eqx_diloco.lm.config import TrainConfig

    return TrainConfig(steps=10_000, batch_size=s.batch_size, seq_len=s.seq_len, warmup_steps=10, eval_every=0,
                       log_every=1000, eval_sequences=2)


def model_flops(cfg, seq_len: int) -> dict[str, float]:
    """Parameter counts and training FLOPs per token (see the module docstring)."""
    d, L, V = cfg.dim, cfg.num_layers, cfg.vocab_size
    per_layer = d * 3 * d + d * d + 2 * d * cfg.mlp_ratio * d
    n_matmul = L * per_layer + d * V
    n_total = L * (per_layer + 2 * d) + V * d + d + (0 if cfg.tie_embeddings else d * V)
    attention = 12 * L * seq_len * d
    return {"n_params": n_total, "n_matmul": n_matmul, "flops_per_token": 6 * n_matmul + attention,
            "attention_flops_per_token": attention}
