"""Orbax checkpoints of the whole train state, with auto-resume and fault handling.

A checkpoint (one folder per step) holds three items:

- `state`: every array leaf of the `TrainState` (replica params, per-replica inner optimizer
  states, global params, outer optimizer states, quantization residuals, per-replica PRNG
  key data, step), keyed by leaf index;
- `config`: the resolved config, as JSON;
- `meta`: the step, each leaf's path, shape and dtype, and a checksum of each leaf.

The data position needs no saving: the batch of step t is a function of (seed, replica, t).
An in-flight fragment sync needs none either as long as its result is in the state: a sync
writes the new global values into `global_params` at once, and the merge tau steps later is
a function of the step. (A trainer that keeps a launched sync outside the state must
install it before saving.)

Saving is asynchronous: `save` returns once the arrays are copied to host memory; orbax
writes them in a background thread. Orbax writes each checkpoint into a temporary folder
and renames it when complete, so a process killed mid-save leaves nothing that looks like
a checkpoint (leftover temporary folders are deleted on the next start). On restore, a
checkpoint that fails to load, or whose arrays do not match the checksums written with
them, is reported, moved aside as `<step>.corrupt`, and the previous one is used.
"""

import contextlib
import dataclasses
import sys
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from ._checksums import checksums
from ._errors import ConfigError
from ._json import json_metadata

PyTree = Any

FORMAT = 1  # bump when the layout of `meta` or of the state keys changes

class CheckpointError(ConfigError):
    """Checkpoints exist but none of them can be restored (reported like a config error)."""


class CheckpointSaveError(RuntimeError):
    """An asynchronous save failed (unwritable or full disk, folder removed). Its message is one line.

    Orbax reports the failure of a background save at the next `save` or `wait`; `Checkpointer`
    turns it into this error. Orbax's background threads of a failed save may never finish,
    so a command-line program should leave with `os._exit` after this error (`train.py` does).
    """


def _orbax():
    """`orbax.checkpoint`, imported at its first use: importing it costs a fifth of a second of every
    start, and a fresh run that saves no checkpoint never needs it."""
    import orbax.checkpoint as ocp

    return ocp


def leaf_paths(tree: PyTree) -> list[str]:
    """`jax.tree_util.keystr` of every array leaf of `tree`, in flatten order (e.g. ".global_params.embed")."""
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _layout(leaves) -> list[list]:
    return [[list(x.shape), str(np.dtype(x.dtype))] for x in leaves]


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _first_line(e: BaseException, limit: int = 200) -> str:
    text = (str(e).strip().splitlines() or [""])[0]
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


