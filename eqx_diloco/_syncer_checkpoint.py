"""Orbax checkpoints of a `Syncer`: theta_g, the outer optimizer states, versions and tokens merged.

A background thread saves the newest state after merges (one save at a time; merges that land
meanwhile are folded into the next save), so a merge never waits for the disk. The step of a
checkpoint is the sum of the fragments' versions, which only grows, also across restarts. A syncer
killed and restarted resumes from the newest complete checkpoint: what it loses is the merges after
it, at most the one in flight plus the one being written, and islands that started from a lost
version are asked to join again.
"""

import threading
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from ._errors import ConfigError
from ._syncer import Syncer


class SyncerCheckpoints:
    """Saves and restores one `Syncer` in `directory` (keeps the newest `keep`)."""

    def __init__(self, directory: str | Path, *, keep: int = 2):
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                                  enable_async_checkpointing=False))
        self._pending = threading.Event()
        self._stop = threading.Event()
        self._syncer: Syncer | None = None
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def restore(self, syncer: Syncer) -> int | None:
        """Load the newest checkpoint into `syncer`; its step, or None when there is none."""
        step = self.manager.latest_step()
        if step is None:
            return None
        target = jax.tree.map(np.asarray, syncer.state_tree())
        tree = self.manager.restore(step, args=ocp.args.StandardRestore(target))
        syncer.load_state_tree(tree)
        return step

    def save_now(self, syncer: Syncer) -> None:
        tree = syncer.state_tree()
        step = int(np.sum(tree["versions"]))
        if self.manager.latest_step() != step:
            self.manager.save(step, args=ocp.args.StandardSave(tree))
            self.manager.wait_until_finished()

    def follow(self, syncer: Syncer) -> None:
        """Save `syncer` in the background after every `mark` (call `mark` from its merge callback)."""
        self._syncer = syncer
        self._thread = threading.Thread(target=self._run, name="syncer-checkpoints", daemon=True)
        self._thread.start()

    def mark(self) -> None:
        self._pending.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._pending.wait(0.1):
                continue
            self._pending.clear()
            try:
                self.save_now(self._syncer)
            except BaseException as e:  # reported by `close`; the syncer keeps serving
                self.error = e

    def close(self) -> None:
        """Write the newest state and stop the background thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self.save_now(self._syncer)
        self.manager.close()


def read_theta(directory: str | Path, *, step: int | None = None) -> tuple[int, list[np.ndarray]]:
    """(step, theta_g's fragments as flat float32 vectors) of the newest syncer checkpoint in `directory`
    that reads back, or of `step`; for export, while a syncer may still be writing (nothing is created,
    moved or deleted). Raises `ConfigError` naming the folder when there is none to read."""
    directory = Path(directory).absolute()
    steps = sorted((int(p.name) for p in directory.iterdir() if p.name.isdigit()), reverse=True) \
        if directory.is_dir() else []
    if step is not None:
        if step not in steps:
            raise ConfigError(f"no syncer checkpoint of step {step} in {directory} (found {sorted(steps)})")
        steps = [step]
    if not steps:
        raise ConfigError(f"no syncer checkpoint in {directory} (the syncer saves one after its merges)")
    manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True, create=False))
    problems = []
    try:
        for candidate in steps:
            try:
                tree = manager.restore(candidate, args=ocp.args.StandardRestore())
                return candidate, [np.asarray(t, np.float32).reshape(-1) for t in tree["theta"]]
            except Exception as e:  # noqa: BLE001 - a torn, emptied or foreign step folder: try an older one
                problems.append(f"{candidate}: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:120]}")
    finally:
        manager.close()
    raise ConfigError(f"no syncer checkpoint in {directory} reads back ({'; '.join(problems)})")
