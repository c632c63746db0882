"""The inner step: every replica takes one optimizer step on its own batch.

It runs under `jax.shard_map` over the whole mesh. Each `diloco` shard is one replica;
inside it, the loss is averaged over the `data` axis, so the gradient is the gradient of
the replica's whole batch (the psum over `data` comes from differentiating the pmean).
For `ddp` the gradients are averaged over `diloco` too, which keeps all replicas equal.
"""

import dataclasses
from typing import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array, Int

from models.transformer import lm_loss

from .state import TrainState


def _squeeze(tree):
    return jax.tree.map(lambda x: x[0], tree)


def _unsqueeze(tree):
    return jax.tree.map(lambda x: x[None], tree)


def all_finite(tree) -> Array:
    """Whether every element of every leaf of `tree` is finite (a scalar bool)."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def make_inner_step(
    mesh: Mesh,
    inner_opt: optax.GradientTransformation,
    *,
    ddp: bool,
    skip_nonfinite: bool,
) -> Callable[[TrainState, Int[Array, "replicas batch seq"]], tuple[TrainState, dict[str, Array]]]:
    """The jitted inner step `(state, tokens) -> (state, metrics)`; `state` is donated.

    **Arguments:**

    - `mesh`: the ("diloco", "data") mesh; one replica per `diloco` index.
    - `inner_opt`: the per-replica optimizer.
    - `ddp`: average gradients over `diloco` as well (data-parallel baseline).
    - `skip_nonfinite`: a replica whose loss or gradient is not finite keeps its params
      and optimizer state for this step instead of applying garbage.

    `tokens` holds seq_len + 1 tokens per sequence and is sharded P("diloco", "data").
    `metrics` maps `loss`, `ce`, `grad_norm` and `finite` to (R,) arrays, plus the model's
    auxiliary outputs (MoE load statistics) with a leading replica axis.
    """

    def replica_step(params, opt_state, key_data, tokens):
        key, dropout_key = jax.random.split(jax.random.wrap_key_data(key_data))

        def loss_fn(p):
            loss, aux = lm_loss(p, tokens, key=dropout_key if p.config.dropout > 0 else None)
            return jax.lax.pmean(loss, "data"), jax.lax.pmean(aux, "data")

        (loss, aux), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(params)
        if ddp:
            grads = jax.lax.pmean(grads, "diloco")
        with jax.numpy_dtype_promotion("standard"):  # optax's bias correction computes float ** int32
            updates, new_opt_state = inner_opt.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        finite = jnp.isfinite(loss) & all_finite(grads)
        if skip_nonfinite:
            keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
            new_params, new_opt_state = keep(new_params, params), keep(new_opt_state, opt_state)
        metrics = {"loss": loss, "ce": aux.pop("ce"), "grad_norm": optax.tree.norm(grads), "finite": finite}
        metrics.update(aux)
        return new_params, new_opt_state, jax.random.key_data(key), metrics

    def shard_step(params, opt_state, key_data, tokens):
        # One replica per diloco shard: drop the local replica axis of length 1 and add it back.
        out = replica_step(_squeeze(params), _squeeze(opt_state), key_data[0], tokens[0])
        return _unsqueeze(out)

    replica = P("diloco")
    sharded_step = jax.shard_map(
        shard_step,
        mesh=mesh,
        in_specs=(replica, replica, replica, P("diloco", "data")),
        out_specs=replica,
    )

    def _step(state: TrainState, tokens):
        params, opt_state, keys, metrics = sharded_step(state.params, state.opt_state, state.keys, tokens)
        new_state = dataclasses.replace(state, step=state.step + 1, params=params, opt_state=opt_state, keys=keys)
        return new_state, metrics

    return jax.jit(_step, donate_argnums=0)
