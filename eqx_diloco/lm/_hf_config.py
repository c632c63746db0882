"""The Llama layout's `--model` flags: their rules, and a Hugging Face folder's `config.json` as
`TransformerConfig` fields and how they meet the flags (plain Python: the CLI reads it before JAX starts).

With `--model.init-from`, the folder's config sets the model's shape. A `--model` flag left at its
default takes the folder's value; a flag given another value must equal it, else `contradiction`
names both.
"""

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from models import TransformerConfig

from .._errors import ConfigError

# The dense decoder layouts read, by `architectures` entry. All three are Llama's block (pre-norm
# RMSNorm, rotary attention with grouped key/value heads, SwiGLU); Qwen2 adds q/k/v biases.
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}

# TransformerConfig field -> the config.json key it comes from (for messages).
SOURCE_KEYS = {
    "vocab_size": "vocab_size", "num_layers": "num_hidden_layers", "dim": "hidden_size",
    "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads", "ffn_dim": "intermediate_size",
    "norm_eps": "rms_norm_eps", "rope_base": "rope_theta", "tie_embeddings": "tie_word_embeddings",
    "qkv_bias": "architectures", "mlp": "architectures", "kind": "architectures",
}


def config_file(folder: Path | str) -> Path:
    return Path(folder) / "config.json"


