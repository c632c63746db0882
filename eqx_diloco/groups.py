"""Parameter groups: the sets of parameter slices that sync together.

Streaming DiLoCo's fragments are groups; with `--diloco.router-sync-period K` the MoE
router parameters form one more group that syncs every K steps, and they are then left
out of the fragments so no router value takes two outer steps at once.
"""

import dataclasses
from typing import Any, Protocol

import jax

from .config import Config
from .fragments import Fragmenter

PyTree = Any


class ParamGroup(Protocol):
    """A set of parameter slices that sync together, read and written as a flat list."""

    def get(self, tree: PyTree, *, layer_axis: int = 0) -> list: ...

    def put(self, tree: PyTree, values: list, *, layer_axis: int = 0) -> PyTree: ...


@dataclasses.dataclass(frozen=True)
class FragmentGroup:
    """Fragment `index` of `fragmenter`, as a `ParamGroup`."""

    fragmenter: Fragmenter
    index: int

    def get(self, tree, *, layer_axis=0):
        return self.fragmenter.get(tree, self.index, layer_axis=layer_axis)

    def put(self, tree, values, *, layer_axis=0):
        return self.fragmenter.put(tree, self.index, values, layer_axis=layer_axis)


@dataclasses.dataclass(frozen=True)
class LeafGroup:
    """Whole leaves picked by flags (in tree-flatten order), e.g. the MoE routers."""

    flags: tuple[bool, ...]

    def get(self, tree, *, layer_axis=0):
        leaves = jax.tree.leaves(tree)
        if len(leaves) != len(self.flags):
            raise ValueError(f"expected a tree of {len(self.flags)} leaves, got {len(leaves)}")
        return [x for x, f in zip(leaves, self.flags) if f]

    def put(self, tree, values, *, layer_axis=0):
        leaves, treedef = jax.tree.flatten(tree)
        it = iter(values)
        return jax.tree.unflatten(treedef, [next(it) if f else x for x, f in zip(leaves, self.flags)])


def make_groups(config: Config, model) -> tuple[ParamGroup, ...]:
    """The groups of a DiLoCo run: P fragments, then the router group if it syncs on its own.

    `model` may be abstract (`jax.ShapeDtypeStruct` leaves).
    """
    d = config.diloco
    routers = tuple(jax.tree.leaves(model.router_mask())) if d.router_sync_period else None
    fragmenter = Fragmenter(config.model.num_layers, d.num_fragments, d.fragment_pattern, excluded=routers)
    groups: list[ParamGroup] = [FragmentGroup(fragmenter, p) for p in range(d.num_fragments)]
    if routers is not None:
        groups.append(LeafGroup(routers))
    return tuple(groups)
