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
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array

from ._compile_ahead import abstract_like, compile_install_ahead
from ._exchange import exchange_sum, payload_nbytes_for, resolve_method, wire_nbytes
from ._tree import all_finite, cast_like, keep_if, row_finite
from ._groups import ParamGroup
from ._host import HostHandoff, arrived
from ._sharding import all_rows_finite, axes_of, per_payload, sharded_axes, value_specs_in
from ._state import TrainState

PyTree = Any


def sync_nbytes(shapes: list[tuple[int, ...]], fmt: str, num_replicas: int = 2, exchange: str = "auto") -> int:
    """Payload bytes one replica encodes for one sync of leaves of these shapes (scales included).

    Quantized groups are sent as one flat payload (see `mean_outer_gradient`); the two-phase
    exchange pads it to R equal chunks.
    """
    n = sum(int(np.prod(s)) for s in shapes)
    return payload_nbytes_for(n, fmt, num_replicas, exchange)


def sync_wire_nbytes(shapes: list[tuple[int, ...]], fmt: str, num_replicas: int, exchange: str = "auto") -> int:
    """Bytes one replica's collectives actually move for one sync (see `_exchange.wire_nbytes`)."""
    n = sum(int(np.prod(s)) for s in shapes)
    return wire_nbytes(n, fmt, num_replicas, exchange)


def unflatten_like(flat: Array, like: list[Array]) -> list[Array]:
    """Cut a flat vector back into arrays with the sizes and shapes of `like`."""
    offsets = np.cumsum([int(np.prod(x.shape)) for x in like])[:-1]
    return [piece.reshape(x.shape) for piece, x in zip(jnp.split(flat, offsets), like)]


def replica_mean(values: list[Array], finite: Array, *, fmt: str, method: str, skip_nonfinite: bool):
    """Inside a shard_map body over `diloco`: the mean over replicas of each replica's `values`.

    `values` is this device's list of arrays, each with a leading axis of its K local
    replicas, and `finite` (K,) whether each replica's values are all finite. With
    `skip_nonfinite` non-finite replicas are left out (if all are, the mean is zero).
    `method` is a resolved `_exchange` method; all leaves travel as one flat vector per replica
    (one float32 psum, or one payload with one padded tail).

    **Returns:** `(means, own_error)`: the replicated means (no replica axis), and each
    local replica's quantization error for error feedback (None for psum), zeroed where its
    values are not finite so that no NaN residual is carried into later syncs.
    """
    weight = finite.astype(jnp.float32) if skip_nonfinite else jnp.ones(finite.shape, jnp.float32)
    K = finite.shape[0]
    if method == "psum":
        # Lossless: one float32 psum of every leaf and a column of ones (zeroed where a replica is
        # skipped, so its sum is the count). One collective, not one per leaf: across processes each
        # costs a rendezvous, and with a dozen leaves those dominated a small model's sync.
        flat = jnp.concatenate([v.reshape(K, -1) for v in values] + [jnp.ones((K, 1), jnp.float32)], axis=1)
        total = exchange_sum(flat, weight, "none", method="psum")[0]
        totals = unflatten_like(total[:-1], [v[0] for v in values])
        count = jnp.maximum(total[-1], 1.0)
        return [t / count for t in totals], None
    flat = jnp.concatenate([v.reshape(K, -1) for v in values], axis=1)
    total, error = exchange_sum(flat, weight, fmt, method=method)
    totals = unflatten_like(total, [v[0] for v in values])
    # A non-finite replica's residual restarts from zero (with it the owner's error e2 of the
    # chunk it owns in a two-phase exchange: one rounding of one sync, lost once).
    error = jnp.where(finite[:, None], error, jnp.zeros_like(error))
    offsets = np.cumsum([int(np.prod(v.shape[1:])) for v in values])[:-1]
    own_error = [piece.reshape(v.shape) for piece, v in zip(jnp.split(error, offsets, axis=1), values)]
    count = jnp.maximum(jax.lax.psum(jnp.sum(weight), "diloco"), 1.0)
    return [t / count for t in totals], own_error


