"""Parameter groups: the sets of parameter slices that sync together.

Streaming DiLoCo's fragments are groups; with `router_sync_period=K` the leaves a
`routers` selector flags (MoE router parameters) form one more group that syncs every K
steps, and they are then left out of the fragments so no value takes two outer steps at once.
"""

import dataclasses
from typing import Any, Callable, Literal, Protocol

import jax

from ._fragments import Fragmenter

PyTree = Any


class ParamGroup(Protocol):
    """A set of parameter slices that sync together, read and written as a flat list."""

    def get(self, tree: PyTree, *, layer_axis: int = 0) -> list: ...

    def put(self, tree: PyTree, values: list, *, layer_axis: int = 0) -> PyTree: ...

    def leaf_indices(self, tree: PyTree) -> list[int]:
        """Per value of `get`, the flatten-order position of its leaf (a slice keeps its leaf's layout)."""
        ...


@dataclasses.dataclass(frozen=True)
class FragmentGroup:
    """Fragment `index` of `fragmenter`, as a `ParamGroup`."""

    fragmenter: Fragmenter
    index: int

    def get(self, tree, *, layer_axis=0):
        return self.fragmenter.get(tree, self.index, layer_axis=layer_axis)

    def put(self, tree, values, *, layer_axis=0):
        return self.fragmenter.put(tree, self.index, values, layer_axis=layer_axis)

    def leaf_indices(self, tree):
        return self.fragmenter.leaf_indices(tree, self.index)


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

    def leaf_indices(self, tree):
        return [i for i, f in enumerate(self.flags) if f]


def make_groups(
    params: PyTree,
    *,
    layers: Callable[[PyTree], Any] | None,
    num_fragments: int,
    fragment_pattern: Literal["strided", "sequential", "balanced"] = "strided",
    separate: tuple[bool, ...] | None = None,
) -> tuple[ParamGroup, ...]:
    """The groups of a DiLoCo run: P fragments, then the `separate` leaves' own group, if any.

    **Arguments:**

    - `params`: the model's parameters (may be abstract: `jax.ShapeDtypeStruct` leaves).
    - `layers`: selector of the layer stack (see `fragments.stack_flags`).
    - `num_fragments`: P.
    - `fragment_pattern`: how layers are dealt to fragments 1..P-1.
    - `separate`: per-leaf flags of leaves that sync on their own schedule (MoE routers).
    """
    fragmenter = Fragmenter.for_model(params, layers, num_fragments, fragment_pattern, excluded=separate)
    groups: list[ParamGroup] = [FragmentGroup(fragmenter, p) for p in range(num_fragments)]
    if separate is not None:
        groups.append(LeafGroup(separate))
    return tuple(groups)
