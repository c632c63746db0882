"""`python -m eqx_diloco.evaluate MODEL`: held-out loss and perplexity, and multiple-choice accuracy.

MODEL is an exported model (`python -m eqx_diloco.export`: `model.eqx` beside `model.eqx.json`), a run
folder (its newest intact checkpoint's global model) or a Hugging Face folder (`config.json` and
safetensors weights). What it reports:

- the held-out loss (mean next-token cross entropy, nats) and perplexity (its exp) on a token file
  (`--tokens PATH`, all of it), or on the held-out split of the trainer's data (`--data.*` flags as the
  trainer reads them; by default the run's own data, for a run folder or an export whose run folder is
  there);
- `acc` and `acc_norm` on multiple-choice jsonl files (`--tasks A.jsonl,B.jsonl`), scored as
  lm-evaluation-harness scores them (`tasks.py`; docs/evaluate.md).

Every sequence is scored by one jitted program (`row_logprobs`), rows padded to a few bucket lengths, so
nothing compiles per question.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any, Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from models import Transformer

from .._errors import ConfigError
from .._replica_values import replicated_value
from .config import Config, DataConfig, validate
from .export import config_path, load_model, read_model_info, restore_global_model
from .resume import read_run_config
from .tasks import EncodedTask, ScoreBatch, accuracies, encode_task, perplexity, read_tasks, score_batches
from .text_encoding import BYTES, TextEncoder, encoder_for_data, load_tokenizer_file


@eqx.filter_jit
def row_logprobs(
    model: Transformer,
    inputs: Int[Array, "batch length"],
    targets: Int[Array, "batch length"],
    mask: Bool[Array, "batch length"],
    out_sharding: jax.sharding.Sharding | None = None,
) -> Float[Array, " batch"]:
    """Per row, the summed log-probability the model gives `targets` where `mask` is set (float32).

    `out_sharding`: where the result lives (the trainer asks for it replicated on its mesh, so every
    process reads it whole)."""
    logits = jax.vmap(model)(inputs)
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]
    sums = jnp.sum(jnp.where(mask, picked, jnp.zeros_like(picked)), axis=-1)
    if out_sharding is not None:
        sums = jax.lax.with_sharding_constraint(sums, out_sharding)
    return sums


def score(model: Transformer, batches: list[ScoreBatch], num_rows: int, *,
          place: Callable[[np.ndarray], jax.Array] = jnp.asarray,
          out_sharding: jax.sharding.Sharding | None = None) -> np.ndarray:
    """The summed log-probability of each of `num_rows` rows (float64, in the rows' order) over `batches`.
    `place` puts a host array where the model is (the trainer's mesh)."""
    out = np.zeros(num_rows, np.float64)
    for batch in batches:
        sums = row_logprobs(model, place(batch.inputs), place(batch.targets), place(batch.mask), out_sharding)
        sums = replicated_value(sums)
        real = batch.rows >= 0
        out[batch.rows[real]] = sums[real]
    return out


def task_scores(model: Transformer, encoded: EncodedTask, **kwargs) -> dict[str, float]:
    """`acc` and `acc_norm` of one encoded task (`score`'s keyword arguments pass through)."""
    return accuracies(encoded.task, score(model, encoded.batches, encoded.num_rows, **kwargs))


def held_out_windows(tokens: np.ndarray, context: int, sequences: int) -> list[tuple[np.ndarray, int]]:
    """Non-overlapping windows of `context + 1` held-out tokens (each token predicted once), at most
    `sequences` of them evenly spread (0 = all), as `score_batches` sequences."""
    starts = np.arange(0, len(tokens) - context, context)
    if starts.size == 0:
        raise ConfigError(f"the held-out tokens ({len(tokens)}) are fewer than one sequence of --context + 1 "
                          f"({context + 1}) tokens")
    if 0 < sequences < starts.size:
        starts = starts[np.unique(np.linspace(0, starts.size - 1, sequences).round().astype(np.int64))]
    return [(np.asarray(tokens[s:s + context + 1], np.int32), context) for s in starts]


def held_out_loss(model: Transformer, tokens: np.ndarray, *, context: int, sequences: int) -> dict[str, float]:
    """Mean next-token cross entropy (nats) of `model` on `tokens`' windows, its perplexity and the count of
    tokens predicted."""
    windows = held_out_windows(tokens, context, sequences)
    batches = score_batches(windows, context=context, vocab_size=model.config.vocab_size)
    total = score(model, batches, len(windows)).sum()
    predicted = len(windows) * context
    loss = float(-total / predicted)
    return {"loss": loss, "perplexity": perplexity(loss), "tokens": predicted}


# -- MODEL: an export, a run folder or a Hugging Face folder -------------------------------------------


@dataclasses.dataclass
class LoadedModel:
    """A model to evaluate and what is known of how it was trained.

    - `kind`: "export", "run" or "hf".
    - `context`: the sequence length it was trained on (None if unknown).
    - `data`, `seed`: the run's data flags and seed (its held-out split), when the run's config is there.
    - `data_source`: the run's `--data.source`, when known without its config (an export's record).
    - `description`: one line saying what was loaded.
    """

    model: Transformer
    kind: str
    path: Path
    context: int | None = None
    data: DataConfig | None = None
    seed: int = 0
    data_source: str | None = None
    description: str = ""


def _json_object(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


def model_kind(path: Path) -> str:
    """"export", "run" or "hf" for MODEL `path`; anything else is refused in one line."""
    if not path.exists():
        raise ConfigError(f"MODEL does not exist: {path}")
    if path.is_file():
        if config_path(path).is_file():
            return "export"
        raise ConfigError(f"MODEL {path} is a file without {config_path(path).name} beside it: not an export of "
                          f"python -m eqx_diloco.export (nor a run folder or a Hugging Face folder)")
    config = _json_object(path / "config.json") or {}
    if "model_type" in config or "architectures" in config or any(path.glob("*.safetensors")):
        return "hf"
    if "algorithm" in config or (path / "checkpoints").is_dir() or any(p.name.isdigit() for p in path.iterdir()):
        return "run"
    from .export import decoupled_syncer_dir

    if decoupled_syncer_dir(path) is not None:  # a decoupled run: its syncer holds config and theta_g
        return "run"
    raise ConfigError(f"MODEL {path} is none of an .eqx export, a run folder (config.json and checkpoints) or a "
                      f"Hugging Face folder (config.json and *.safetensors)")


def load_for_evaluation(path: Path | str) -> LoadedModel:
    """The model at MODEL `path` (see `model_kind`), with what is known of its training."""
    path = Path(path)
    kind = model_kind(path)
    if kind == "export":
        info = read_model_info(path)
        model = load_model(path)
        loaded = LoadedModel(model, kind, path, context=_positive_int(info.get("seq_len")),
                             data_source=info.get("data_source"), description=f"{path} (step {info.get('step', '?')})")
        run_dir = info.get("run_dir")
        if isinstance(run_dir, str) and (Path(run_dir) / "config.json").is_file():
            run_config = read_run_config(Path(run_dir))
            loaded.data, loaded.seed = run_config.data, run_config.train.seed
        return loaded
    if kind == "run":
        model, run_config, step = restore_global_model(path)
        return LoadedModel(model, kind, path, context=run_config.train.seq_len, data=run_config.data,
                           seed=run_config.train.seed, data_source=run_config.data.source,
                           description=f"{path}, the global model at step {step}")
    from .hf import load_hf_model  # the Hugging Face layout's reader (safetensors, Llama-family configs)

    _, model = load_hf_model(path)
    hf_config = _json_object(path / "config.json") or {}
    return LoadedModel(model, kind, path, context=_positive_int(hf_config.get("max_position_embeddings")),
                       description=f"{path} ({', '.join(hf_config.get('architectures') or ['Hugging Face'])})")


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def text_encoder(loaded: LoadedModel, tokenizer: Path | None) -> TextEncoder:
    """How MODEL reads text: `--tokenizer`, else a Hugging Face folder's tokenizer.json, else the run's
    (its token file's tokenizer, or UTF-8 bytes for the byte-level sources)."""
    if tokenizer is not None:
        return load_tokenizer_file(tokenizer, flag="--tokenizer")
    if loaded.kind == "hf":
        if not (loaded.path / "tokenizer.json").is_file():
            raise ConfigError(f"MODEL {loaded.path} has no tokenizer.json: pass --tokenizer PATH to read --tasks")
        return load_tokenizer_file(loaded.path / "tokenizer.json", flag="MODEL")
    if loaded.data is not None:
        try:
            return encoder_for_data(loaded.data.source, loaded.data.path, needed_by="--tasks")
        except ConfigError as e:
            raise ConfigError(f"{e}; pass --tokenizer PATH") from None
    if loaded.data_source == "tokens":
        raise ConfigError(f"MODEL {loaded.path} was trained on a token file whose run folder is gone: pass "
                          f"--tokenizer PATH to read --tasks")
    return BYTES


DATA_FLAGS = {"source": "--data.source", "path": "--data.path", "eval_fraction": "--data.eval-fraction",
              "max_corpus_bytes": "--data.max-corpus-bytes"}


def held_out_tokens(args: argparse.Namespace, loaded: LoadedModel) -> tuple[np.ndarray, str] | None:
    """(held-out tokens, where they came from) for the loss, or None when no data was named or known."""
    from .data import load_tokens, open_tokens

    vocab = loaded.model.config.vocab_size
    overrides = {key: getattr(args, f"data_{key}") for key in DATA_FLAGS if getattr(args, f"data_{key}") is not None}
    if args.tokens is not None:
        if overrides:
            raise ConfigError(f"--tokens and {DATA_FLAGS[next(iter(overrides))]} both name held-out data: give one")
        if not args.tokens.exists():
            raise ConfigError(f"--tokens must be a token folder or file (python -m eqx_diloco.prepare): {args.tokens}")
        with _model_vocab_words("--tokens"):
            _check_file_vocab(args.tokens, vocab, "--tokens")
            return open_tokens(args.tokens, vocab), f"{args.tokens} (all of it)"
    if not overrides and loaded.data is None:
        return None
    data = dataclasses.replace(loaded.data or DataConfig(), **overrides)
    if "source" in overrides and "path" not in overrides and data.source not in ("text", "tokens"):
        data = dataclasses.replace(data, path=None)  # the run's path belongs to the run's source
    validate(Config(data=data))  # the trainer's rules for the --data flags, in its words
    with _model_vocab_words("--data.path"):
        if data.source == "tokens":
            _check_file_vocab(data.path, vocab, "--data.path")
        tokens = load_tokens(data, vocab, loaded.seed)
    start = int(len(tokens) * (1.0 - data.eval_fraction))
    where = data.source if data.path is None else f"{data.source} {data.path}"
    return tokens[start:], f"the held-out {data.eval_fraction:g} of {where}"


def _check_file_vocab(path: Path, vocab: int, flag: str) -> None:
    """A token file made for a larger vocabulary than the model's is refused, naming both."""
    from .data import read_token_meta, token_meta_path

    file_vocab = read_token_meta(path).get("vocab_size")
    if file_vocab is not None and file_vocab > vocab:
        raise ConfigError(f"{flag} {path} holds ids of a vocabulary of {file_vocab} ({token_meta_path(path)}), "
                          f"more than the model's {vocab}")


@contextlib.contextmanager
def _model_vocab_words(flag: str):
    """The data reader's errors in this command's words: the file is `flag`, the vocabulary the model's."""
    try:
        yield
    except ConfigError as e:
        message = str(e).replace("--data.path", flag).replace("--model.vocab-size", "the model's vocab_size")
        raise ConfigError(message) from None


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    """Everything the command reports, as one JSON-ready dict."""
    tasks = read_tasks(args.tasks, flag="--tasks")  # before loading the model: a bad file fails at once
    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's notes on read-only checkpoint folders
    loaded = load_for_evaluation(args.model)
    context = args.context or loaded.context
    if context is None:
        raise ConfigError(f"MODEL {args.model} does not say its context length: pass --context N")
    result: dict[str, Any] = {"model": str(args.model), "kind": loaded.kind, "context": context}
    held_out = held_out_tokens(args, loaded)
    if held_out is None and not tasks:
        raise ConfigError("nothing to evaluate: give --tokens PATH, --data.source (and --data.path), or --tasks")
    encoder = text_encoder(loaded, args.tokenizer) if tasks else None
    encoded = [encode_task(task, encoder, context=context, vocab_size=loaded.model.config.vocab_size,
                           max_questions=args.max_examples, flag="--tasks") for task in tasks]
    if held_out is not None:
        tokens, where = held_out
        result["held_out"] = {**held_out_loss(loaded.model, tokens, context=context, sequences=args.sequences),
                              "data": where}
    result["tasks"] = {e.task.name: {**task_scores(loaded.model, e), "questions": len(e.task.questions),
                                     "path": str(e.task.path)} for e in encoded}
    result["description"] = loaded.description
    return result


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m eqx_diloco.evaluate",
        description="Held-out loss and perplexity, and multiple-choice accuracy (acc, acc_norm) of a model: an "
        "export of python -m eqx_diloco.export, a run folder or a Hugging Face folder. See docs/evaluate.md.")
    parser.add_argument("model", type=Path, metavar="MODEL",
                        help="an .eqx export, a run folder or a Hugging Face folder")
    parser.add_argument("--tasks", "--eval.tasks", dest="tasks", default=None, metavar="PATH[,PATH...]",
                        help="multiple-choice jsonl files (context, choices, label per line)")
    parser.add_argument("--max-examples", "--eval.max-examples", dest="max_examples", type=int, default=0,
                        help="questions per task file, the first ones (0 = all)")
    parser.add_argument("--tokens", type=Path, default=None,
                        help="a token folder or file (python -m eqx_diloco.prepare) to compute the loss on, all of it")
    parser.add_argument("--data.source", dest="data_source", default=None,
                        choices=["corpus", "text", "tokens", "synthetic"],
                        help="the trainer's data source: the loss is computed on its held-out split "
                             "(default: the run's own, for a run folder or an export of one)")
    parser.add_argument("--data.path", dest="data_path", type=Path, default=None, help="as the trainer's")
    parser.add_argument("--data.eval-fraction", dest="data_eval_fraction", type=float, default=None,
                        help="as the trainer's: the held-out share, from the end")
    parser.add_argument("--data.max-corpus-bytes", dest="data_max_corpus_bytes", type=int, default=None,
                        help="as the trainer's")
    parser.add_argument("--sequences", type=int, default=256,
                        help="held-out windows of --context + 1 tokens for the loss, evenly spread (0 = all)")
    parser.add_argument("--context", type=int, default=None,
                        help="tokens the model sees per sequence (default: its training sequence length; a "
                             "Hugging Face folder's max_position_embeddings)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a tokenizers tokenizer.json to read --tasks with (default: the run's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    return parser


def _check_numbers(args: argparse.Namespace) -> None:
    for flag, value, low in [("--max-examples", args.max_examples, 0), ("--sequences", args.sequences, 0)]:
        if value < low:
            raise ConfigError(f"{flag} must be >= {low} (got {value})")
    if args.context is not None and args.context < 1:
        raise ConfigError(f"--context must be >= 1 (got {args.context})")


def _lines(result: dict[str, Any]) -> list[str]:
    lines = [f"model: {result['description']}, context {result['context']}"]
    if "held_out" in result:
        h = result["held_out"]
        lines.append(f"held-out loss {h['loss']:.4f} (perplexity {h['perplexity']:.3f}) on {h['tokens']:,} tokens "
                     f"of {h['data']}")
    for name, t in result["tasks"].items():
        lines.append(f"{name}: acc {t['acc']:.4f}  acc_norm {t['acc_norm']:.4f}  ({t['questions']} questions)")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        _check_numbers(args)
        result = evaluate(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else "\n".join(_lines(result)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
