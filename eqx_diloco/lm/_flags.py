"""This CLI's flag names for `DiLoCo`'s arguments, and the flag rules that need JAX's backend."""

import re
from typing import TYPE_CHECKING

from models._config import attention_rule

from .._errors import ConfigError

if TYPE_CHECKING:
    from .config import Config


# `DiLoCo`'s argument names as this CLI's flags (the core's errors name the arguments).
FLAGS = {
    "num_replicas": "--diloco.num-replicas", "sync_period": "--diloco.sync-period",
    "num_fragments": "--diloco.num-fragments", "fragment_pattern": "--diloco.fragment-pattern",
    "overlap_steps": "--diloco.overlap-steps", "alpha": "--diloco.alpha", "quantize": "--diloco.quantize",
    "error_feedback": "--diloco.error-feedback", "outer_overlap": "--diloco.outer-overlap",
    "exchange": "--diloco.exchange", "router_sync_period": "--diloco.router-sync-period",
    "on_nonfinite": "--train.on-nonfinite", "data_parallel": "--mesh.data", "comm_device": "--diloco.comm-device",
    "algorithm": "--algorithm", "replicas_per_device": "--mesh.replicas-per-device",
    "fsdp": "--mesh.fsdp", "tensor": "--mesh.tensor", "outer_state_memory": "--diloco.outer-state-memory",
    "topk_chunk": "--diloco.topk-chunk", "topk": "--diloco.topk",
}


def flag_names(message: str) -> str:
    """A core error message with each `DiLoCo` argument name replaced by its flag."""
    return re.sub(r"\b(" + "|".join(FLAGS) + r")\b", lambda match: FLAGS[match.group(1)], message)


def check_backend(config: "Config", backend: str, nvidia_gpu: bool) -> None:
    """The rules that need JAX's backend (`backend`, e.g. "cpu"; `nvidia_gpu`: it is an NVIDIA GPU):
    `--model.attention cudnn` where cuDNN flash attention cannot run. One-line `ConfigError`."""
    m = config.model
    if m.attention != "cudnn":
        return
    dtype = m.dtype if m.dtype != "auto" else ("float32" if backend == "cpu" else "bfloat16")
    problem = attention_rule(m, nvidia_gpu=nvidia_gpu, dtype=dtype)
    if problem is not None:
        raise ConfigError(f"--model.attention cudnn {problem} (backend {backend}, --model.dtype {m.dtype})")


