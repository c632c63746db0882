"""Orbax checkpoints of a `Syncer`: theta_g, the outer optimizer states, versions and tokens merged.

They are the trainer's checkpoints (`Checkpointer`): every array carries a checksum verified on
restore, and a newest checkpoint that is corrupt, truncated or empty is reported, moved aside to
`<step>.corrupt`, and the newest intact one before it is used. A checkpoint of another run (other
fragment sizes, another outer optimizer) is refused in one line.

A background thread saves the newest state after merges (one save at a time; merges that land
meanwhile are folded into the next save), so a merge never waits for the disk. The step of a
checkpoint is the sum of the fragments' versions, which only grows, also across restarts. A syncer
killed and restarted resumes from the newest complete checkpoint: what it loses is the merges after
it, at most the one in flight plus the one being written, and islands that started from a lost
version are asked to join again. A save that fails is kept as `error` and reported through
`on_error` at once (the command-line syncer stops on it), and again by `close`.
"""

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from ._checkpoint import Checkpointer, CheckpointError, CheckpointSaveError
from ._errors import ConfigError
from ._syncer import Syncer

KIND = "eqx_diloco.syncer"


def _saved_tree(state: dict[str, Any]) -> dict[str, Any]:
    """`Syncer.state_tree` with its 64-bit scalars as 32-bit words (JAX keeps 32 bits by default, and
    the checksums are computed by JAX): versions as int32, tokens merged as the two uint32 halves of
    its float64."""
    return {"theta": state["theta"], "opt_states": state["opt_states"],
            "versions": np.asarray(state["versions"], np.int32),
            "tokens_merged": np.asarray(state["tokens_merged"], np.float64).reshape(1).view(np.uint32)}


def _syncer_tree(saved: dict[str, Any]) -> dict[str, Any]:
    """The inverse of `_saved_tree`, as host arrays."""
    words = np.ascontiguousarray(np.asarray(saved["tokens_merged"], np.uint32))
    return {"theta": [np.asarray(t) for t in saved["theta"]], "opt_states": jax.tree.map(np.asarray, saved["opt_states"]),
            "versions": np.asarray(saved["versions"], np.int64), "tokens_merged": words.view(np.float64)[0]}


class SyncerCheckpoints:
    """Saves and restores one `Syncer` in `directory` (keeps the newest `keep`).

    **Arguments:**

    - `directory`: the checkpoint folder (one sub-folder per step).
    - `keep`: how many checkpoints to keep.
    - `on_error`: called (from the saving thread) with the one-line message of a failed background save.
    """

    def __init__(self, directory: str | Path, *, keep: int = 2, on_error: Callable[[str], None] | None = None):
        self.checkpointer = Checkpointer(Path(directory), every=1, keep=keep)
        self.directory = self.checkpointer.directory
        self.on_error = on_error
        self._pending = threading.Event()
        self._stop = threading.Event()
        self._syncer: Syncer | None = None
        self._thread: threading.Thread | None = None
        self._saved_step: int | None = None
        self.error: CheckpointSaveError | None = None

    def restore(self, syncer: Syncer) -> int | None:
        """Load the newest intact checkpoint into `syncer`; its step, or None when there is none.

        Raises `ConfigError` (one line) for a checkpoint of another run, and `CheckpointError` when
        checkpoints exist but none restores."""
        tree = _saved_tree(syncer.state_tree())
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), tree)
        device = SingleDeviceSharding(jax.devices()[0])
        restored = self.checkpointer.restore_latest(abstract, jax.tree.map(lambda _: device, tree),
                                                    check=lambda saved, step: self._check(saved, syncer))
        if restored is None:
            return None
        state, step = restored
        syncer.load_state_tree(_syncer_tree(state))
        self._saved_step = step
        return step

    @staticmethod
    def _check(saved: dict, syncer: Syncer) -> str | None:
        if saved.get("kind") != KIND:
            return "the checkpoint is not a syncer's"
        sizes = tuple(saved.get("sizes") or ())
        if sizes != syncer.sizes:
            return f"the syncer checkpoint holds fragments of sizes {sizes}, this run makes {syncer.sizes}"
        return None

    def save_now(self, syncer: Syncer) -> None:
        """Save `syncer`'s state now, unless a checkpoint of its step exists (raises `CheckpointSaveError`)."""
        tree = syncer.state_tree()
        step = int(np.sum(tree["versions"]))
        if step == self._saved_step:
            return
        self.checkpointer.save(step, _saved_tree(tree), metadata={"kind": KIND, "sizes": list(syncer.sizes)})
        self.checkpointer.wait()
        self._saved_step = step

    def follow(self, syncer: Syncer) -> None:
        """Save `syncer` in the background after every `mark` (call `mark` from its merge callback)."""
        self._syncer = syncer
        self._thread = threading.Thread(target=self._run, name="syncer-checkpoints", daemon=True)
        self._thread.start()

    def mark(self) -> None:
        self._pending.set()

    def _run(self) -> None:
        while not self._stop.is_set() and self.error is None:
            if not self._pending.wait(0.1):
                continue
            self._pending.clear()
            try:
                self.save_now(self._syncer)
            except CheckpointSaveError as e:
                self.error = e
                if self.on_error is not None:
                    self.on_error(str(e))

    def close(self) -> None:
        """Write the newest state and stop the background thread. Raises the first failed save's
        `CheckpointSaveError`, or the final save's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        error = self.error
        if error is None and self._syncer is not None:
            try:
                self.save_now(self._syncer)
            except CheckpointSaveError as e:
                error = e
        try:
            self.checkpointer.close()
        except Exception:  # noqa: BLE001 - orbax raising the failed save's error again
            if error is None:
                raise
        if error is not None:
            raise error


def read_theta(directory: str | Path, *, step: int | None = None) -> tuple[int, list[np.ndarray]]:
    """(step, theta_g's fragments as flat float32 vectors) of the newest syncer checkpoint in `directory`
    whose theta reads back and matches its checksums, or of `step`; for export, while a syncer may still
    be writing (nothing is created, moved or deleted). Raises `ConfigError` naming the folder when there
    is none to read."""
    directory = Path(directory).absolute()
    checkpointer = Checkpointer(directory, every=1, keep=1, read_only=True)
    try:
        if step is None and not checkpointer.steps():
            raise ConfigError(f"no syncer checkpoint in {directory} (the syncer saves one after its merges)")
        found, _, _, arrays = checkpointer.restore_subtree(("['theta']",), step=step)
    except CheckpointError as e:
        raise ConfigError(str(e).replace("no checkpoint", "no syncer checkpoint", 1)) from None
    finally:
        checkpointer.close()
    return found, [np.asarray(a, np.float32).reshape(-1) for a in arrays.values()]  # in fragment order
