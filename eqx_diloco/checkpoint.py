"""Orbax checkpoints of the whole train state, with auto-resume.

A checkpoint holds every leaf of the `TrainState` (replica params, per-replica inner
optimizer states, global params, outer optimizer states, error-feedback residuals, PRNG
keys, step) and, as JSON, the resolved config. The data position needs no saving: the
batch of step t is a function of (seed, replica, t). In-flight fragment syncs need none
either: a sync writes its result into the global params at once, and the merge tau steps
later is a function of the step.

Saving is asynchronous (orbax writes in a background thread after copying the arrays
off the devices). Orbax writes each checkpoint into a temporary folder and renames it
only when complete, so a process killed mid-save leaves no checkpoint that looks valid;
a checkpoint that fails to restore (corrupt files) is reported and the previous one used.
"""

import dataclasses
import sys
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from .config import Config, ConfigError
from .metrics import to_jsonable

# Config fields that change the shape or meaning of the saved state. Anything else
# (steps, logging, evaluation, learning rate, checkpoint cadence) may change on resume.
_STATE_DEFINING = {
    "algorithm": "--algorithm",
    "model": "--model",
    "diloco.num_replicas": "--diloco.num-replicas",
    "diloco.num_fragments": "--diloco.num-fragments",
    "diloco.fragment_pattern": "--diloco.fragment-pattern",
    "diloco.error_feedback": "--diloco.error-feedback",
    "diloco.quantize": "--diloco.quantize",
    "diloco.router_sync_period": "--diloco.router-sync-period",
}


def _lookup(tree: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree[part]
    return tree


def incompatibility(saved: dict, current: Config) -> str | None:
    """A one-line description of why a checkpoint written with `saved` can't resume `current`."""
    now = to_jsonable(current)
    for dotted, flag in _STATE_DEFINING.items():
        old, new = _lookup(saved, dotted), _lookup(now, dotted)
        if old != new:
            if isinstance(old, dict):
                diffs = [f"{flag}.{k.replace('_', '-')} {old[k]} -> {new[k]}" for k in old if old.get(k) != new.get(k)]
                return "checkpoint is incompatible with this config: " + ", ".join(diffs)
            return f"checkpoint is incompatible with this config: {flag} {old} -> {new}"
    return None


@dataclasses.dataclass
class Checkpointer:
    """Saves every `every` steps (keeping `keep`) into `directory`, and restores the latest.

    **Arguments:**

    - `directory`: the checkpoint folder.
    - `every`: steps between saves (0 = never, except that nothing is saved then at all).
    - `keep`: how many checkpoints to keep.
    """

    directory: Path
    every: int
    keep: int

    def __post_init__(self):
        self.directory = Path(self.directory).absolute()
        self._manager = None

    @property
    def manager(self) -> ocp.CheckpointManager:
        if self._manager is None:
            options = ocp.CheckpointManagerOptions(
                max_to_keep=self.keep, enable_async_checkpointing=True, create=True
            )
            self._manager = ocp.CheckpointManager(self.directory, options=options)
        return self._manager

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, step: int, state, config: Config) -> None:
        """Start an asynchronous save of `state` at `step` (returns once arrays are copied)."""
        if self.every <= 0:
            return
        leaves = {str(i): x for i, x in enumerate(jax.tree.leaves(state))}
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(leaves), config=ocp.args.JsonSave(to_jsonable(config))
            ),
        )

    def restore_latest(self, abstract_state, shardings, config: Config):
        """(state, step) from the newest checkpoint that restores, or None if there is none.

        Raises `ConfigError` if the newest checkpoint was written by an incompatible config.
        """
        if not self.directory.exists():
            return None
        steps = sorted(self.manager.all_steps(), reverse=True)
        leaves, treedef = jax.tree.flatten(abstract_state)
        targets = {
            str(i): jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
            for i, (x, s) in enumerate(zip(leaves, jax.tree.leaves(shardings)))
        }
        for step in steps:
            try:
                saved_config = self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))[
                    "config"
                ]
            except Exception as e:  # noqa: BLE001 - any failure means this checkpoint is unusable
                print(f"warning: checkpoint {step} in {self.directory} is unreadable ({e!r}); trying an older one",
                      file=sys.stderr)
                continue
            problem = incompatibility(saved_config, config)
            if problem is not None:
                raise ConfigError(f"{problem} (checkpoint step {step} in {self.directory})")
            try:
                restored = self.manager.restore(
                    step, args=ocp.args.Composite(state=ocp.args.StandardRestore(targets))
                )["state"]
            except Exception as e:  # noqa: BLE001
                print(f"warning: checkpoint {step} in {self.directory} is corrupt ({type(e).__name__}: {e}); "
                      f"trying an older one", file=sys.stderr)
                continue
            state = jax.tree.unflatten(treedef, [restored[str(i)] for i in range(len(leaves))])
            return state, step
        return None

    def wait(self) -> None:
        """Block until pending asynchronous saves are complete."""
        if self._manager is not None:
            self._manager.wait_until_finished()

    def close(self) -> None:
        if self._manager is not None:
            self._manager.close()
            self._manager = None