@dataclasses.dataclass
class Checkpointer:
    """Saves every `every` steps (keeping the newest `keep`) into `directory`; restores the latest.

    **Arguments:**

    - `directory`: the checkpoint folder (one sub-folder per step).
    - `every`: steps between saves (0 = never save).
    - `keep`: how many checkpoints to keep.
    - `read_only`: only read (for export while a run may still be writing): nothing is
      deleted, moved or created.
    """

    directory: Path
    every: int
    keep: int
    read_only: bool = False

    def __post_init__(self):
        for name, value, least in (("every", self.every, 0), ("keep", self.keep, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(f"Checkpointer {name} must be an int >= {least} (got {value!r})")
        self.directory = Path(self.directory).absolute()
        self._manager = None
        self._unconfirmed: int | None = None  # the step of a save not known to have finished

    @property
    def manager(self) -> "orbax.checkpoint.CheckpointManager":  # noqa: F821 (imported lazily)
        if self._manager is None:
            ocp = _orbax()
            options = ocp.CheckpointManagerOptions(
                max_to_keep=None if self.read_only else self.keep,
                save_interval_steps=0 if self.read_only else 1,
                enable_async_checkpointing=not self.read_only,
                create=not self.read_only,
                cleanup_tmp_directories=not self.read_only,  # folders of saves cut short by a kill
                read_only=self.read_only,
            )
            self._manager = ocp.CheckpointManager(
                self.directory, item_names=("state", "config", "meta"), options=options
            )
        return self._manager

    def due(self, step: int) -> bool:
        """Whether `step` is on the save schedule (`DiLoCo.save` saves only then, unless forced)."""
        return self.every > 0 and step % self.every == 0

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints on disk, newest first."""
        if not self.directory.is_dir() or not any(entry.name.isdigit() for entry in self.directory.iterdir()):
            return []  # no step folder: nothing for orbax to find (and no need to import it)
        self.manager.reload()  # another process (or a kill) may have changed the folder
        return sorted(self.manager.all_steps(), reverse=True)

    def _candidates(self, step: int | None) -> list[int]:
        """The steps to try restoring, newest first: all of them, or just `step` (which must exist)."""
        steps = self.steps()
        if step is None:
            return steps
        if step not in steps:
            raise CheckpointError(f"no checkpoint of step {step} in {self.directory} (found {sorted(steps)})")
        return [step]

    # -- save -----------------------------------------------------------------------------

    def save(self, step: int, state: PyTree, metadata: Any = None) -> None:
        """Start an asynchronous save of `state` at `step` (returns once arrays are copied).

        `metadata` (a dict, or a dataclass such as the CLI's `Config`) is stored as JSON beside
        the arrays and handed to the `check` of `restore_latest`.
        """
        if self.every <= 0 or self.read_only:
            return
        config = json_metadata(metadata)
        ocp = _orbax()
        leaves = jax.tree.leaves(state)
        meta = {
            "format": FORMAT,
            "step": int(step),
            "paths": leaf_paths(state),
            "layout": _layout(leaves),
            "checksums": checksums(leaves),
        }
        self.wait()  # a failure of the previous save is reported as such, before this one starts
        with self._save_errors(step):
            saved = self.manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave({str(i): x for i, x in enumerate(leaves)}),
                    config=ocp.args.JsonSave(config),
                    meta=ocp.args.JsonSave(meta),
                ),
            )
        self._unconfirmed = int(step) if saved else None
        if not saved:
            _warn(f"checkpoint {step} was not written: {self.directory} already holds step "
                  f"{self.manager.latest_step()}")

    # -- restore --------------------------------------------------------------------------

    def read_json(self, step: int) -> tuple[dict, dict]:
        """(config, meta) JSON items of checkpoint `step`."""
        ocp = _orbax()
        items = self.manager.restore(
            step, args=ocp.args.Composite(config=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore())
        )
        config, meta = items["config"], items["meta"]
        if not isinstance(config, dict) or not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError("config or meta item is missing or of another format")
        return config, meta

    def _restore_step(self, step: int, abstract_state: PyTree, shardings: PyTree, meta: dict) -> PyTree:
        ocp = _orbax()
        leaves, treedef = jax.tree.flatten(abstract_state)
        layout = _layout(leaves)
        if meta["layout"] != layout:
            paths = leaf_paths(abstract_state)
            if len(meta["layout"]) != len(layout):
                raise ConfigError(
                    f"checkpoint is incompatible with this config: it holds {len(meta['layout'])} state arrays, "
                    f"this config makes {len(layout)} (an optimizer setting that shapes the state changed)"
                )
            i = next(i for i, (a, b) in enumerate(zip(meta["layout"], layout)) if a != b)
            raise ConfigError(
                f"checkpoint is incompatible with this config: state{paths[i]} was saved as "
                f"{meta['layout'][i][1]}{meta['layout'][i][0]}, this config makes {layout[i][1]}{layout[i][0]}"
            )
        targets = {
            str(i): jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
            for i, (x, s) in enumerate(zip(leaves, jax.tree.leaves(shardings)))
        }
        restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(targets)))
        restored = restored["state"]
        values = [restored[str(i)] for i in range(len(leaves))]
        for i, (value, target) in enumerate(zip(values, targets.values())):
            if value.shape != target.shape or value.dtype != target.dtype:
                raise ValueError(f"array {meta['paths'][i]} came back as {value.dtype}{value.shape}")
        got = checksums(values)
        for i, (a, b) in enumerate(zip(got, meta["checksums"])):
            if a != b:
                raise ValueError(f"checksum mismatch in state{meta['paths'][i]}")
        return jax.tree.unflatten(treedef, values)

    def restore_latest(
        self,
        abstract_state: PyTree,
        shardings: PyTree,
        check: Callable[[dict, int], str | None] | None = None,
        *,
        step: int | None = None,
    ):
        """(state, step) from the newest checkpoint that restores intact, or None if there is none.

        Every array is placed on its sharding from `shardings` (a tree like `abstract_state`).
        A checkpoint that can't be read or fails its checksums is reported and skipped; once an
        older one restores, the skipped ones are moved aside to `<step>.corrupt` (so the run
        can write those steps again). `step` restores that checkpoint only.

        `check(saved_metadata, step)` returns a one-line reason why the checkpoint cannot
        resume this run, or None (the CLI passes `resume.incompatibility`).

        Raises `ConfigError` if `check` refuses the newest readable checkpoint, and
        `CheckpointError` if checkpoints exist but none restores.
        """
        steps = self._candidates(step)
        if not steps:
            return None
        corrupt: list[tuple[int, str]] = []
        for s in steps:
            try:
                saved_config, meta = self.read_json(s)
            except Exception as e:  # noqa: BLE001 - any failure means this checkpoint is unusable
                corrupt.append((s, _first_line(e)))
                self._report(s, corrupt[-1][1])
                continue
            problem = None if check is None else check(saved_config, s)
            if problem is not None:
                raise ConfigError(f"{problem} (checkpoint step {s} in {self.directory})")
            try:
                state = self._restore_step(s, abstract_state, shardings, meta)
            except ConfigError as e:
                raise ConfigError(f"{e} (checkpoint step {s} in {self.directory})") from None
            except Exception as e:  # noqa: BLE001
                corrupt.append((s, _first_line(e)))
                self._report(s, corrupt[-1][1])
                continue
            if corrupt and not self.read_only:
                self._move_aside([c for c, _ in corrupt])
            if corrupt:
                _warn(f"resuming from checkpoint {s} in {self.directory}")
            return state, s
        newest, reason = corrupt[0]
        raise CheckpointError(
            f"none of the {len(steps)} checkpoints in {self.directory} can be restored (step {newest}: {reason}); "
            f"move that folder away to start over"
        )

    def restore_subtree(
        self, prefixes: tuple[str, ...], *, step: int | None = None
    ) -> tuple[int, dict, str, dict[str, np.ndarray]]:
        """Host copies of the state leaves under the first of `prefixes` the checkpoint holds.

        E.g. `(".global_params", ".params")`. Needs no abstract state, mesh or devices of the
        training run: the leaf paths are in the checkpoint's metadata. Takes the newest
        checkpoint whose leaves restore and match their checksums (or `step`).
        Returns (step, saved config JSON, prefix, {path: array}).
        """
        ocp = _orbax()
        steps = self._candidates(step)
        if not steps:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        failures = []
        for s in steps:
            try:
                saved_config, meta = self.read_json(s)
                under = lambda prefix: [  # noqa: E731
                    i for i, p in enumerate(meta["paths"]) if p == prefix or p.startswith((prefix + ".", prefix + "["))
                ]
                prefix = next((p for p in prefixes if under(p)), None)
                if prefix is None:
                    raise CheckpointError(f"checkpoint {s} in {self.directory} holds none of {', '.join(prefixes)}")
                keys = under(prefix)
                item = {str(i): np.zeros(meta["layout"][i][0], meta["layout"][i][1]) for i in keys}
                restore_args = {k: ocp.RestoreArgs(restore_type=np.ndarray) for k in item}
                restored = self.manager.restore(
                    s,
                    args=ocp.args.Composite(
                        state=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
                    ),
                )["state"]
                values = [np.asarray(restored[str(i)]) for i in keys]
                for i, value, got in zip(keys, values, checksums(values)):
                    if got != meta["checksums"][i]:
                        raise ValueError(f"checksum mismatch in state{meta['paths'][i]}")
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001
                failures.append((s, _first_line(e)))
                self._report(s, failures[-1][1])
                continue
            return s, saved_config, prefix, {meta["paths"][i]: v for i, v in zip(keys, values)}
        newest, reason = failures[0]
        raise CheckpointError(f"none of the {len(steps)} checkpoints in {self.directory} can be restored "
                              f"(step {newest}: {reason})")

    def _report(self, step: int, reason: str) -> None:
        _warn(f"checkpoint {step} in {self.directory} is corrupt or incomplete ({reason}); trying an older one")

    def _move_aside(self, steps: list[int], suffix: str = "corrupt") -> None:
        self.close()
        if jax.process_index() == 0:
            for s in steps:
                source = self.directory / str(s)
                target = self.directory / f"{s}.{suffix}"
                n = 1
                while target.exists():
                    target, n = self.directory / f"{s}.{suffix}-{n}", n + 1
                if source.exists():
                    source.rename(target)
                    _warn(f"moved {suffix} checkpoint {s} to {target}")
        if jax.process_count() > 1:
            from orbax.checkpoint import multihost

            multihost.sync_global_processes("eqx_diloco_move_corrupt_checkpoints")

    # -- lifecycle ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _save_errors(self, step: int):
        """Turns any exception of orbax's save machinery into a one-line `CheckpointSaveError`."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - OSError, or whatever orbax wraps it in
            self._unconfirmed = None
            raise CheckpointSaveError(
                f"saving checkpoint {step} in {self.directory} failed ({_first_line(e)}); "
                f"the checkpoints saved before it are intact"
            ) from None

    def wait(self) -> None:
        """Block until pending asynchronous saves are complete. Raises `CheckpointSaveError` if one failed."""
        if self._manager is not None and self._unconfirmed is not None:
            with self._save_errors(self._unconfirmed):
                self._manager.wait_until_finished()
            self._unconfirmed = None
        elif self._manager is not None:
            self._manager.wait_until_finished()

    def poll(self) -> None:
        """Raise `CheckpointSaveError` at once if the last asynchronous save has finished and failed.

        Cheap (no waiting): the trainer calls it at every step boundary, so a failed save stops the
        run within a step of the failure instead of at the next save.
        """
        if self._manager is not None and self._unconfirmed is not None and not self._manager.is_saving_in_progress():
            self.wait()

    def supersede(self, step: int) -> list[int]:
        """Move checkpoints newer than `step` aside to `<s>.superseded` (for `--checkpoint.restore-step`):
        the run continues from `step` and writes those steps again. Returns the steps moved."""
        newer = [s for s in self.steps() if s > step]
        if newer and not self.read_only:
            self._move_aside(newer, suffix="superseded")
        return newer

    def close(self) -> None:
        if self._manager is not None:
            self.wait()
            self._manager.close()
            self._manager = None
