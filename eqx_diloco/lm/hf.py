"""Hugging Face checkpoints in and out: the Llama layout (`--model.mlp swiglu`) as safetensors.

- `load_hf_model(folder)`: a local Llama, Mistral or Qwen2 folder (config.json and safetensors, one file
  or shards with `model.safetensors.index.json`) as `(TransformerConfig, Transformer)`, float32, the
  per-layer tensors stacked into the model's layer axis. `--model.init-from` starts a run from it.
- `write_hf(model, out)`: the inverse, `config.json` (`LlamaForCausalLM`, or `Qwen2ForCausalLM` with
  `--model.qkv-bias`) and `model.safetensors` with one tensor per layer, which `transformers`,
  vLLM and lm-evaluation-harness read. `python -m eqx_diloco.export RUN --format hf OUT/` uses it.

Hugging Face's `nn.Linear` stores `(out, in)` matrices and this model multiplies `x @ W` with `(in, out)`:
each projection is transposed on the way in and out (exactly, so import then export gives back the same
bits). Both rotate the two halves of each head (`rotate_half`), so q and k need no permutation.

Only numpy, safetensors and JAX: `torch` and `transformers` are never imported.
"""

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy: safetensors reads bf16 tensors through it)
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from models import Transformer, TransformerConfig

from .._errors import ConfigError
from ._hf_config import ARCHITECTURES, folder_fields

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Buffers some older conversions saved beside the weights; they are recomputed, never learned.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One Hugging Face tensor and where it lives in the model: `get(model)` is the leaf (for a layer
    tensor, the stacked leaf and `layer` its index); `transpose`: stored `(out, in)`."""

    name: str
    get: Callable[[Transformer], Any]
    layer: int | None = None
    transpose: bool = False


def tensor_map(config: TransformerConfig) -> list[_Tensor]:
    """Every Hugging Face tensor name of a model of `config` (swiglu, dense) and its leaf."""
    tensors = [_Tensor("model.embed_tokens.weight", lambda m: m.embed), _Tensor("model.norm.weight",
                                                                                lambda m: m.final_norm.weight)]
    if not config.tie_embeddings:
        tensors.append(_Tensor("lm_head.weight", lambda m: m.head, transpose=True))
    per_layer = [
        ("input_layernorm.weight", lambda m: m.blocks.attn_norm.weight, False),
        ("self_attn.q_proj.weight", lambda m: m.blocks.attn.q, True),
        ("self_attn.k_proj.weight", lambda m: m.blocks.attn.k, True),
        ("self_attn.v_proj.weight", lambda m: m.blocks.attn.v, True),
        ("self_attn.o_proj.weight", lambda m: m.blocks.attn.out, True),
        ("post_attention_layernorm.weight", lambda m: m.blocks.ffn_norm.weight, False),
        ("mlp.gate_proj.weight", lambda m: m.blocks.ffn.gate, True),
        ("mlp.up_proj.weight", lambda m: m.blocks.ffn.up, True),
        ("mlp.down_proj.weight", lambda m: m.blocks.ffn.down, True),
    ]
    if config.qkv_bias:
        per_layer += [
            ("self_attn.q_proj.bias", lambda m: m.blocks.attn.q_bias, False),
            ("self_attn.k_proj.bias", lambda m: m.blocks.attn.k_bias, False),
            ("self_attn.v_proj.bias", lambda m: m.blocks.attn.v_bias, False),
        ]
    for i in range(config.num_layers):
        tensors += [_Tensor(f"model.layers.{i}.{name}", get, i, t) for name, get, t in per_layer]
    return tensors


# -- reading -------------------------------------------------------------------------------------


def weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (one file, or the shards an index names)."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError(f"{index} is not a safetensors index ({type(e).__name__}: {e})".splitlines()[0]) from None
        files = {name: folder / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise ConfigError(f"{index} names the shard {shard.name}, which is not in {folder}")
        return files
    single = folder / SINGLE_FILE
    if not single.is_file():
        found = sorted(p.name for p in folder.glob("*.bin")) or sorted(p.name for p in folder.iterdir())[:5]
        raise ConfigError(f"{folder} holds neither {SINGLE_FILE} nor {INDEX_FILE} (safetensors weights are read; "
                          f"found {', '.join(found) or 'nothing'})")
    try:
        with safe_open(single, framework="numpy") as f:
            return dict.fromkeys(f.keys(), single)
    except Exception as e:  # noqa: BLE001 - a truncated file or a bad header: safetensors' own SafetensorError
        raise ConfigError(f"{single} cannot be read as safetensors ({type(e).__name__}: {e})".splitlines()[0]) from None


def read_tensors(folder: Path, wanted: list[str]) -> Iterator[tuple[str, np.ndarray]]:
    """(name, float32 array) of each tensor `wanted` from `folder`'s safetensors, one at a time (one file open
    at a time), so that a caller keeps no more than the model it builds. Any other tensor (bar recomputed
    buffers, and `lm_head.weight` of a tied model) and any missing one is a one-line `ConfigError`, raised
    before the first tensor is read."""
    files = weight_files(folder)
    wanted_set = set(wanted)
    extra = [n for n in files if n not in wanted_set and not n.endswith(_IGNORED_SUFFIXES) and n != "lm_head.weight"]
    if extra:
        raise ConfigError(f"{folder}: tensor {sorted(extra)[0]} cannot be mapped onto the model "
                          f"({len(extra)} such tensor{'s' if len(extra) > 1 else ''})")
    missing = [n for n in wanted if n not in files]
    if missing:
        raise ConfigError(f"{folder}: tensor {missing[0]} is missing ({len(missing)} missing in all)")
    return _tensors_by_file(files, wanted)


def _tensors_by_file(files: dict[str, Path], wanted: list[str]) -> Iterator[tuple[str, np.ndarray]]:
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(files[name], []).append(name)
    for path, names in by_file.items():
        try:
            with safe_open(path, framework="numpy") as f:
                for name in names:
                    value = np.asarray(f.get_tensor(name), np.float32)
                    yield name, value
        except Exception as e:  # noqa: BLE001 - a truncated file, an unknown dtype, safetensors' own SafetensorError
            raise ConfigError(f"{path} cannot be read as safetensors ({type(e).__name__}: {e})".splitlines()[0]) from None


def model_from_tensors(config: TransformerConfig, tensors: Iterable[tuple[str, np.ndarray]], where: str) -> Transformer:
    """A `Transformer` of `config` whose arrays are `tensors` ((Hugging Face name, array) pairs, every name of
    `tensor_map(config)` once), layers stacked. A tensor of the wrong shape is a one-line `ConfigError` naming
    it (`where`: its folder)."""
    like = eqx.filter_eval_shape(Transformer, config, key=jax.random.key(0))
    specs = {spec.name: spec for spec in tensor_map(config)}
    stacked: dict[int, np.ndarray] = {}  # id of the abstract leaf -> the array being filled
    getters: dict[int, Callable] = {}
    for name, stored in tensors:
        spec = specs[name]
        leaf = spec.get(like)
        shape = tuple(leaf.shape[1:] if spec.layer is not None else leaf.shape)
        if stored.shape != (tuple(reversed(shape)) if spec.transpose else shape):
            raise ConfigError(f"{where}: tensor {name} has shape {tuple(stored.shape)}, the model "
                              f"({config_summary(config)}) wants {tuple(reversed(shape)) if spec.transpose else shape}")
        value = stored.T if spec.transpose else stored
        array = stacked.setdefault(id(leaf), np.empty(leaf.shape, np.float32))
        if spec.layer is None:
            array[...] = value
        else:
            array[spec.layer] = value
        getters[id(leaf)] = spec.get
    leaves = list(getters)
    return eqx.tree_at(lambda m: [getters[i](m) for i in leaves], like,
                       [jnp.asarray(stacked.pop(i)) for i in leaves])


def config_summary(config: TransformerConfig) -> str:
    return (f"{config.num_layers} layers, dim {config.dim}, {config.num_heads} heads, {config.kv_heads} kv heads, "
            f"ffn {config.ffn_hidden}, vocab {config.vocab_size}")


def load_hf_weights(config: TransformerConfig, folder: Path | str | None = None) -> Transformer:
    """The model of `config` with its weights read from `folder`, float32. `config` must have the folder's
    shape (`load_hf_model` reads it; the CLI merges it with the flags). Without `folder`, `config.init_from`
    is read and errors name `--model.init-from`."""
    flag = "--model.init-from " if folder is None else ""
    folder = Path(config.init_from if folder is None else folder)
    if config.mlp != "swiglu" or config.kind != "dense":
        raise ConfigError(f"{flag}{folder} holds a SwiGLU dense model: --model.mlp must be swiglu and --model.kind "
                          f"dense (got {config.mlp}, {config.kind})")
    names = [spec.name for spec in tensor_map(config)]
    try:
        return model_from_tensors(config, read_tensors(folder, names), str(folder))
    except ConfigError as e:
        raise ConfigError(f"{flag}{e}") from None


def load_hf_model(path: Path | str) -> tuple[TransformerConfig, Transformer]:
    """(config, model) of a local Hugging Face folder (Llama, Mistral or Qwen2 dense layout, safetensors),
    float32. Anything it cannot map (an architecture, a config field, a tensor or a shape) is a one-line
    `ConfigError` naming it."""
    path = Path(path)
    config = TransformerConfig(**folder_fields(path))
    return config, load_hf_weights(config, path)


# -- writing -------------------------------------------------------------------------------------


def export_rule(config: TransformerConfig) -> str | None:
    """Why a model of `config` has no Hugging Face equivalent (one line naming the option), or None."""
    if config.kind != "dense":
        return f"--model.kind {config.kind} has no Llama equivalent (export a dense --model.mlp swiglu model)"
    if config.mlp != "swiglu":
        return f"--model.mlp {config.mlp} has no Llama equivalent (Llama's MLP is --model.mlp swiglu)"
    return None


def hf_config(config: TransformerConfig, *, max_positions: int) -> dict[str, Any]:
    """The `config.json` of a model of `config`: `LlamaForCausalLM`, or `Qwen2ForCausalLM` with q/k/v biases.
    `max_positions`: `max_position_embeddings` (the context length it was trained on)."""
    qwen = config.qkv_bias
    architecture = "Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"
    out = {
        "architectures": [architecture],
        "model_type": ARCHITECTURES[architecture],
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.ffn_hidden,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_base,
        "rope_scaling": None,
        "tie_word_embeddings": config.tie_embeddings,
        "torch_dtype": "float32",
        # No tokenizer ids are known to the model; null keeps transformers' Llama defaults (1 and 2) out.
        "bos_token_id": None,
        "eos_token_id": None,
    }
    if qwen:
        out.update(use_sliding_window=False, sliding_window=None)
    else:
        out.update(attention_bias=False, mlp_bias=False)
    return out


def hf_tensors(model: Transformer) -> dict[str, np.ndarray]:
    """The model's arrays under their Hugging Face names, one per layer, float32 (C-contiguous)."""
    out = {}
    for spec in tensor_map(model.config):
        value = np.asarray(spec.get(model), np.float32)
        if spec.layer is not None:
            value = value[spec.layer]
        out[spec.name] = np.ascontiguousarray(value.T if spec.transpose else value)
    return out