def read_hf_config(folder: Path | str, flag: str = "--model.init-from") -> dict[str, Any]:
    """The parsed `config.json` of `folder`; a missing or malformed one is a one-line `ConfigError`."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"{flag} must be a Hugging Face model folder: {folder} is not a folder")
    path = config_file(folder)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{flag} {folder} holds no config.json (a Hugging Face model folder has one)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{flag} {path} is not readable JSON ({type(e).__name__}: {e})".splitlines()[0]) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{flag} {path} is not a JSON object")
    return raw


def architecture(raw: dict[str, Any], where: Path) -> str:
    """`llama`, `mistral` or `qwen2` from `architectures` (or `model_type`); anything else is refused."""
    names = raw.get("architectures")
    if isinstance(names, list) and len(names) == 1 and names[0] in ARCHITECTURES:
        return ARCHITECTURES[names[0]]
    if names is None and raw.get("model_type") in ARCHITECTURES.values():
        return raw["model_type"]
    shown = names if names is not None else raw.get("model_type")
    raise ConfigError(f"{where}: architecture {shown} is not supported (reads {', '.join(ARCHITECTURES)})")


def _int(raw: dict[str, Any], key: str, where: Path, default: Any = None) -> int:
    value = raw.get(key, default)
    if type(value) is not int or value < 1:
        raise ConfigError(f"{where}: {key} must be an int >= 1 (got {value!r})")
    return value


def _rope_base(raw: dict[str, Any], where: Path) -> float:
    """`rope_theta` (top level, or in transformers 5's `rope_parameters`); scaled rope is refused."""
    params = raw.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict) or params.get("rope_type", "default") != "default":
            kind = params.get("rope_type") if isinstance(params, dict) else params
            raise ConfigError(f"{where}: rope_parameters rope_type {kind!r} cannot be mapped (plain rope only)")
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    else:
        scaling = raw.get("rope_scaling")
        if scaling is not None and (not isinstance(scaling, dict)
                                    or scaling.get("rope_type", scaling.get("type")) != "default"):
            raise ConfigError(f"{where}: rope_scaling {json.dumps(scaling)} cannot be mapped (plain rope only)")
        theta = raw.get("rope_theta", 10000.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < math.inf:
        raise ConfigError(f"{where}: rope_theta must be a number > 0 (got {theta!r})")
    return float(theta)


def hf_fields(raw: dict[str, Any], where: Path) -> dict[str, Any]:
    """The `TransformerConfig` fields a parsed `config.json` sets. A field or value the model cannot
    represent is a one-line `ConfigError` naming it (`where`: the file, for the message)."""
    arch = architecture(raw, where)
    if raw.get("quantization_config") is not None:
        raise ConfigError(f"{where}: quantization_config is set (quantized weights cannot be read; use the float ones)")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act {raw['hidden_act']!r} cannot be mapped (SwiGLU uses silu)")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key, False):
            raise ConfigError(f"{where}: {key} true cannot be mapped (no output or MLP biases)")
    if arch == "mistral" and raw.get("sliding_window") is not None:
        raise ConfigError(f"{where}: sliding_window {raw['sliding_window']} cannot be mapped (attention is over the "
                          "whole sequence; null it only if you train on sequences no longer than it)")
    if arch == "qwen2" and raw.get("use_sliding_window", False):
        raise ConfigError(f"{where}: use_sliding_window true cannot be mapped (attention is over the whole sequence)")
    dim, heads = _int(raw, "hidden_size", where), _int(raw, "num_attention_heads", where)
    if dim % heads or (dim // heads) % 2:
        raise ConfigError(f"{where}: hidden_size {dim} / num_attention_heads {heads} must be an even int (head dim)")
    if raw.get("head_dim") not in (None, dim // heads):
        raise ConfigError(f"{where}: head_dim {raw['head_dim']} cannot be mapped (must be hidden_size / "
                          f"num_attention_heads = {dim // heads})")
    kv_heads = _int(raw, "num_key_value_heads", where, default=heads) if raw.get("num_key_value_heads") else heads
    if heads % kv_heads:
        raise ConfigError(f"{where}: num_key_value_heads {kv_heads} must divide num_attention_heads {heads}")
    eps = raw.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < math.inf:
        raise ConfigError(f"{where}: rms_norm_eps must be a number > 0 (got {eps!r})")
    tie = raw.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise ConfigError(f"{where}: tie_word_embeddings must be true or false (got {tie!r})")
    return {
        "vocab_size": _int(raw, "vocab_size", where),
        "num_layers": _int(raw, "num_hidden_layers", where),
        "dim": dim,
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "ffn_dim": _int(raw, "intermediate_size", where),
        "norm_eps": float(eps),
        "rope_base": _rope_base(raw, where),
        "tie_embeddings": tie,
        "qkv_bias": arch == "qwen2",
        "mlp": "swiglu",
        "kind": "dense",
    }


def folder_fields(folder: Path | str) -> dict[str, Any]:
    """`hf_fields` of `folder`'s config.json."""
    return hf_fields(read_hf_config(folder), config_file(folder))


_DEFAULTS = TransformerConfig()


def fill_from_folder(model: TransformerConfig) -> TransformerConfig:
    """`model` (a `TransformerConfig` or the CLI's `ModelFlags`) whose shape fields left at their defaults
    (`vocab_size` unset) take the values of its `init_from` folder (none: `model` as it is). Best effort: an
    unreadable folder leaves `model` as it is (`check_layout` reports it, from `validate`; `Config()` must
    not raise)."""
    if model.init_from is None:
        return model
    model = dataclasses.replace(model, init_from=Path(model.init_from))  # library users may pass a str
    try:
        fields = folder_fields(model.init_from)
    except ConfigError:
        return model
    changes = {}
    for name, value in fields.items():
        current = getattr(model, name)
        if name == "ffn_dim":
            # `--model.mlp-ratio` given: it speaks for the width (and must agree, see `contradiction`).
            if current is None and model.mlp_ratio == _DEFAULTS.mlp_ratio:
                changes[name] = value
        elif current is None or current == getattr(_DEFAULTS, name):
            changes[name] = value
    return dataclasses.replace(model, **changes)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def check_layout(m: TransformerConfig) -> None:
    """Raise `ConfigError` (one line naming the flag) for the first rule of the Llama layout's flags, or of
    `--model.init-from`, that `m` breaks (the CLI's half of `models._config.layout_rule`)."""
    _require(m.num_kv_heads is None or (m.num_kv_heads >= 1 and m.num_heads % m.num_kv_heads == 0),
             f"--model.num-kv-heads must divide --model.num-heads (got {m.num_kv_heads} and {m.num_heads})")
    _require(m.ffn_dim is None or m.ffn_dim >= 1, f"--model.ffn-dim must be >= 1 (got {m.ffn_dim})")
    _require(0 < m.norm_eps < math.inf, f"--model.norm-eps must be a finite number > 0 (got {m.norm_eps})")
    if m.init_from is not None:
        _require((problem := contradiction(m)) is None, problem)
    if m.kind == "moe":
        _require(m.mlp == "gelu", f"--model.mlp {m.mlp} applies to --model.kind dense (MoE experts are GELU)")
        _require(m.ffn_dim is None, "--model.ffn-dim applies to --model.kind dense (MoE experts are "
                 "--model.mlp-ratio x --model.dim wide)")


def _flag(name: str) -> str:
    return "--model." + name.replace("_", "-")


def contradiction(model: TransformerConfig) -> str | None:
    """Why `model`'s flags disagree with its `init_from` folder (one line naming the flag and the folder's
    field), or None. Raises `ConfigError` for a folder that cannot be read or mapped."""
    where = config_file(model.init_from)
    raw = read_hf_config(model.init_from)
    try:
        fields = hf_fields(raw, where)
    except ConfigError as e:
        raise ConfigError(f"--model.init-from {e}") from None
    for name, value in fields.items():
        current = {"ffn_dim": model.ffn_hidden, "num_kv_heads": model.kv_heads}.get(name, getattr(model, name))
        if current == value:
            continue
        flag = "--model.mlp-ratio" if name == "ffn_dim" and model.ffn_dim is None else _flag(name)
        if SOURCE_KEYS[name] == "architectures":  # set by the layout itself, not by a key of its own
            layout = raw.get("architectures") or [raw.get("model_type")]
            return (f"{flag} {current} contradicts the {layout[0]} layout of {where} (which has {_flag(name)} "
                    f"{value})")
        return (f"{flag} {current} contradicts {SOURCE_KEYS[name]} {value} in {where} "
                "(leave the flag at its default to take the folder's value)")
    return None