def with_residuals(deltas: list[Array], residuals: list[Array], decay: float) -> list[Array]:
    """What error feedback sends: each outer gradient plus `decay` times the residual carried from the
    last sync (decay 1: classic error feedback; below 1, SparseLoCo's accumulator, which then
    stands in for outer momentum)."""
    if decay == 1.0:
        return [d + e for d, e in zip(deltas, residuals)]
    return [d + jnp.asarray(decay, e.dtype) * e for d, e in zip(deltas, residuals)]


def mean_outer_gradient(
    mesh: Mesh, fmt: str, *, skip_nonfinite: bool, error_feedback: bool, exchange: str = "auto",
    num_replicas: int | None = None, specs: list[PartitionSpec] | None = None, error_feedback_decay: float = 1.0,
) -> Callable[[list, list, list | None], tuple[list, Array, list | None]]:
    """shard_map'd `(replica_values, global_values, residuals) -> (mean_delta, finite, residuals, every_finite)`.

    `replica_values` and `residuals` carry a leading replica axis sharded over `diloco`
    (K = R / mesh rows replicas per row); `global_values` and the returned mean are
    replicated. `finite` is (R,): whether each replica's outer gradient was finite;
    `every_finite` (replicated) whether all were, counted in the values' own collective. With
    `skip_nonfinite`, non-finite replicas are left out of the mean (if all are, the mean
    is zero). `exchange` is the collective (see `_exchange`): `auto` is one float32 psum of
    all values for format `none` without top-k, the one-shot payload all-gather at R <= 2 and the two-phase
    reduce-scatter + all-gather at R > 2; `gather` or `two_phase` force one (also for
    format `none`, which tests use). `num_replicas` defaults to the mesh's rows (K = 1).
    `specs`: each value's PartitionSpec over the inner axes (a sharded island; None: replicated).
    `error_feedback_decay`: beta, the factor on the residual carried into this sync (see `DiLoCo`).

    The body is manual over every mesh axis: each device exchanges only its own shard of
    each value with its peers in the other replicas (the `psum` / gather runs over `diloco`),
    so nothing is all-gathered inside a replica and a quantized payload, with its scales, is
    per shard.
    """
    method = resolve_method(exchange, num_replicas or mesh.shape["diloco"], fmt)

    def body(replica_values, global_values, residuals):
        deltas = [g[None] - r.astype(g.dtype) for g, r in zip(global_values, replica_values)]
        if error_feedback:
            deltas = with_residuals(deltas, residuals, error_feedback_decay)
        finite = all_rows_finite(row_finite(deltas), sharded_axes(specs))
        means, new_residuals = per_payload(specs, deltas, lambda part: replica_mean(
            part, finite, fmt=fmt, method=method, skip_nonfinite=skip_nonfinite))
        # A float32 count independent of the values' exchange: XLA combines the two psums into
        # one collective. Reducing `finite` after the shard_map was a second one, a round trip
        # more per sync across processes.
        every_finite = jax.lax.psum(jnp.sum((~finite).astype(jnp.float32)), "diloco") == 0
        return means, finite, new_residuals if error_feedback else None, every_finite

    replica_specs, global_specs = value_specs_in(specs, True), value_specs_in(specs, False)
    residual_specs = replica_specs if error_feedback else PartitionSpec("diloco")
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(replica_specs, global_specs, residual_specs),
        out_specs=(global_specs, PartitionSpec("diloco"), residual_specs, PartitionSpec()),
    )