def write_hf(model: Transformer, out: Path | str, *, max_positions: int = 2048,
             tokenizer: Path | str | None = None) -> list[str]:
    """Write `model` as a Hugging Face folder `out` (config.json, model.safetensors and, given `tokenizer`
    (a `tokenizers` JSON file), tokenizer.json and tokenizer_config.json). Returns the files written.

    `out` must not exist or be empty; the folder is written under a temporary name and renamed when
    complete, so an interrupted export leaves nothing that looks finished."""
    problem = export_rule(model.config)
    if problem is not None:
        raise ConfigError(f"--format hf: {problem}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"OUT {out} already exists and is not an empty folder (--format hf writes a new folder)")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        (partial / "config.json").write_text(json.dumps(hf_config(model.config, max_positions=max_positions),
                                                        indent=2) + "\n")
        save_file(hf_tensors(model), str(partial / SINGLE_FILE), metadata={"format": "pt"})
        if tokenizer is not None:
            shutil.copyfile(tokenizer, partial / "tokenizer.json")
            (partial / "tokenizer_config.json").write_text(
                json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")
        if out.exists():
            out.rmdir()
        os.replace(partial, out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return sorted(p.name for p in out.iterdir())


def run_tokenizer(run_config) -> Path | None:
    """The `tokenizers` JSON a run's tokens were made with (the copy beside a token folder's shards, or
    the file a single token file's metadata names; it may no longer exist), or None: another data
    source, or none recorded."""
    from .token_shards import named_tokenizer_file

    data = run_config.data
    if data.source != "tokens" or data.path is None:
        return None
    return named_tokenizer_file(data.path)


def export_hf(run_dir: Path | str, out: Path | str, *, step: int | None = None) -> dict[str, Any]:
    """Write the global model of `run_dir`'s newest intact checkpoint (or `step`) as a Hugging Face folder
    `out`, with the run's tokenizer when its tokens came from one. Returns what was written."""
    from .export import restore_global_model

    model, config, found = restore_global_model(run_dir, step=step)
    problem = export_rule(model.config)  # before anything is written
    if problem is not None:
        raise ConfigError(f"--format hf: {problem}")
    tokenizer = run_tokenizer(config)
    note = None
    if tokenizer is not None and not tokenizer.is_file():
        note, tokenizer = f"the run's tokenizer {tokenizer} no longer exists: no tokenizer files written", None
    files = write_hf(model, out, max_positions=config.train.seq_len, tokenizer=tokenizer)
    return {"step": found, "files": files, "tokenizer": None if tokenizer is None else str(tokenizer), "note": note}


def main_hf(args) -> int:
    """`python -m eqx_diloco.export RUN --format hf [OUT]` (`args` parsed by `export.main`)."""
    import logging
    import sys

    out = args.run_dir / "hf" if args.out is None else args.out
    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's notes on read-only folders
    try:
        info = export_hf(args.run_dir, out, step=args.step)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: OUT cannot be written: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    if info["note"]:
        print(f"note: {info['note']}", file=sys.stderr)
    print(f"exported the global model of {args.run_dir} at step {info['step']} to {out}/ "
          f"({', '.join(info['files'])})")
    return 0
