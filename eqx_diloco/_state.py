"""The train state and where each of its arrays lives on the mesh."""

import dataclasses
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


def state_shardings(state: TrainState, mesh: Mesh, *, per_replica_anchors: bool = False) -> TrainState:
    """A tree like `state` holding each leaf's NamedSharding: replica fields over `diloco`.

    `per_replica_anchors` (eager) also shards `global_params` and `outer_states` over `diloco`.
    """
    replica_fields = REPLICA_FIELDS + ("mail_own",)
    if per_replica_anchors:
        replica_fields += ("global_params", "outer_states")
    replica = NamedSharding(mesh, PartitionSpec("diloco"))
    replicated = NamedSharding(mesh, PartitionSpec())
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    return TrainState(
        **{
            name: jax.tree.map(lambda _, name=name: replica if name in replica_fields else replicated, value)
            for name, value in fields.items()
        }
    )
