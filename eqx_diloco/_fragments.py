"""Cut a model's parameters into Streaming DiLoCo fragments.

Fragment 0 holds every leaf outside the model's layer stack (embeddings, final norm,
head). Fragments 1..P-1 hold groups of layers sliced out of the stacked arrays along the
layer axis. With P = 1 there is a single fragment holding every leaf.

With a real vocabulary fragment 0 is the largest fragment (32k x d, twice when untied) and
sets the peak bandwidth streaming exists to cut. The `balanced` pattern deals layers like
`strided` and then places each leaf outside the stack, largest first, on the fragment that
is smallest so far (fragment 0 starts empty), so embeddings and head land on different
fragments and the largest fragment is as small as this greedy rule makes it.

A fragment's values are a flat list of arrays, in tree-flatten order. That is all an
optax optimizer, a psum or a quantizer needs, and it keeps the slicing in one place.
The layer stack is named by the user with a `layers` selector in the `eqx.tree_at`
spirit (`lambda model: model.blocks`, or a tuple of such nodes), never by matching
parameter names. Everything here works on concrete arrays, tracers and
`jax.ShapeDtypeStruct`s, with or without a leading replica axis (`layer_axis=1`).
"""

import dataclasses
from typing import Any, Callable, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


Pattern = Literal["strided", "sequential", "balanced"]


def layer_groups(num_layers: int, num_fragments: int, pattern: Pattern) -> list[np.ndarray]:
    """Layer indices of fragments 1..P-1 (a list of P-1 arrays)."""
    groups = num_fragments - 1
    if groups == 0:
        return []
    if num_layers % groups:
        raise ValueError(f"num_layers={num_layers} is not divisible by num_fragments - 1 = {groups}")
    if pattern in ("strided", "balanced"):
        return [np.arange(g, num_layers, groups) for g in range(groups)]
    size = num_layers // groups
    return [np.arange(g * size, (g + 1) * size) for g in range(groups)]


def stack_flags(tree: PyTree, layers: Callable[[PyTree], Any] | None) -> tuple[tuple[bool, ...], int]:
    """Per leaf of `tree` (flatten order), whether it lives in the layer stack; and the stack depth.

    **Arguments:**

    - `tree`: the model's parameters (array leaves; may be abstract).
    - `layers`: a selector returning the stacked layer module(s) of `tree` (a node or a
      tuple of nodes, as for `eqx.tree_at`), or None for a model without a layer stack.

    **Returns:** `(flags, num_layers)`; with `layers=None`, all flags are False and
    `num_layers` is 0. Raises `ValueError` naming `layers` when the selection is not a set
    of arrays with one common leading (layer) axis.
    """
    leaves = jax.tree.leaves(tree)
    if layers is None:
        return (False,) * len(leaves), 0
    false = jax.tree.map(lambda _: False, tree)
    try:
        mask = eqx.tree_at(layers, false, replace_fn=lambda s: jax.tree.map(lambda _: True, s))
    except Exception as e:  # a selector that does not name a node of the tree
        raise ValueError(f"layers= does not select a node of the model ({type(e).__name__}: {e})") from None
    flags = tuple(bool(f) for f in jax.tree.leaves(mask))
    if len(flags) != len(leaves):
        raise ValueError("layers= must select modules made of arrays (it selected a non-array leaf)")
    depths = {x.shape[0] if len(x.shape) else None for x, f in zip(leaves, flags) if f}
    if not depths:
        raise ValueError("layers= selected no arrays; use layers=None for a model without a layer stack")
    if len(depths) != 1 or None in depths:
        raise ValueError(
            f"layers= must select arrays with a common leading (layer) axis; got leading sizes {sorted(depths, key=str)}"
        )
    return flags, depths.pop()


