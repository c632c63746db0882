"""Whether a checkpoint written by one CLI config may resume a run with another.

The CLI's policy, on top of the model-agnostic `Checkpointer`: the config fields that give
the saved state its shape or meaning must match; schedule changes are refused while a
fragment's sync is in flight.
"""

import dataclasses
import json
import typing
from pathlib import Path
from typing import Any

from .. import schedule
from .._errors import ConfigError
from .config import Config
from .._checkpoint import _first_line
from .._json import to_jsonable


# Config fields that change the shape or meaning of the saved state. Anything else
# (steps, logging, evaluation, learning rate, data, mesh) may change on resume.
_STATE_DEFINING = {
    "algorithm": "--algorithm",
    "model": "--model",
    "diloco.num_replicas": "--diloco.num-replicas",
    "diloco.num_fragments": "--diloco.num-fragments",
    "diloco.fragment_pattern": "--diloco.fragment-pattern",
    "diloco.error_feedback": "--diloco.error-feedback",
    "diloco.quantize": "--diloco.quantize",
    "diloco.router_sync_period": "--diloco.router-sync-period",
    "diloco.outer_overlap": "--diloco.outer-overlap",
}


# Model fields that say how the model runs, not what its parameters are: free to change on resume
# (a run may go on in bfloat16, with remat or unrolled, from a float32 checkpoint). `init_from` only
# gave the first weights: a checkpoint replaces them.
_RUN_ONLY_MODEL = ("dtype", "attention", "scan_unroll", "remat", "init_from")


def _lookup(tree: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree[part]
    if dotted == "model" and isinstance(tree, dict):
        return {k: v for k, v in tree.items() if k not in _RUN_ONLY_MODEL}
    return tree


def _with_defaults(saved: Any, defaults: Any) -> Any:
    """`saved` with the keys it lacks (fields added to the config since) taken from `defaults`."""
    if not isinstance(saved, dict) or not isinstance(defaults, dict):
        return saved
    return {**defaults, **{k: _with_defaults(v, defaults.get(k)) for k, v in saved.items()}}


def _flag(prefix: str, key: str) -> str:
    return f"{prefix}.{key.replace('_', '-')}"


def _in_flight(step: int, sync_period: int, num_fragments: int, overlap_steps: int) -> list[tuple[int, int]]:
    """(fragment, sync step) of every sync whose merge is still due after step `step`."""
    out = []
    for s in range(max(1, step - overlap_steps + 1), step + 1):
        p = schedule.synced_fragment(s, sync_period, num_fragments)
        if p is not None and s + overlap_steps > step:
            out.append((p, s))
    return out


def incompatibility(saved: dict, current: Config, step: int | None = None) -> str | None:
    """A one-line reason why a checkpoint written with config `saved` can't resume `current`.

    `step` (the checkpoint's step) enables the check that the sync schedule is not changed
    while a fragment's sync is in flight.
    """
    now = to_jsonable(current)
    saved = _with_defaults(saved, to_jsonable(Config()))
    for dotted, flag in _STATE_DEFINING.items():
        old, new = _lookup(saved, dotted), _lookup(now, dotted)
        if old != new:
            if isinstance(old, dict):
                diffs = [f"{_flag(flag, k)} {old.get(k)} -> {new.get(k)}" for k in {**old, **new}
                         if old.get(k) != new.get(k)]
                return "checkpoint is incompatible with this config: " + ", ".join(diffs)
            return f"checkpoint is incompatible with this config: {flag} {old} -> {new}"
    if now["algorithm"] != "diloco":
        return None
    old_d, new_d = saved["diloco"], now["diloco"]
    if (old_d["outer_momentum"] == 0) != (new_d["outer_momentum"] == 0):
        return (
            "checkpoint is incompatible with this config: --diloco.outer-momentum "
            f"{old_d['outer_momentum']} -> {new_d['outer_momentum']} (turning momentum on or off changes the "
            "outer optimizer state)"
        )
    changed = [k for k in ("sync_period", "overlap_steps") if old_d[k] != new_d[k]]
    if changed and step is not None:
        P = new_d["num_fragments"]
        before = _in_flight(step, old_d["sync_period"], P, old_d["overlap_steps"])
        after = _in_flight(step, new_d["sync_period"], P, new_d["overlap_steps"])
        if before != after:
            p, s = (before or after)[0]
            diffs = ", ".join(f"{_flag('--diloco', k)} {old_d[k]} -> {new_d[k]}" for k in changed)
            return (
                f"checkpoint is incompatible with this config: {diffs} while the sync of fragment {p} "
                f"(step {s}) is in flight at checkpoint step {step}; resume with the old schedule past step "
                f"{step + max(old_d['overlap_steps'], new_d['overlap_steps'])} first"
            )
    return None


def config_from_dict(data: dict, cls: type = Config) -> Any:
    """Rebuild a config dataclass from its JSON form (`metrics.to_jsonable`); unknown keys are ignored."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for field in dataclasses.fields(cls):
        if field.name not in data:
            continue
        value, hint = data[field.name], hints[field.name]
        if dataclasses.is_dataclass(hint):
            value = config_from_dict(value, hint)
        elif value is not None and Path in (typing.get_args(hint) or (hint,)):
            value = Path(value)
        kwargs[field.name] = value
    return cls(**kwargs)


def read_run_config(run_dir: Path) -> Config:
    """The config a run was started with (`<run_dir>/config.json`)."""
    path = Path(run_dir) / "config.json"
    try:
        return config_from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        raise ConfigError(f"{run_dir} is not a run folder: {path} does not exist") from None
    except (json.JSONDecodeError, TypeError, KeyError) as e:
        raise ConfigError(f"{path} is not a valid config ({_first_line(e)})") from None
