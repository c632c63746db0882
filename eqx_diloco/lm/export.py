"""`python -m eqx_diloco.export RUN_DIR [OUT]`: write a run's global model alone, for evaluation or sampling.

The global model is theta_g for DiLoCo / Streaming DiLoCo and replica 0 for ddp (all its
replicas are equal). It is read from the newest intact checkpoint of the run (the leaves of
that model only: no mesh, no training devices, no optimizer state); for a decoupled run, from
the syncer's newest checkpoint (`RUN_DIR/syncer/checkpoints`, with `RUN_DIR/syncer/config.json`).
It is written as

- `OUT` (default `RUN_DIR/model.eqx`): the model's arrays (`equinox.tree_serialise_leaves`);
- `OUT.json`: the `TransformerConfig` and where the model came from.

Load it with `load_model(OUT)`, a plain `models.Transformer`:

    from eqx_diloco.export import load_model
    model = load_model("runs/default/model.eqx")
    logits = model(tokens)            # tokens: int32 (seq,)

Sample from it with `python -m eqx_diloco.sample OUT --prompt "def "`.
"""

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from models import Transformer, TransformerConfig

from .._checkpoint import Checkpointer, CheckpointError, leaf_paths
from .resume import config_from_dict, read_run_config
from .config import Config, ConfigError
from .._json import to_jsonable

FORMAT = "eqx_diloco.model/1"


def config_path(model_path: Path | str) -> Path:
    """The JSON written next to an exported model."""
    return Path(f"{model_path}.json")


def checkpoint_dir(run_dir: Path) -> Path:
    """The checkpoint folder of `run_dir` (or `run_dir` itself if it holds step folders)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"run folder does not exist: {run_dir}")
    if any(p.name.isdigit() for p in run_dir.iterdir()):
        return run_dir
    if (run_dir / "config.json").exists():
        configured = read_run_config(run_dir).checkpoint.dir
        if configured is not None:
            return Path(configured)
    return run_dir / "checkpoints"


def _abstract_model(model_config: TransformerConfig) -> Transformer:
    return eqx.filter_eval_shape(Transformer, model_config, key=jax.random.key(0))


def _assemble(model_config: TransformerConfig, leaves: dict[str, np.ndarray], prefix: str, take_first: bool,
              average: bool = False):
    """Build a Transformer from checkpoint leaves `{prefix + path_in_model: array}`.

    `take_first`: the leaves carry a replica axis; take replica 0. `average`: average it
    (eager outer overlap keeps one anchor per replica; the global model is their mean).
    """
    like = _abstract_model(model_config)
    values = []
    for path, shaped in zip(leaf_paths(like), jax.tree.leaves(like)):
        key = prefix + path
        if key not in leaves:
            raise CheckpointError(f"the checkpoint holds no {key} (it was written by another model layout)")
        value = leaves[key][0] if take_first else leaves[key]
        if average:
            value = np.mean(value, axis=0, dtype=np.float32).astype(value.dtype)
        if value.shape != shaped.shape or value.dtype != shaped.dtype:
            raise CheckpointError(f"{key} is {value.dtype}{value.shape} in the checkpoint, the model wants "
                                  f"{shaped.dtype}{shaped.shape}")
        values.append(jnp.asarray(value))
    return jax.tree.unflatten(jax.tree.structure(like), values)


def restore_global_model(run_dir: Path | str, *, step: int | None = None) -> tuple[Transformer, Config, int]:
    """(global model, config it was trained with, step) from the newest intact checkpoint of `run_dir`
    (a decoupled run's: its syncer's)."""
    syncer = decoupled_syncer_dir(Path(run_dir))
    if syncer is not None:
        return _restore_decoupled_global_model(syncer, step=step)
    checkpointer = Checkpointer(checkpoint_dir(Path(run_dir)), every=0, keep=1, read_only=True)
    try:
        if not checkpointer.steps():
            raise CheckpointError(f"no checkpoint in {checkpointer.directory} (train with --checkpoint.every > 0)")
        # theta_g for DiLoCo; ddp keeps no global copy: replica 0 (its replicas are all equal).
        found, saved, prefix, leaves = checkpointer.restore_subtree((".global_params", ".params"), step=step)
    finally:
        checkpointer.close()
    config = config_from_dict(saved)
    eager = config.algorithm == "diloco" and config.diloco.outer_overlap == "eager" and prefix == ".global_params"
    model = _assemble(config.model, leaves, prefix, take_first=prefix == ".params", average=eager)
    return model, config, found


def decoupled_syncer_dir(run_dir: Path) -> Path | None:
    """The syncer folder of a decoupled run (`run_dir/syncer`, or `run_dir` itself if it is one), else None."""
    for folder in (run_dir / "syncer", run_dir):
        if (folder / "address.json").is_file() or (folder.name == "syncer" and (folder / "checkpoints").is_dir()):
            return folder
    return None


def _restore_decoupled_global_model(syncer: Path, *, step: int | None) -> tuple[Transformer, Config, int]:
    """theta_g of the syncer's newest checkpoint that reads back (or `step`, the sum of its fragments'
    versions), put into the run's model the way the syncer and the islands cut it into fragments."""
    from .._fragments import Fragmenter
    from .._island import install_fragment
    from .island import initial_model
    from .._syncer_checkpoint import read_theta

    if not (syncer / "config.json").is_file():
        raise ConfigError(f"{syncer / 'config.json'} does not exist: this decoupled run's syncer did not record its "
                          f"config (a syncer of an older version)")
    config = read_run_config(syncer)
    found, theta = read_theta(syncer / "checkpoints", step=step)
    # Zeros of the model's shapes, every one overwritten below: no random init, and no read of a
    # --model.init-from folder that may have moved since.
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), _abstract_model(config.model))
    params, static = eqx.partition(zeros, eqx.is_inexact_array)
    if jax.tree.leaves(static):  # arrays no fragment carries would stay zeros: make them as the syncer did
        params, static = eqx.partition(initial_model(config), eqx.is_inexact_array)
    d = config.diloco
    fragmenter = Fragmenter.for_model(params, lambda m: m.blocks, d.num_fragments, d.fragment_pattern)
    sizes = [sum(int(np.prod(v.shape)) for v in fragmenter.get(params, f)) for f in range(d.num_fragments)]
    if [t.size for t in theta] != sizes:
        raise CheckpointError(f"the syncer checkpoint holds fragments of sizes {[t.size for t in theta]}, "
                              f"{syncer / 'config.json'} makes {sizes}")
    for fragment, vector in enumerate(theta):
        params = install_fragment(params, fragmenter, fragment, vector)
    return eqx.combine(params, static), config, found