def _balanced_owners(params, in_stack, excluded, num_layers: int, num_fragments: int) -> tuple[int, ...]:
    """Per leaf, its fragment under the `balanced` pattern (stack leaves: 0, unused)."""
    leaves = jax.tree.leaves(params)
    excluded = excluded or (False,) * len(leaves)
    nbytes = [int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in leaves]
    load = [0] * num_fragments
    per_layer = sum(n for n, s, e in zip(nbytes, in_stack, excluded) if s and not e) // max(num_layers, 1)
    for f in range(1, num_fragments):
        load[f] = per_layer * (num_layers // (num_fragments - 1))
    owners = [0] * len(leaves)
    outside = [i for i, (s, e) in enumerate(zip(in_stack, excluded)) if not s and not e]
    for i in sorted(outside, key=lambda i: (-nbytes[i], i)):  # largest first; ties in tree order
        f = min(range(num_fragments), key=lambda f: (load[f], f))
        owners[i] = f
        load[f] += nbytes[i]
    return tuple(owners)


def _take(x, index: np.ndarray, axis: int):
    if isinstance(x, jax.ShapeDtypeStruct):
        shape = x.shape[:axis] + (len(index),) + x.shape[axis + 1 :]
        return jax.ShapeDtypeStruct(shape, x.dtype)
    if np.array_equal(index, np.arange(index[0], index[0] + len(index))):
        return jax.lax.slice_in_dim(x, int(index[0]), int(index[0]) + len(index), axis=axis)
    return jnp.take(x, index, axis=axis)


def _place(x, index: np.ndarray, axis: int, value):
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    return x.at[(slice(None),) * axis + (index,)].set(value)


@dataclasses.dataclass(frozen=True)
class Fragmenter:
    """Which leaves and layer slices form each fragment, for models of one shape.

    **Arguments:**

    - `num_layers`: depth of the model's layer stack.
    - `num_fragments`: P, the total number of fragments.
    - `pattern`: `strided` (fragment f holds layers f-1, f-1+(P-1), ...), `sequential`, or
      `balanced` (strided layers; leaves outside the stack spread over all fragments, see
      the module docstring and `owners`).
    - `excluded`: optional per-leaf flags (flatten order of the params tree); flagged
      leaves belong to no fragment (MoE router leaves that sync on their own schedule).
    - `in_stack`: per-leaf flags, True for leaves of the layer stack (see `stack_flags`
      and `Fragmenter.for_model`). Needed when `num_fragments > 1`.
    - `owners`: per leaf, the fragment a leaf outside the stack belongs to (None: fragment 0).
    """

    num_layers: int
    num_fragments: int
    pattern: Pattern = "strided"
    excluded: tuple[bool, ...] | None = None
    in_stack: tuple[bool, ...] | None = None
    owners: tuple[int, ...] | None = None

    @classmethod
    def for_model(
        cls,
        params: PyTree,
        layers: Callable[[PyTree], Any] | None,
        num_fragments: int,
        pattern: Pattern = "strided",
        excluded: tuple[bool, ...] | None = None,
    ) -> "Fragmenter":
        """The fragmenter of a model whose layer stack `layers` selects (see `stack_flags`)."""
        in_stack, num_layers = stack_flags(params, layers)
        if num_fragments > 1 and layers is None:
            raise ValueError(f"num_fragments={num_fragments} needs a layer stack; layers=None allows only 1")
        if num_fragments > 1 and num_layers % (num_fragments - 1):
            raise ValueError(
                f"num_fragments - 1 = {num_fragments - 1} must divide the {num_layers} stacked layers that layers= selects"
            )
        owners = None
        if pattern == "balanced" and num_fragments > 1:
            owners = _balanced_owners(params, in_stack, excluded, num_layers, num_fragments)
        return cls(num_layers, num_fragments, pattern, excluded, in_stack, owners)

    def __post_init__(self):
        if self.num_fragments < 1:
            raise ValueError(f"num_fragments must be >= 1, got {self.num_fragments}")
        layer_groups(self.num_layers, self.num_fragments, self.pattern)  # validates divisibility

    def layers(self, fragment: int) -> np.ndarray | None:
        """Layer indices of `fragment`, or None if it holds no stacked layers (fragment 0, P > 1)."""
        if self.num_fragments == 1:
            return np.arange(self.num_layers)
        if fragment == 0:
            return None
        return layer_groups(self.num_layers, self.num_fragments, self.pattern)[fragment - 1]

    def _members(self, tree: PyTree) -> list[tuple[int, bool]]:
        """(leaf position, sliced-from-stack) for every leaf that takes part in any fragment."""
        in_stack = self.in_stack
        if in_stack is None:
            if self.num_fragments > 1:
                raise ValueError("a Fragmenter with num_fragments > 1 needs in_stack flags (use Fragmenter.for_model)")
            in_stack = (False,) * len(jax.tree.leaves(tree))
        if len(in_stack) != len(jax.tree.leaves(tree)):
            raise ValueError(f"in_stack has {len(in_stack)} flags for a tree of {len(jax.tree.leaves(tree))} leaves")
        excluded = self.excluded or (False,) * len(in_stack)
        if len(excluded) != len(in_stack):
            raise ValueError(f"excluded has {len(excluded)} flags for a tree of {len(in_stack)} leaves")
        return [(i, s) for i, (s, e) in enumerate(zip(in_stack, excluded)) if not e]

    def _selection(self, tree: PyTree, fragment: int) -> list[tuple[int, np.ndarray | None]]:
        if not 0 <= fragment < self.num_fragments:
            raise ValueError(f"fragment must be in [0, {self.num_fragments}), got {fragment}")
        if self.num_fragments == 1:
            return [(i, None) for i, _ in self._members(tree)]
        owner = (lambda i: 0) if self.owners is None else (lambda i: self.owners[i])  # noqa: E731
        outside = [(i, None) for i, s in self._members(tree) if not s and owner(i) == fragment]
        layers = self.layers(fragment)
        if layers is None:
            return outside
        return outside + [(i, layers) for i, s in self._members(tree) if s]

    def leaf_indices(self, tree: PyTree, fragment: int) -> list[int]:
        """For each value `get` returns, the position (flatten order) of the leaf it comes from."""
        return [i for i, _ in self._selection(tree, fragment)]

    def get(self, tree: PyTree, fragment: int, *, layer_axis: int = 0) -> list:
        """The values of `fragment` in `tree` as a flat list of arrays.

        `layer_axis` is the layer axis of stacked leaves: 0 for a plain model, 1 when every
        leaf carries a leading replica axis.
        """
        leaves = jax.tree.leaves(tree)
        return [leaves[i] if idx is None else _take(leaves[i], idx, layer_axis) for i, idx in self._selection(tree, fragment)]

    def put(self, tree: PyTree, fragment: int, values: list, *, layer_axis: int = 0) -> PyTree:
        """`tree` with `fragment`'s values replaced by `values` (as returned by `get`)."""
        leaves, treedef = jax.tree.flatten(tree)
        selection = self._selection(tree, fragment)
        if len(values) != len(selection):
            raise ValueError(f"fragment {fragment} has {len(selection)} leaves, got {len(values)} values")
        for (i, idx), value in zip(selection, values):
            leaves[i] = value if idx is None else _place(leaves[i], idx, layer_axis, value)
        return jax.tree.unflatten(treedef, leaves)

    def nbytes(self, tree: PyTree, fragment: int) -> int:
        """Bytes of `fragment`'s values in `tree` at their own dtype (no replica axis)."""
        return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in self.get(tree, fragment))
