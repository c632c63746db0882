"""The inner step: every replica takes one optimizer step on its own batch.

For islands of one device per `data` shard it runs under `jax.shard_map` over the whole
mesh. Each `diloco` shard holds K replicas
(one, unless replicas share devices), stepped together under `jax.vmap`; inside a replica,
the loss is averaged over the `data` axis, so the gradient is the gradient of the
replica's whole batch (the psum over `data` comes from differentiating the pmean).
For `ddp` the gradients are averaged over all replicas too, which keeps them equal.

Sharded islands (`fsdp` or `tensor` > 1) take `_auto_inner_step`: the replicas under
`jax.vmap` with their axis laid out over `diloco`, and every other axis automatic, so inside
a replica the step is an ordinary sharded computation (XLA gathers a sharded weight where a
matmul needs it and reduce-scatters its gradient), laid out by the state's shardings. There
`loss_fn` sees the replica's whole batch and one key per replica and step.
"""

import dataclasses
from typing import Any, Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Float, PRNGKeyArray

from ._errors import ConfigError
from ._tree import all_finite
from ._state import TrainState

PyTree = Any
LossFn = Callable[[PyTree, PyTree, PRNGKeyArray], tuple[Float[Array, ""], dict[str, Array]]]


def _one_row(f: Callable) -> Callable:
    """`jax.vmap(f)` for a leading axis of length 1: `f` on the row itself, so a device holding
    one replica runs the plain program (XLA compiles a batched one differently, a few % slower
    on CPU)."""

    def on_row(*args):
        return jax.tree.map(lambda x: x[None], f(*jax.tree.map(lambda x: x[0], args)))

    return on_row


def loss_and_aux(out: Any) -> tuple[Float[Array, ""], dict[str, Array]]:
    """`loss_fn`'s result as (loss, aux) (a bare loss has no aux), refused in one line unless the loss
    is a scalar: a loss per example would reach JAX's gradient as its own error."""
    loss, aux = out if isinstance(out, tuple) else (out, {})
    if jnp.shape(loss) != ():
        raise ConfigError(f"loss_fn must return a scalar loss (or (loss, aux)), got a loss of shape "
                          f"{tuple(jnp.shape(loss))}: average it over the batch")
    return loss, aux


def replica_grads_auto(loss_fn: LossFn, static: PyTree) -> Callable:
    """One replica's loss, aux and gradient over its whole batch (no `data` collective: the batch's
    split over `data x fsdp` is XLA's to handle)."""

    def replica_grads(params, key_data, batch):
        key, step_key = jax.random.split(jax.random.wrap_key_data(key_data))

        def objective(p):
            return loss_and_aux(loss_fn(eqx.combine(p, static), batch, step_key))

        (loss, aux), grads = eqx.filter_value_and_grad(objective, has_aux=True)(params)
        return loss, aux, grads, jax.random.key_data(key)

    return replica_grads


def _auto_inner_step(replica_grads, replica_update, mesh: Mesh, *, ddp: bool, shardings):
    """The inner step of sharded islands: every replica's step under `jax.vmap` (its axis laid out
    over `diloco` by `spmd_axis_name`), all else automatic: the inner step has no collective
    over `diloco` (but DDP's mean), so nothing is hand-written here. XLA 0.10's SPMD
    partitioner aborts on the manual-`diloco` form once a replica's batch is split over
    `fsdp` and its weights over `tensor`."""

    def step(state: TrainState, batch):
        batch = jax.lax.with_sharding_constraint(batch, NamedSharding(mesh, PartitionSpec("diloco", ("data", "fsdp"))))
        per_replica = lambda f: jax.vmap(f, spmd_axis_name="diloco")  # noqa: E731
        loss, aux, grads, keys = per_replica(replica_grads)(state.params, state.keys, batch)
        if ddp:
            grads = jax.tree.map(lambda g: jnp.broadcast_to(jnp.mean(g, axis=0), g.shape), grads)
        params, opt_state, finite = per_replica(replica_update)(state.params, state.opt_state, grads, loss)
        metrics = {"loss": loss, "grad_norm": per_replica(optax.tree.norm)(grads), "finite": finite, **aux}
        new_state = dataclasses.replace(state, step=state.step + 1, params=params, opt_state=opt_state, keys=keys)
        return new_state, metrics

    return jax.jit(step, donate_argnums=0, out_shardings=None if shardings is None else (shardings, None))


