"""`python -m benchmarks._sync_probe <trainer flags>`: `eqx_diloco.train` with its blocking syncs timed.

A diagnostic run for `benchmarks/sync_step.py`, started by `eqx_diloco.launch --module`. At every
blocking sync (overlap tau = 0) each process waits for its inner step before the sync is
dispatched, then for the sync, and writes one JSON line to `$EQX_DILOCO_SYNC_PROBE/process-K.jsonl`:
when each was done, on the wall clock (`time.time()`: one clock for the processes of one machine).
The waits serialise what the trainer otherwise overlaps (dispatching the next step while the sync
runs), so a probed run's step times are not the trainer's; the unprobed runs of the benchmark give those.
"""

from __future__ import annotations

import json
import os
import runpy
import time
from pathlib import Path

import jax

from eqx_diloco import _outer

PROBE_DIR_ENV = "EQX_DILOCO_SYNC_PROBE"


def install(out_dir: Path) -> None:
    """Time every `OuterSync.sync_and_merge` of this process into `out_dir/process-K.jsonl`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    untimed = _outer.OuterSync.sync_and_merge
    log = None

    def timed_sync_and_merge(self, state, group):
        nonlocal log
        if log is None:  # opened at the first sync: the process index is known by then
            log = (out_dir / f"process-{jax.process_index()}.jsonl").open("a", buffering=1)
        jax.block_until_ready(state)
        inner_done = time.time()
        state, finite = untimed(self, state, group)
        jax.block_until_ready((state, finite))
        log.write(json.dumps({"group": group, "inner_done": inner_done, "sync_done": time.time()}) + "\n")
        return state, finite

    _outer.OuterSync.sync_and_merge = timed_sync_and_merge


if __name__ == "__main__":
    install(Path(os.environ[PROBE_DIR_ENV]))
    runpy.run_module("eqx_diloco.train", run_name="__main__")
