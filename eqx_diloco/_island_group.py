"""The syncing half of a decoupled island over its device arrays, for an island of one process or of
several.

An island of several processes is one JAX world of its own (`jax.distributed` with a coordinator of
its own, shared with no other island): its parameters are global arrays sharded over every process's
devices. Only its leader (process 0 of that world) holds the `Island` and talks to the syncer. At a
sync every process gathers the parameters to the host (a collective), the leader pushes and installs
the merge, and every process takes the leader's result. Decisions only the leader can make (a merge
came back, the step a restarted island goes on from, an adaptive H) are broadcast from it, so every
process runs the same steps and meets the same collectives. With one process nothing is gathered or
broadcast.

    island = Island(params, ..., client=client, island=k) if jax.process_index() == 0 else None
    group = IslandGroup(island, shardings, num_fragments=2, num_processes=jax.process_count())
    params = group.join(params)       # every process, its own whole copy of the initial parameters
    ...  # inner steps on the sharded params
    params = group.sync(params, fragment, tokens=n, steps_per_s=None)  # every process
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from ._island import Island

PyTree = Any


class IslandGroup:
    """`Island`'s `join`, `push`, `collect`, `sync` and `in_flight` on an island's (sharded) parameters.

    Every method takes and returns the island's parameters: a tree of arrays only (the model's
    trainable arrays, `eqx.filter(model, eqx.is_inexact_array)`, with None elsewhere), laid out as
    `shardings` says. Every process of the island calls every method at the same point of its loop.

    **Arguments:**

    - `island`: the `Island` (the syncer's client); None on every process but the leader.
    - `shardings`: a tree like the parameters: the `jax.sharding.Sharding` of each leaf.
    - `num_fragments`: the island's fragments (as the `Island`'s).
    - `num_processes`: the island's processes (1: an ordinary one-process island).
    """

    def __init__(self, island: Island | None, shardings: PyTree, *, num_fragments: int, num_processes: int):
        self.leader = jax.process_index() == 0
        if self.leader != (island is not None):
            raise ValueError("the island's leader (process 0), and only it, holds the Island")
        self.island, self.shardings, self.num_processes = island, shardings, num_processes
        self.versions: list[int] = [0] * num_fragments
        self.lost_rounds = 0
        self.fastest_steps_per_s: float | None = None
        self.tokens_merged = 0.0

    # -- moving values between the leader and the other processes --------------------------------

    def agree(self, value: int) -> int:
        """The leader's `value` on every process (an int)."""
        if self.num_processes == 1:
            return value
        return int(multihost_utils.broadcast_one_to_all(np.int64(value), is_source=self.leader))

    def _host(self, params: PyTree) -> PyTree:
        """The whole parameters as host arrays on every process."""
        if self.num_processes == 1:
            return params  # the Island reads device arrays itself
        # The Island installs merges with array updates: the gathered values as this process's own arrays.
        return jax.tree.map(jnp.asarray, multihost_utils.process_allgather(params, tiled=True))

    def _place(self, host: PyTree) -> PyTree:
        """The leader's host parameters (and its view of the syncer) on every process, on the island's layout."""
        if self.num_processes > 1:
            meta = np.asarray([self.lost_rounds, *self.versions], np.int64)
            rates = np.asarray([-1.0 if self.fastest_steps_per_s is None else self.fastest_steps_per_s,
                                self.tokens_merged], np.float64)
            host = jax.tree.map(np.asarray, host)
            host, meta, rates = multihost_utils.broadcast_one_to_all((host, meta, rates), is_source=self.leader)
            self.lost_rounds, self.versions = int(meta[0]), [int(v) for v in meta[1:]]
            self.fastest_steps_per_s = None if rates[0] < 0 else float(rates[0])
            self.tokens_merged = float(rates[1])
            # Every process holds the whole value: each keeps its own shards of it.
            return jax.tree.map(lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i, x=x: x[i]),
                                host, self.shardings)
        return jax.device_put(host, self.shardings)

    def _from_island(self) -> None:
        if self.island is not None:
            self.versions = list(self.island.versions)
            self.lost_rounds, self.fastest_steps_per_s = self.island.lost_rounds, self.island.fastest_steps_per_s
            self.tokens_merged = self.island.tokens_merged

    # -- the Island's calls --------------------------------------------------------------------

    def join(self, params: PyTree) -> PyTree:
        """theta_g of every fragment, placed (`params`: every process's own whole initial copy)."""
        host = params
        if self.island is not None:
            host = self.island.join(host)
            self._from_island()
        return self._place(host)

    def sync(self, params: PyTree, fragment: int, *, tokens: int, steps_per_s: float | None) -> PyTree:
        """Push `fragment`, wait for its merge and return the parameters holding it."""
        host = self._host(params)
        if self.island is not None:
            host = self.island.sync(host, fragment, tokens=tokens, steps_per_s=steps_per_s)
            self._from_island()
        return self._place(host)

    def push(self, params: PyTree, fragment: int, *, tokens: int, steps_per_s: float | None) -> None:
        """Send `fragment`'s outer gradient in the background (`collect` installs the merge)."""
        host = self._host(params)
        if self.island is not None:
            self.island.push(host, fragment, tokens=tokens, steps_per_s=steps_per_s)

    def in_flight(self, fragment: int) -> bool:
        return bool(self.agree(int(self.island is not None and self.island.in_flight(fragment))))

    def collect(self, params: PyTree, *, wait: bool = False) -> PyTree:
        """Every merge that came back installed (with `wait`, every one in flight); `params` itself if none."""
        island = self.island
        if not self.agree(int(island is not None and island.has_landed(wait=wait))):
            return params
        host = self._host(params)
        if island is not None:
            host = island.collect(host, wait=wait)
            self._from_island()
        return self._place(host)

    def leave(self) -> None:
        if self.island is not None:
            self.island.leave()

    def close(self) -> None:
        """The `Island`'s `close` (any process may call it)."""
        if self.island is not None:
            self.island.close()