def on_device(tree: PyTree) -> PyTree:
    """Inside a program: `tree`'s arrays in device memory (theta_g and the outer state may live in
    host memory, `outer_state_memory="host"`; a no-op for arrays already on the device)."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device), tree)


def group_on_device(tree: PyTree, group: ParamGroup) -> PyTree:
    """`tree` with the leaves `group` reads or writes moved to device memory (slicing and
    scattering need their operands in one memory space); the other leaves stay where they are."""
    leaves, treedef = jax.tree.flatten(tree)
    for i in set(group.leaf_indices(tree)):
        leaves[i] = on_device(leaves[i])
    return jax.tree.unflatten(treedef, leaves)


def _then_merge(sync, merge):
    def sync_and_merge(state):
        state, finite = sync(state)
        return merge(state), finite

    return sync_and_merge


def move_to_mesh(tree: PyTree, src: Mesh, dst: Mesh) -> PyTree:
    """Copy arrays from `src` to the same PartitionSpecs on `dst`, device by device.

    The compute mesh and the communication mesh agree on `diloco`, `fsdp` and `tensor`; the
    communication mesh has one device on `data` (over which values are replicated). So the
    device at (r, d, f, t) of `dst` holds what the device at (r, d mod |data of src|, f, t) of
    `src` holds: every copy is a local one, within one process (a global `device_put` across
    device sets is refused in multi-controller JAX), and nothing is gathered. All copies go in
    one batched `device_put`: one per leaf cost more host time than a small model's step.
    """
    src_data = src.shape["data"]
    me = jax.process_index()
    feeds = {device: src.devices[r, d % src_data, f, t]  # the source device of each local destination
             for (r, d, f, t), device in np.ndenumerate(dst.devices) if device.process_index == me}
    leaves, treedef = jax.tree.flatten(tree)
    targets_of: dict = {}  # per spec: its NamedSharding on dst and that sharding's local devices
    pieces, targets, layouts = [], [], []
    for x in leaves:
        spec = x.sharding.spec
        if any("data" in axes_of(entry) for entry in spec):
            raise ValueError(f"move_to_mesh copies values replicated over 'data', not one laid out as {spec}")
        if spec not in targets_of:
            sharding = NamedSharding(dst, spec)
            targets_of[spec] = (sharding, list(sharding.addressable_devices))
        sharding, devices = targets_of[spec]
        held = {shard.device: shard.data for shard in x.addressable_shards}
        pieces.extend(held[feeds[device]] for device in devices)
        targets.extend(devices)
        layouts.append((x.shape, sharding, len(devices)))
    moved, start, out = jax.device_put(pieces, targets), 0, []
    for shape, sharding, count in layouts:
        out.append(jax.make_array_from_single_device_arrays(shape, sharding, moved[start:start + count]))
        start += count
    return jax.tree.unflatten(treedef, out)


@dataclasses.dataclass
class InFlightSync:
    """A group's sync dispatched on the communication mesh whose result is not installed yet."""

    group: int
    # (new global values, new outer state, finite (R,), new residuals), or a Future of them while a
    # `HostHandoff` is still copying the group's values to the host and dispatching the sync there.
    launched: PyTree

    @property
    def outputs(self) -> PyTree:
        """The launched sync's outputs (on the communication mesh, if any): waits for a handoff in progress."""
        self.launched = arrived(self.launched)
        return self.launched


