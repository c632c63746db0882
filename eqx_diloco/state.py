"""The train state and where each of its arrays lives on the mesh."""

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Int, UInt32

from models import Transformer

from .config import Config
from .groups import ParamGroup

PyTree = Any

# Fields whose leaves carry a leading replica axis, sharded over the `diloco` mesh axis.
REPLICA_FIELDS = ("params", "opt_state", "keys", "residuals")


class TrainState(eqx.Module):
    """Everything training needs to continue, as one PyTree.

    **Fields:**

    - `step`: inner steps completed.
    - `params`: every replica's model, each leaf with a leading replica axis R.
    - `opt_state`: every replica's inner optimizer state (leading axis R). Never synced or reset.
    - `keys`: per-replica PRNG key data, shape (R, 2), for dropout.
    - `global_params`: the outer model theta_g, identical on every replica (None for ddp).
    - `outer_states`: one outer optimizer state per fragment, over that fragment's values.
    - `residuals`: per fragment, each replica's quantization residual (error feedback), or None.
    """

    step: Int[Array, ""]
    params: Transformer
    opt_state: PyTree
    keys: UInt32[Array, "replicas 2"]
    global_params: Transformer | None
    outer_states: tuple[PyTree, ...]
    residuals: tuple[list[Array], ...] | None


def _broadcast(tree: PyTree, n: int) -> PyTree:
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), tree)


def build_state(
    config: Config,
    groups: tuple[ParamGroup, ...],
    inner_opt: optax.GradientTransformation,
    outer_opt: optax.GradientTransformation,
) -> TrainState:
    """A fresh state (unplaced). Every replica starts from the same weights."""
    R = config.diloco.num_replicas
    key = jax.random.key(config.train.seed)
    model_key, replica_key = jax.random.split(key)
    model = Transformer(config.model, key=model_key)
    params = _broadcast(model, R)
    opt_state = jax.vmap(inner_opt.init)(params)
    keys = jax.vmap(lambda r: jax.random.key_data(jax.random.fold_in(replica_key, r)))(jnp.arange(R))
    if config.algorithm == "ddp":
        return TrainState(jnp.zeros((), jnp.int32), params, opt_state, keys, None, (), None)
    values = [group.get(model) for group in groups]
    outer_states = tuple(outer_opt.init(v) for v in values)
    residuals = None
    if config.diloco.error_feedback:
        residuals = tuple([jnp.zeros((R, *x.shape), x.dtype) for x in v] for v in values)
    return TrainState(jnp.zeros((), jnp.int32), params, opt_state, keys, model, outer_states, residuals)


def state_shardings(state: TrainState, mesh: Mesh) -> TrainState:
    """A tree like `state` holding each leaf's NamedSharding: replica fields over `diloco`."""
    replica = NamedSharding(mesh, P("diloco"))
    replicated = NamedSharding(mesh, P())
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    return TrainState(
        **{
            name: jax.tree.map(lambda _: replica if name in REPLICA_FIELDS else replicated, value)
            for name, value in fields.items()
        }
    )


def init_state(
    config: Config,
    mesh: Mesh,
    groups: tuple[ParamGroup, ...],
    inner_opt: optax.GradientTransformation,
    outer_opt: optax.GradientTransformation,
) -> TrainState:
    """Build the initial state directly on its shardings (no host round trip)."""
    build = lambda: build_state(config, groups, inner_opt, outer_opt)  # noqa: E731
    shardings = state_shardings(eqx.filter_eval_shape(build), mesh)
    return jax.jit(build, out_shardings=shardings)()
