"""The train state and where each of its arrays lives on the mesh."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Int, PRNGKeyArray, UInt32

from ._tree import broadcast_replicas, outer_dtype
from ._groups import ParamGroup

PyTree = Any

# Fields whose leaves carry a leading replica axis, sharded over the `diloco` mesh axis.
REPLICA_FIELDS = ("params", "opt_state", "keys", "residuals")


class TrainState(eqx.Module):
    """Everything training needs to continue, as one PyTree (arrays only).

    **Fields:**

    - `step`: inner steps completed.
    - `params`: every replica's parameters (the array part of the model), each leaf with a
      leading replica axis R.
    - `opt_state`: every replica's inner optimizer state (leading axis R). Never synced or reset.
    - `keys`: per-replica PRNG key data, shape (R, 2), for dropout.
    - `global_params`: the outer parameters theta_g, identical on every replica (None for ddp).
      Float32 where the model's parameters are bfloat16 or float16, as is all outer state.
    - `outer_states`: one outer optimizer state per parameter group, over that group's values.
    - `residuals`: per group, each replica's quantization residual (error feedback), or None.
    - `mail_mean`: with whole-round overlap (`outer_overlap` delayed / eager), per group the
      mean outer gradient of the previous exchange once it has arrived (else None).
    - `mail_own`: eager only, per group each replica's own contribution to that exchange.

    With `outer_overlap="eager"`, `global_params` and `outer_states` are per replica (a
    leading replica axis): each replica steps its own anchor.
    """

    step: Int[Array, ""]
    params: PyTree
    opt_state: PyTree
    keys: UInt32[Array, "replicas 2"]
    global_params: PyTree | None
    outer_states: tuple[PyTree, ...]
    residuals: tuple[list[Array], ...] | None
    mail_mean: tuple[list[Array], ...] | None = None
    mail_own: tuple[list[Array], ...] | None = None


def build_state(
    params: PyTree,
    *,
    num_replicas: int,
    groups: tuple[ParamGroup, ...],
    inner_opt: optax.GradientTransformation,
    outer_opt: optax.GradientTransformation | None,
    error_feedback: bool,
    key: PRNGKeyArray,
    outer_overlap: str = "none",
) -> TrainState:
    """A fresh state (unplaced). Every replica starts from `params`.

    **Arguments:**

    - `params`: the array part of the model (`eqx.filter(model, eqx.is_inexact_array)`).
    - `num_replicas`: R.
    - `groups`: the parameter groups that sync (empty for ddp).
    - `inner_opt`, `outer_opt`: the optimizers (`outer_opt` None for ddp).
    - `error_feedback`: allocate per-replica quantization residuals.
    - `key`: folded with each replica index into that replica's dropout key stream.
    - `outer_overlap`: `none`, `delayed` or `eager` (see `_eager`): adds the mailboxes,
      and for eager per-replica anchors and outer states.
    """
    replica_params = broadcast_replicas(params, num_replicas)
    opt_state = jax.vmap(inner_opt.init)(replica_params)
    keys = jax.vmap(lambda r: jax.random.key_data(jax.random.fold_in(key, r)))(jnp.arange(num_replicas))
    step = jnp.zeros((), jnp.int32)
    if outer_opt is None:
        return TrainState(step, replica_params, opt_state, keys, None, (), None)
    # theta_g and everything outer stay float32 for narrower parameters (see `outer_dtype`).
    params = jax.tree.map(lambda x: x.astype(outer_dtype(x.dtype)), params)
    values = [group.get(params) for group in groups]
    outer_states = tuple(outer_opt.init(v) for v in values)
    residuals = None
    per_replica_zeros = lambda v: [jnp.zeros((num_replicas, *x.shape), x.dtype) for x in v]  # noqa: E731
    if error_feedback:
        residuals = tuple(per_replica_zeros(v) for v in values)
    if outer_overlap == "none":
        return TrainState(step, replica_params, opt_state, keys, params, outer_states, residuals)
    mail_mean = tuple([jnp.zeros_like(x) for x in v] for v in values)
    if outer_overlap == "delayed":
        return TrainState(step, replica_params, opt_state, keys, params, outer_states, residuals, mail_mean)
    anchors = broadcast_replicas(params, num_replicas)
    outer_states = tuple(broadcast_replicas(s, num_replicas) for s in outer_states)
    mail_own = tuple(per_replica_zeros(v) for v in values)
    return TrainState(step, replica_params, opt_state, keys, anchors, outer_states, residuals, mail_mean, mail_own)


def _mirror(opt: optax.GradientTransformation | None, opt_state: PyTree, values: list, shardings: PyTree,
            fallback: NamedSharding, *, replica_axis: bool) -> PyTree:
    """Shardings for `opt_state`, an optimizer state over values laid out by `shardings` (a tree
    shaped like the optimizer's params, whose leaves are `values`).

    The parts of the state that mirror the values (moments, momenta) get their value's
    sharding, found with `optax.tree_map_params`; for an optimizer it cannot read, a leaf
    takes the sharding of the values of its shape when those all agree. Everything else
    (step counts, scalars) gets `fallback`. `replica_axis`: the state's leaves carry a
    leading replica axis that `values` lack.
    """
    try:
        return optax.tree_map_params(
            opt, lambda _, sharding: sharding, opt_state, shardings,
            transform_non_params=lambda v: jax.tree.map(lambda _: fallback, v),
        )
    except Exception:  # an optimizer whose init does not take a placeholder tree: match by shape
        pass
    by_shape: dict[tuple, set] = {}
    for v, sharding in zip(values, jax.tree.leaves(shardings)):
        by_shape.setdefault(tuple(v.shape), set()).add(sharding)

    def match(x):
        candidates = by_shape.get(tuple(x.shape[1:] if replica_axis else x.shape), set())
        return next(iter(candidates)) if len(candidates) == 1 else fallback

    return jax.tree.map(match, opt_state)


def state_shardings(
    state: TrainState,
    mesh: Mesh,
    *,
    per_replica_anchors: bool = False,
    leaf_specs: tuple[PartitionSpec, ...] | None = None,
    groups: tuple[ParamGroup, ...] = (),
    inner_opt: optax.GradientTransformation | None = None,
    outer_opt: optax.GradientTransformation | None = None,
    outer_state_memory: str = "device",
) -> TrainState:
    """A tree like `state` holding each leaf's NamedSharding.

    Replica fields are sharded over `diloco`; inside a replica, every array that mirrors a
    parameter follows that parameter's spec in `leaf_specs` (one PartitionSpec over the inner
    axes per trainable leaf, flatten order; None: everything replicated inside a replica).
    `groups` and the optimizers say which parameter each outer and inner optimizer state leaf
    mirrors. `per_replica_anchors` (eager) also shards `global_params` and `outer_states` over
    `diloco`. `outer_state_memory="host"` puts `global_params` and `outer_states` in the
    devices' `pinned_host` memory.
    """
    replica = NamedSharding(mesh, PartitionSpec("diloco"))
    replicated = NamedSharding(mesh, PartitionSpec())
    anchor_axis = ("diloco",) if per_replica_anchors else ()
    leaves = jax.tree.leaves(state.params)
    specs = leaf_specs or (PartitionSpec(),) * len(leaves)

    def sharded(spec: PartitionSpec, per_replica: bool) -> NamedSharding:
        return NamedSharding(mesh, PartitionSpec(*(("diloco",) if per_replica else ()), *spec))

    on_replicas = [sharded(s, True) for s in specs]
    on_anchors = [sharded(s, bool(anchor_axis)) for s in specs]
    params_treedef = jax.tree.structure(state.params)
    params = jax.tree.unflatten(params_treedef, on_replicas)
    opt_state = jax.tree.map(lambda _: replica, state.opt_state)
    if leaf_specs:
        per_replica_leaves = [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in leaves]
        opt_state = _mirror(inner_opt, state.opt_state, per_replica_leaves, params, replica, replica_axis=True)
    out = dict(step=replicated, params=params, opt_state=opt_state, keys=replica)
    if state.global_params is None:
        return TrainState(**out, global_params=None, outer_states=(), residuals=None)
    # Group i's values come from leaves `indices[i]` (a slice keeps its leaf's layout).
    indices = [group.leaf_indices(state.params) for group in groups]
    pick = lambda table, i: [table[j] for j in indices[i]]  # noqa: E731
    out["global_params"] = jax.tree.unflatten(params_treedef, on_anchors)
    anchor_fallback = replica if anchor_axis else replicated
    out["outer_states"] = tuple(
        _mirror(outer_opt, s, groups[i].get(state.global_params, layer_axis=1 if anchor_axis else 0),
                pick(on_anchors, i), anchor_fallback, replica_axis=False)
        if leaf_specs else jax.tree.map(lambda _: anchor_fallback, s)
        for i, s in enumerate(state.outer_states)
    )
    if outer_state_memory == "host":
        to_host = lambda tree: jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), tree)  # noqa: E731
        out["global_params"], out["outer_states"] = to_host(out["global_params"]), to_host(out["outer_states"])
    by_group = lambda field, table: None if field is None else tuple(pick(table, i) for i in range(len(field)))  # noqa: E731
    on_values = [sharded(s, False) for s in specs]
    out["residuals"] = by_group(state.residuals, on_replicas)
    out["mail_mean"] = by_group(state.mail_mean, on_values)
    out["mail_own"] = by_group(state.mail_own, on_replicas)
    return TrainState(**out)