class OuterSync:
    """Jitted sync and merge functions for each parameter group.

    **Arguments:**

    - `mesh`: the ("diloco", "data") compute mesh.
    - `groups`: the parameter groups; group i owns `state.outer_states[i]` (and residuals).
    - `outer_opt`: the outer optimizer.
    - `fmt`: wire format of the outer gradients (see `quantize`).
    - `alpha`: merge weight of the replica's own values.
    - `skip_nonfinite`: leave replicas with a non-finite outer gradient out of the mean.
    - `error_feedback`: carry each replica's quantization residual to its next sync.
    - `error_feedback_decay`: the factor on that residual (1: classic error feedback).
    - `shardings`: the train state's shardings (outputs are pinned to them).
    - `comm_mesh`: where overlapped syncs run (`launch`); None runs them on `mesh`.
    - `exchange`: the collective of quantized syncs: `auto`, `gather` or `two_phase`.
    - `num_replicas`: R, when the mesh's rows hold several replicas each (default: its rows).
    - `value_specs`: per group, its values' PartitionSpecs over the inner axes (None: replicated).
    - `compiler_options`: XLA options for every program (these run once a sync; see `_rare_programs`).
      JAX compiles options only for a top-level call: with them, call the programs outside any `jit`.
    - `handoff`: where `comm_mesh` is the host's CPU devices (`comm_device="host"`), the worker
      thread that copies a launched sync's values there and dispatches it (see `_host`); None:
      the calling thread does.

    Two ways to sync a group: `sync` (or `sync_and_merge`) updates the state in one program
    on the compute mesh; `launch` copies the group's values to the communication mesh and
    dispatches the exchange and outer step there without waiting, and `install` later puts
    the result into the state. Both compute the same values.
    """

    def __init__(
        self,
        *,
        mesh: Mesh,
        groups: tuple[ParamGroup, ...],
        outer_opt: optax.GradientTransformation,
        fmt: str,
        alpha: float,
        skip_nonfinite: bool,
        error_feedback: bool,
        shardings: TrainState,
        comm_mesh: Mesh | None = None,
        exchange: str = "auto",
        num_replicas: int | None = None,
        value_specs: tuple[list[PartitionSpec], ...] | None = None,
        error_feedback_decay: float = 1.0,
        compiler_options: dict[str, Any] | None = None,
        handoff: HostHandoff | None = None,
    ):
        self.mesh, self.groups, self.outer_opt, self.fmt, self.alpha = mesh, groups, outer_opt, fmt, alpha
        self.handoff = handoff if comm_mesh is not None else None
        self.skip_nonfinite, self.error_feedback = skip_nonfinite, error_feedback
        self.shardings, self.comm_mesh, self.exchange = shardings, comm_mesh, exchange
        flags = dict(skip_nonfinite=self.skip_nonfinite, error_feedback=self.error_feedback, exchange=exchange,
                     num_replicas=num_replicas, error_feedback_decay=error_feedback_decay)
        comm_mesh = self.comm_mesh or self.mesh
        program = functools.partial(jax.jit, compiler_options=compiler_options)
        jit = lambda f: program(f, donate_argnums=0, out_shardings=(self.shardings, None))  # noqa: E731
        fns = dict(sync=[], merge=[], sync_and_merge=[], extract=[], install=[], launch=[])
        replica, replicated = PartitionSpec("diloco"), PartitionSpec()
        for i, group in enumerate(self.groups):
            specs = None if value_specs is None else value_specs[i]
            exchange = mean_outer_gradient(self.mesh, self.fmt, **flags, specs=specs)
            comm_core = self._core(mean_outer_gradient(comm_mesh, self.fmt, **flags, specs=specs))
            sync = self._sync_fn(i, group, self._core(exchange))
            merge = self._merge_fn(group)
            fns["sync"].append(jit(sync))
            fns["merge"].append(program(merge, donate_argnums=0, out_shardings=self.shardings))
            fns["sync_and_merge"].append(jit(_then_merge(sync, merge)))
            fns["extract"].append(program(self._extract_fn(i, group)))
            fns["install"].append(program(self._install_fn(i, group), donate_argnums=0, out_shardings=self.shardings))
            on_comm = lambda spec: NamedSharding(comm_mesh, spec)  # noqa: E731
            # Results of a sharded island (and any on the compute mesh) keep the layout of the
            # exchange's outputs, each device's own shard: nothing is gathered in an island.
            placed = (on_comm(replicated), on_comm(replicated), on_comm(replica), on_comm(replica)) \
                if self.comm_mesh is not None and specs is None else None
            fns["launch"].append(program(comm_core, out_shardings=placed))
        self._fns = {k: tuple(v) for k, v in fns.items()}

    def _core(self, exchange):
        """(replica values, global values, outer state, residuals) -> (global, outer state, finite, residuals)."""

        def core(replica_values, global_values, outer_state, residuals):
            mean_delta, finite, new_residuals, every_finite = exchange(replica_values, global_values, residuals)
            with jax.numpy_dtype_promotion("standard"):  # optax mixes weak floats and int32 counts
                updates, new_outer_state = self.outer_opt.update(mean_delta, outer_state, global_values)
            new_global = optax.apply_updates(global_values, updates)
            # theta_g never takes a non-finite value: such an outer step is not applied (under
            # `stop`, neither is one with any non-finite replica). If every replica's outer
            # gradient was finite and the step still was not, every flag reads False, so the host
            # raises or reports it; otherwise the flags name the replicas that caused it.
            global_ok = all_finite(new_global)
            apply = global_ok if self.skip_nonfinite else global_ok & every_finite
            new_global, new_outer_state = keep_if(apply, (new_global, new_outer_state), (global_values, outer_state))
            finite = jnp.where(every_finite & ~global_ok, jnp.zeros_like(finite), finite)
            return new_global, new_outer_state, finite, new_residuals

        return core

    def _extract_fn(self, i: int, group: ParamGroup):
        def extract(state: TrainState):
            residuals = state.residuals[i] if self.error_feedback else None
            # Fresh copies: the state is donated to the next inner step while these are in flight.
            replica_values = [jnp.copy(v) for v in group.get(state.params, layer_axis=1)]
            global_values = group.get(group_on_device(state.global_params, group))
            outer_state = on_device(state.outer_states[i])
            return replica_values, global_values, outer_state, residuals

        return extract

    def _install_fn(self, i: int, group: ParamGroup):
        def install(state: TrainState, global_values, outer_state, new_residuals) -> TrainState:
            outer_states = state.outer_states[:i] + (outer_state,) + state.outer_states[i + 1 :]
            state = dataclasses.replace(
                state, global_params=group.put(group_on_device(state.global_params, group), global_values),
                outer_states=outer_states
            )
            if self.error_feedback:
                residuals = state.residuals[:i] + (new_residuals,) + state.residuals[i + 1 :]
                state = dataclasses.replace(state, residuals=residuals)
            return state

        return install

    def _sync_fn(self, i: int, group: ParamGroup, core):
        install = self._install_fn(i, group)
        extract = self._extract_fn(i, group)

        def sync(state: TrainState) -> tuple[TrainState, Array]:
            global_values, outer_state, finite, new_residuals = core(*extract(state))
            return install(state, global_values, outer_state, new_residuals), finite

        return sync

    def _merge_fn(self, group: ParamGroup):
        alpha = self.alpha

        def merge(state: TrainState) -> TrainState:
            replica_values = group.get(state.params, layer_axis=1)
            global_values = group.get(group_on_device(state.global_params, group))
            if alpha == 0.0:  # plain replacement, bit-exact
                merged = [jnp.broadcast_to(g, r.shape) for r, g in zip(replica_values, global_values)]
            else:
                merged = [alpha * r.astype(g.dtype) + (1.0 - alpha) * jnp.broadcast_to(g, r.shape)
                          for r, g in zip(replica_values, global_values)]
            merged = cast_like(merged, replica_values)  # theta_g may be wider than the model's dtype
            return dataclasses.replace(state, params=group.put(state.params, merged, layer_axis=1))

        return merge

    def sync(self, state: TrainState, group: int) -> tuple[TrainState, Array]:
        """Group `group`'s sync in one blocking program: update theta_g and the outer state.

        Returns (state, finite) where finite (R,) says whose outer gradient was finite.
        """
        return self._fns["sync"][group](state)

    def merge(self, state: TrainState, group: int) -> TrainState:
        """Blend group `group`'s global values into every replica."""
        return self._fns["merge"][group](state)

    def sync_and_merge(self, state: TrainState, group: int) -> tuple[TrainState, Array]:
        """`sync` then `merge` in one program (overlap tau = 0)."""
        return self._fns["sync_and_merge"][group](state)

    def launch(self, state: TrainState, group: int) -> InFlightSync:
        """Dispatch group `group`'s sync on the communication mesh and return without waiting."""
        inputs = self._fns["extract"][group](state)
        if self.handoff is not None:  # the copy to the host waits for the step: off this thread
            job = functools.partial(self._dispatch, group, inputs, abstract_like(state))
            return InFlightSync(group, self.handoff.submit(job))
        return InFlightSync(group, self._dispatch(group, inputs, state))

    def _dispatch(self, group: int, inputs: tuple, state: TrainState) -> PyTree:
        """Move a group's extracted values to the communication mesh, dispatch its sync there, and compile
        the install of its result (once) for `state` (concrete or abstract)."""
        if self.comm_mesh is not None:
            inputs = move_to_mesh(inputs, self.mesh, self.comm_mesh)
        outputs = self._fns["launch"][group](*inputs)
        global_values, outer_state, _, residuals = outputs
        compile_install_ahead(self._fns["install"][group], state, (global_values, outer_state, residuals), self.mesh)
        return outputs

    def install(self, state: TrainState, in_flight: InFlightSync) -> tuple[TrainState, Array]:
        """Put a launched sync's result into the state (waits for it). Returns (state, finite)."""
        global_values, outer_state, finite, residuals = in_flight.outputs
        if self.comm_mesh is not None:
            global_values, outer_state, finite, residuals = move_to_mesh(
                (global_values, outer_state, finite, residuals), self.comm_mesh, self.mesh
            )
        return self._fns["install"][in_flight.group](state, global_values, outer_state, residuals), finite
