"""Decoupled islands for any Equinox model: independent programs that sync through a syncer service.

No island waits for a global barrier: each pushes its outer gradient of a fragment when its own H is
done, the syncer merges a fragment once a quorum of the islands present reported or a grace window
passed (token-weighted, stale contributions down-weighted; see `Syncer`), and a lost island is left
out as soon as its connection to the syncer closes (after one grace window where it lingers). The roles:

    from eqx_diloco import decoupled

    # the syncer's host
    syncer = decoupled.make_syncer(model, layers=lambda m: m.blocks, num_fragments=2, num_islands=4,
                                   outer_optimizer=optax.sgd(0.7, momentum=0.9, nesterov=True))
    decoupled.SyncerService(syncer, address="0.0.0.0:50051", token=secret).start()

    # each island k (its own process, devices and JAX runtime)
    client = decoupled.SyncerClient("syncer-host:50051", token=secret)
    island = decoupled.Island(model, layers=lambda m: m.blocks, num_fragments=2, client=client, island=k,
                              quantize="int4", error_feedback=True)
    model = island.join(model)
    for t in range(steps):
        model, opt_state = inner_step(model, opt_state, batch(t))
        fragment = schedule.synced_fragment(t + 1, H, 2)
        if fragment is not None:
            model = island.sync(model, fragment, tokens=tokens_per_step * H)

An island of several processes (one JAX world of its own, its parameters sharded over them) wraps
the leader's `Island` in an `IslandGroup` (see `eqx_diloco._island_group`), which every process calls.
`SyncerCheckpoints` saves and restores the syncer with Orbax; `python -m eqx_diloco.launch --decoupled`
runs these roles for the bundled language model.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx

from ._fragments import Fragmenter, Pattern
from ._island import Island, adaptive_sync_period, fragment_vectors, install_fragment
from ._island_group import IslandGroup
from ._rpc import TOKEN_ENV, SyncerClient, SyncerService, SyncerUnreachable, SyncRefused
from ._syncer import MergeRecord, Refused, Syncer, merge_outer_gradient
from ._syncer_checkpoint import SyncerCheckpoints


def make_syncer(model: Any, *, layers: Callable[[Any], Any] | None, num_fragments: int = 1,
                fragment_pattern: Pattern = "strided", **kwargs) -> Syncer:
    """A `Syncer` whose theta_g starts as `model`'s trainable arrays, cut into the fragments the
    islands use (`layers`, `num_fragments`, `fragment_pattern` as for `Island`); `kwargs` go to `Syncer`."""
    params = eqx.filter(model, eqx.is_inexact_array)
    fragmenter = Fragmenter.for_model(params, layers, num_fragments, fragment_pattern)
    return Syncer(fragment_vectors(params, fragmenter), **kwargs)


__all__ = [
    "TOKEN_ENV",
    "Island",
    "IslandGroup",
    "MergeRecord",
    "Refused",
    "SyncRefused",
    "Syncer",
    "SyncerCheckpoints",
    "SyncerClient",
    "SyncerService",
    "SyncerUnreachable",
    "adaptive_sync_period",
    "install_fragment",
    "make_syncer",
    "merge_outer_gradient",
]
