"""The outer sync of one parameter group (a fragment, or the MoE routers), by hand.

A sync of group g:

1. every replica r forms its outer gradient `delta_r = theta_g[g] - theta_r[g]` (plus its
   error-feedback residual, if any);
2. the deltas are averaged over the `diloco` mesh axis inside `jax.shard_map`: a float32
   `psum`, or, for quantized formats, an `all_gather` of each replica's encoded payload
   that every replica decodes and sums locally in float32 (a psum of quantized values
   would overflow or round wrongly);
3. the outer optimizer steps theta_g[g] and group g's own outer state with the mean delta.

A *merge* then blends the new global values into every replica:
`theta_r[g] = alpha * theta_r[g] + (1 - alpha) * theta_g[g]`. With overlap the merge runs
tau steps after the sync; theta_g[g] does not change in between (the next sync of the same
group is H steps later), so the global params themselves hold the in-flight result.
"""

import dataclasses
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array

from . import quantize
from .fragments import Fragmenter
from .state import TrainState

PyTree = Any


class ParamGroup(Protocol):
    """A set of parameter slices that sync together."""

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


def sync_nbytes(shapes: list[tuple[int, ...]], fmt: str) -> int:
    """Bytes one replica puts on the wire for one sync of leaves of these shapes.

    Quantized groups are sent as one flat payload (see `mean_outer_gradient`).
    """
    if fmt == "none":
        return sum(quantize.payload_nbytes(tuple(s), fmt) for s in shapes)
    return quantize.payload_nbytes((sum(int(np.prod(s)) for s in shapes),), fmt)


def _split(flat: Array, like: list[Array]) -> list[Array]:
    """Cut a flat vector back into pieces with the sizes of `like` (flattened)."""
    offsets = np.cumsum([x.size for x in like])[:-1]
    return jnp.split(flat, offsets)


def _all_finite(values: list[Array]) -> Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(v)) for v in values]))


def mean_outer_gradient(
    mesh: Mesh, fmt: str, *, skip_nonfinite: bool, error_feedback: bool, gather: bool = False
) -> Callable[[list, list, list | None], tuple[list, Array, list | None]]:
    """shard_map'd `(replica_values, global_values, residuals) -> (mean_delta, finite, residuals)`.

    `replica_values` and `residuals` carry a leading replica axis sharded over `diloco`;
    `global_values` and the returned mean are replicated. `finite` is (R,): whether each
    replica's outer gradient was finite. With `skip_nonfinite`, non-finite replicas are
    left out of the mean (if all are, the mean is zero). Format `none` uses a float32 psum
    unless `gather` asks for the payload exchange every other format uses (for tests).
    """

    def exchange(replica_values, global_values, residuals):
        deltas = [g - r[0] for g, r in zip(global_values, replica_values)]
        if error_feedback:
            deltas = [d + e[0] for d, e in zip(deltas, residuals)]
        finite = _all_finite(deltas)
        weight = finite.astype(jnp.float32) if skip_nonfinite else jnp.float32(1.0)
        if fmt == "none" and not gather:
            # Lossless: a float32 psum of each replica's delta (zeroed if it is skipped).
            totals = [jax.lax.psum(jnp.where(weight > 0, d, jnp.zeros_like(d)), "diloco") for d in deltas]
            new_residuals = None
        else:
            # All leaves of the group travel as one flat vector: one payload, one padded tail.
            flat = jnp.concatenate([d.ravel() for d in deltas])
            payload = quantize.encode(flat, fmt)
            new_residuals = None
            if error_feedback:
                residual = flat - quantize.decode(payload, fmt, flat.shape)
                new_residuals = [r.reshape(d.shape)[None] for r, d in zip(_split(residual, deltas), deltas)]
            gathered = jax.lax.all_gather(payload, "diloco", to="invarying")
            decoded = quantize.decode(gathered, fmt, flat.shape)  # (R, n)
            weights = jax.lax.all_gather(weight, "diloco", to="invarying")
            total = jnp.sum(jnp.where(weights[:, None] > 0, decoded, jnp.zeros_like(decoded)), axis=0)
            totals = [t.reshape(d.shape) for t, d in zip(_split(total, deltas), deltas)]
        count = jnp.maximum(jax.lax.psum(weight, "diloco"), 1.0)
        return [t / count for t in totals], finite[None], new_residuals

    return jax.shard_map(
        exchange,
        mesh=mesh,
        in_specs=(P("diloco"), P(), P("diloco")),
        out_specs=(P(), P("diloco"), P("diloco")),
    )