def save_model(path: Path | str, model: Transformer, info: dict[str, Any] | None = None) -> None:
    """Write `model` to `path` and its config (plus `info`) to `path.json`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:  # a file object: equinox would append ".eqx" to a bare path
        eqx.tree_serialise_leaves(f, model)
    meta = {"format": FORMAT, "model": to_jsonable(model.config), **(info or {})}
    config_path(path).write_text(json.dumps(meta, indent=2) + "\n")


def load_model(path: Path | str) -> Transformer:
    """The `models.Transformer` written by `export` / `save_model` at `path`."""
    meta = read_model_info(path)
    try:
        model_config = config_from_dict(meta["model"], TransformerConfig)
        like = _abstract_model(model_config)
    except Exception as e:  # noqa: BLE001 - any failure means the description is unusable
        raise ConfigError(f"{config_path(path)} does not describe a valid model ({_first_line(e)})") from None
    try:
        with Path(path).open("rb") as f:
            model = eqx.tree_deserialise_leaves(f, like)
            trailing = f.read(1)
    except Exception as e:  # noqa: BLE001 - truncated, random or mismatched bytes
        raise ConfigError(f"{path} is not the model {config_path(path)} describes ({_first_line(e)})") from None
    if trailing:
        raise ConfigError(f"{path} is larger than the model {config_path(path)} describes (mismatched files?)")
    return model


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:200]


def read_model_info(path: Path | str) -> dict[str, Any]:
    """The JSON next to an exported model (its TransformerConfig under "model", and provenance)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no exported model at {path}")
    try:
        meta = json.loads(config_path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{config_path(path)} is missing (it holds the model's config)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{config_path(path)} is not readable JSON ({_first_line(e)})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("model"), dict):
        raise ConfigError(f"{config_path(path)} is not an eqx_diloco model description")
    return meta


def export(run_dir: Path | str, out: Path | str, *, step: int | None = None) -> dict[str, Any]:
    """Write the global model of `run_dir`'s newest intact checkpoint (or `step`) to `out`."""
    out = Path(out)
    for target, what in [(out, "OUT"), (config_path(out), "OUT.json")]:
        if target.is_dir():
            raise ConfigError(f"{what} is an existing folder: {target} (give a file name)")
    model, config, found = restore_global_model(run_dir, step=step)
    info = {
        "step": found,
        "algorithm": config.algorithm,
        # The folder holding the run's config.json (a decoupled run's: its syncer's), for evaluate and sample.
        "run_dir": str((decoupled_syncer_dir(Path(run_dir)) or Path(run_dir)).absolute()),
        "seq_len": config.train.seq_len,  # the context length it was trained on
        "data_source": config.data.source,
    }
    save_model(out, model, info)
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m eqx_diloco.export",
        description="Write the global model of a run (theta_g; replica 0 for ddp) from its newest intact "
        "checkpoint, for evaluation or sampling with models.Transformer.",
    )
    parser.add_argument("run_dir", type=Path, help="the run folder (its --run-dir) or its checkpoint folder")
    parser.add_argument("out", type=Path, nargs="?", default=None,
                        help="output file (default: RUN_DIR/model.eqx); its config goes to OUT.json. With --format "
                        "hf: a new folder (default: RUN_DIR/hf)")
    parser.add_argument("--step", type=int, default=None, help="export this checkpoint step (default: newest)")
    parser.add_argument("--format", choices=("eqx", "hf"), default="eqx",
                        help="eqx: model.eqx + JSON for this package; hf: a Hugging Face folder (config.json, "
                        "model.safetensors, the tokenizer) for transformers, vLLM, lm-evaluation-harness")
    args = parser.parse_intermixed_args(argv)  # `RUN --format hf OUT` as well as `RUN OUT --format hf`
    if args.format == "hf":
        from .hf import main_hf

        return main_hf(args)
    if args.out is None:  # beside the run's metrics, not wherever the command happens to run
        args.out = args.run_dir / "model.eqx"
    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's notes on read-only folders
    try:
        info = export(args.run_dir, args.out, step=args.step)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: OUT cannot be written: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    print(f"exported the global model of {args.run_dir} at step {info['step']} to {args.out} "
          f"(config in {config_path(args.out)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