def make_inner_step(
    mesh: Mesh,
    inner_opt: optax.GradientTransformation,
    loss_fn: LossFn,
    static: PyTree,
    *,
    ddp: bool,
    skip_nonfinite: bool,
    shardings: TrainState | None = None,
) -> Callable[[TrainState, PyTree], tuple[TrainState, dict[str, Array]]]:
    """The jitted inner step `(state, batch) -> (state, metrics)`; `state` is donated.

    **Arguments:**

    - `mesh`: the ("diloco", "data", "fsdp", "tensor") mesh; each `diloco` row holds R / rows
      replicas (vmapped).
    - `inner_opt`: the per-replica optimizer.
    - `loss_fn`: `loss_fn(model, batch, key) -> (loss, aux)` for one replica's share of
      the batch on one `data` device; `aux` is a dict of arrays (may be empty).
    - `static`: the non-array part of the model (`eqx.partition(model, eqx.is_inexact_array)[1]`).
    - `ddp`: average gradients over `diloco` as well (data-parallel baseline).
    - `skip_nonfinite`: a replica whose loss or gradient is not finite keeps its params
      and optimizer state for this step instead of applying garbage.
    - `shardings`: the state's shardings; the new state is pinned to them (None: as XLA propagates).

    `batch` is any pytree whose leaves have shape (R, B, ...), placed P("diloco", "data"); a sharded
    island splits each replica's B over `data x fsdp`.
    `metrics` maps `loss`, `grad_norm` and `finite` to (R,) arrays, plus `loss_fn`'s aux
    outputs (averaged over `data`) with a leading replica axis.
    """

    def replica_grads(params, key_data, batch):
        key, step_key = jax.random.split(jax.random.wrap_key_data(key_data))
        # Each data shard holds different rows of the replica's batch: give it its own key.
        shard_key = jax.random.fold_in(step_key, jax.lax.axis_index("data"))

        def objective(p):
            loss, aux = loss_and_aux(loss_fn(eqx.combine(p, static), batch, shard_key))
            return jax.lax.pmean(loss, "data"), jax.lax.pmean(aux, "data")

        (loss, aux), grads = eqx.filter_value_and_grad(objective, has_aux=True)(params)
        return loss, aux, grads, jax.random.key_data(key)

    def replica_update(params, opt_state, grads, loss):
        with jax.numpy_dtype_promotion("standard"):  # optax's bias correction computes float ** int32
            updates, new_opt_state = inner_opt.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        finite = jnp.isfinite(loss) & all_finite(grads)
        if skip_nonfinite:
            keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
            new_params, new_opt_state = keep(new_params, params), keep(new_opt_state, opt_state)
        return new_params, new_opt_state, finite

    def shard_step(params, opt_state, key_data, batch):
        # Every leaf has a leading axis of the K replicas this diloco row holds (1 unless
        # replicas share a device): one vmapped step for all of them.
        per_replica = jax.vmap if key_data.shape[0] > 1 else _one_row
        loss, aux, grads, key_data = per_replica(replica_grads)(params, key_data, batch)
        if ddp:  # the mean over all R replicas: this row's K, then the rows
            mean = jax.tree.map(lambda g: jax.lax.pmean(jnp.mean(g, axis=0), "diloco"), grads)
            grads = jax.tree.map(lambda m, g: jnp.broadcast_to(m, g.shape), mean, grads)
        params, opt_state, finite = per_replica(replica_update)(params, opt_state, grads, loss)
        grad_norm = per_replica(optax.tree.norm)(grads)
        metrics = {"loss": loss, "grad_norm": grad_norm, "finite": finite, **aux}
        return params, opt_state, key_data, metrics

    if mesh.shape["fsdp"] * mesh.shape["tensor"] > 1:
        return _auto_inner_step(replica_grads_auto(loss_fn, static), replica_update, mesh, ddp=ddp, shardings=shardings)

    replica = PartitionSpec("diloco")
    sharded_step = jax.shard_map(
        shard_step,
        mesh=mesh,
        in_specs=(replica, replica, replica, PartitionSpec("diloco", "data")),
        out_specs=replica,
    )

    def step(state: TrainState, batch):
        params, opt_state, keys, metrics = sharded_step(state.params, state.opt_state, state.keys, batch)
        new_state = dataclasses.replace(state, step=state.step + 1, params=params, opt_state=opt_state, keys=keys)
        return new_state, metrics

    return jax.jit(step, donate_argnums=0, out_shardings=None if shardings is None else (shardings, None))