def _then_merge(sync, merge):
    def sync_and_merge(state):
        state, finite = sync(state)
        return merge(state), finite

    return sync_and_merge


@dataclasses.dataclass(frozen=True)
class OuterSync:
    """Jitted sync and merge functions for each parameter group.

    **Arguments:**

    - `mesh`: the ("diloco", "data") mesh.
    - `groups`: the parameter groups; group i owns `state.outer_states[i]` (and residuals).
    - `outer_opt`: the outer optimizer.
    - `fmt`: wire format of the outer gradients (see `quantize`).
    - `alpha`: merge weight of the replica's own values.
    - `skip_nonfinite`: leave replicas with a non-finite outer gradient out of the mean.
    - `error_feedback`: carry each replica's quantization residual to its next sync.
    - `shardings`: the train state's shardings (outputs are pinned to them).
    """

    mesh: Mesh
    groups: tuple[ParamGroup, ...]
    outer_opt: optax.GradientTransformation
    fmt: str
    alpha: float
    skip_nonfinite: bool
    error_feedback: bool
    shardings: TrainState

    def __post_init__(self):
        exchange = mean_outer_gradient(
            self.mesh, self.fmt, skip_nonfinite=self.skip_nonfinite, error_feedback=self.error_feedback
        )
        jit = lambda f: jax.jit(f, donate_argnums=0, out_shardings=(self.shardings, None))  # noqa: E731
        syncs, merges, both = [], [], []
        for i, group in enumerate(self.groups):
            sync = self._sync_fn(i, group, exchange)
            merge = self._merge_fn(group)
            syncs.append(jit(sync))
            merges.append(jax.jit(merge, donate_argnums=0, out_shardings=self.shardings))
            both.append(jit(_then_merge(sync, merge)))
        object.__setattr__(self, "_syncs", tuple(syncs))
        object.__setattr__(self, "_merges", tuple(merges))
        object.__setattr__(self, "_sync_and_merge", tuple(both))

    def _sync_fn(self, i: int, group: ParamGroup, exchange):
        def sync(state: TrainState) -> tuple[TrainState, Array]:
            replica_values = group.get(state.params, layer_axis=1)
            global_values = group.get(state.global_params)
            residuals = state.residuals[i] if self.error_feedback else None
            mean_delta, finite, new_residuals = exchange(replica_values, global_values, residuals)
            with jax.numpy_dtype_promotion("standard"):  # optax mixes weak floats and int32 counts
                updates, outer_state = self.outer_opt.update(mean_delta, state.outer_states[i], global_values)
            new_global = group.put(state.global_params, optax.apply_updates(global_values, updates))
            outer_states = state.outer_states[:i] + (outer_state,) + state.outer_states[i + 1 :]
            new_state = dataclasses.replace(state, global_params=new_global, outer_states=outer_states)
            if self.error_feedback:
                all_residuals = state.residuals[:i] + (new_residuals,) + state.residuals[i + 1 :]
                new_state = dataclasses.replace(new_state, residuals=all_residuals)
            return new_state, finite

        return sync

    def _merge_fn(self, group: ParamGroup):
        alpha = self.alpha

        def merge(state: TrainState) -> TrainState:
            replica_values = group.get(state.params, layer_axis=1)
            global_values = group.get(state.global_params)
            if alpha == 0.0:  # plain replacement, bit-exact
                merged = [jnp.broadcast_to(g, r.shape) for r, g in zip(replica_values, global_values)]
            else:
                merged = [alpha * r + (1.0 - alpha) * g for r, g in zip(replica_values, global_values)]
            return dataclasses.replace(state, params=group.put(state.params, merged, layer_axis=1))

        return merge

    def sync(self, state: TrainState, group: int) -> tuple[TrainState, Array]:
        """Start group `group`'s sync: update theta_g and the outer state. Returns (state, finite (R,))."""
        return self._syncs[group](state)

    def merge(self, state: TrainState, group: int) -> TrainState:
        """Blend group `group`'s global values into every replica."""
        return self._merges[group](state)

    def sync_and_merge(self, state: TrainState, group: int) -> tuple[TrainState, Array]:
        """`sync` then `merge` in one program (overlap tau = 0)."""
        return self._sync_and_merge[group](state)

    def nbytes(self, state: TrainState, group: int) -> int:
        """Bytes one replica sends for one sync of `group` (payload and scales)."""
        return sync_nbytes([v.shape for v in self.groups[group].get(state.global_params)], self.fmt)
