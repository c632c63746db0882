"""Read small per-replica values (losses, finite flags) on the host of every process.

In a multi-process run, reading an array whose replica rows live in other processes
normally takes a device collective (`process_allgather`). That collective would have to
wait for the devices it runs on, including the communication devices that are busy with
an overlapped sync (and gloo runs CPU collectives one at a time), so training would stall
exactly where it should overlap. Instead every process publishes the rows it holds
through the coordinator's key-value store, a host-side channel, and reads the others'.
"""

import pickle

import jax
import numpy as np


def replicated_value(x: jax.Array) -> np.ndarray:
    """The value of an array that every device holds in full (no communication)."""
    return np.asarray(x.addressable_shards[0].data)


def _local_rows(x: jax.Array) -> dict[int, np.ndarray]:
    rows = {}
    for shard in x.addressable_shards:
        start = shard.index[0].start or 0
        for i, row in enumerate(np.asarray(shard.data)):
            rows[start + i] = row
    return rows


def _kv_client():
    """The distributed runtime's key-value client, or None if this JAX does not expose it where we look."""
    try:
        from jax._src import distributed  # the runtime's client; no public accessor exists

        return distributed.global_state.client
    except (ImportError, AttributeError):
        return None


class ReplicaGather:
    """Gathers dicts of arrays with a leading replica axis into host numpy arrays.

    Every process must call it the same number of times in the same order (the trainer's
    loop does), since calls are matched by a counter.

    **Arguments:**

    - `timeout_s`: how long to wait for another process's rows before giving up.
    """

    def __init__(self, timeout_s: int = 300):
        self.timeout_ms = timeout_s * 1000
        self.calls = 0

    def __call__(self, arrays: dict[str, jax.Array]) -> dict[str, np.ndarray]:
        if jax.process_count() == 1:
            return {k: np.asarray(v) for k, v in arrays.items()}
        client = _kv_client()
        if client is None:  # a JAX without the private client: a device collective (may wait on syncs)
            from jax.experimental import multihost_utils

            return {k: np.asarray(multihost_utils.process_allgather(v, tiled=True)) for k, v in arrays.items()}
        key = f"eqx_diloco/replica_values/{self.calls}"
        self.calls += 1
        rows = {name: _local_rows(x) for name, x in arrays.items()}
        client.key_value_set_bytes(f"{key}/{jax.process_index()}", pickle.dumps(rows))
        for p in range(jax.process_count()):
            if p != jax.process_index():
                theirs = pickle.loads(client.blocking_key_value_get_bytes(f"{key}/{p}", self.timeout_ms))
                for name, their_rows in theirs.items():
                    rows[name].update(their_rows)
        if self.calls > 1:
            # Everyone has published this call, so everyone has read our previous one.
            client.key_value_delete(f"eqx_diloco/replica_values/{self.calls - 2}/{jax.process_index()}")
        return {name: np.stack([r[i] for i in sorted(r)]) for name, r in rows.items()}
