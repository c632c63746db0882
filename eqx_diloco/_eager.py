"""Whole-round overlapped outer steps: `delayed` and `eager` (Kale, Douillard, Donchev 2025).

"Eager Updates For Overlapped Communication and Computation in DiLoCo" (arXiv 2502.12996)
overlaps the *entire* outer exchange of round k with the inner steps of round k + 1: at a
sync, every replica sends its outer gradient and starts the next round at once; the
average arrives while it trains and is used one round later. Per parameter group g (a
Streaming DiLoCo fragment, or everything when P = 1), at the k-th sync of g, replica m has
its anchor a_m (the point its round started from) and its params theta_m:

- Delta_m = a_m - theta_m (its fresh outer gradient); x_m = Delta_m (+ its error-feedback
  residual) is what it sends;
- Dbar = the mean of the x's sent at the previous sync of g (arrived in the background;
  zero at the first sync); own_m = what replica m itself contributed to Dbar (its x as it
  decodes on the wire: decode(encode(x_m)), or x_m for float32);
- **delayed**: theta_g <- OuterOpt(theta_g, Dbar): the average lands one outer step late;
  all anchors are theta_g and stay identical on every replica;
- **eager**: the replica replaces its own stale share of Dbar by its fresh outer gradient,
  `Dtilde_m = Delta_m / R + (Dbar - own_m / R)`, i.e. (1/R) [Delta_m + sum_{r != m} x_r
  (previous round)], and steps its *own* copy: a_m <- OuterOpt_m(a_m, Dtilde_m). Anchors
  and outer-optimizer states are therefore per replica (they differ by the eager term).
  Over rounds the proxies telescope to the true averages; with R = 1 eager is exactly
  blocking DiLoCo (Dbar = own_m, so Dtilde = Delta).
- then every replica restarts from its anchor (theta_m[g] <- a_m[g]) and the exchange of
  the x's is launched (on the communication devices when there are any).

Choices where the paper leaves room (and why):

- The fresh local term uses the *unquantized* Delta_m (the replica has it exactly; only the
  wire is lossy), and the removed stale term is the replica's contribution *as received*
  (decoded), so the proxy contains exactly the other replicas' received values.
- The first sync of a group has nothing in flight: Dbar = own = 0 (delayed makes no
  move; eager steps with Delta_m / R).
- Error feedback carries each replica's quantization residual of what it sent (as for the
  blocking sync) and is installed with the arrived exchange, before the next x is formed.
- The evaluated "global model" of eager is the mean of the replicas' anchors (they agree
  up to the eager term); for delayed it is theta_g.
- A non-finite replica cannot be skipped out of an eager proxy that others already used,
  so eager needs `on_nonfinite="stop"`; delayed supports `skip` (the mean leaves it out).
- The end of training (not in the paper, which says nothing of it): the last round's
  exchange has no next sync to land in, so the evaluated model would miss (R - 1) / R of
  that round's averaged outer gradient (eager) or all of it (delayed). `drain` waits for it
  and applies the remainder `rem` (eager: Dbar - own_m / R, the others' share the replica
  has not used; delayed: Dbar) as the part of an outer step it is responsible for:
  `OuterOpt(a, rem) - OuterOpt(a, 0)` from the same optimizer state. For SGD with (Nesterov)
  momentum that is exactly amending the last outer step's gradient by `rem`, so with plain
  SGD the drained anchors are blocking DiLoCo's sum of averaged outer gradients, and R = 1
  eager stays exactly blocking (rem = 0). A plain extra outer step would also re-apply the
  momentum once more (an extrapolation blocking DiLoCo never takes). The optimizer state is
  left as it was and the mailbox is emptied, so a second drain does nothing.
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._codec import as_codec
from ._exchange import resolve_method, sent_values
from ._tree import all_finite, cast_like, keep_if, row_finite
from ._groups import ParamGroup
from ._compile_ahead import abstract_like, compile_install_ahead
from ._host import HostHandoff, arrived
from ._outer import move_to_mesh, replica_mean, unflatten_like, with_residuals
from ._sharding import all_rows_finite, per_payload, sharded_axes, value_specs_in
from ._state import TrainState

PyTree = Any


def _replace(items: tuple, i: int, value) -> tuple:
    return items[:i] + (value,) + items[i + 1 :]


@dataclasses.dataclass
class InFlightExchange:
    """A group's launched exchange: (mean, finite (R,), own error) still on its way."""

    group: int
    launched: PyTree  # those outputs, or a Future of them while a `HostHandoff` is dispatching the exchange

    @property
    def outputs(self) -> PyTree:
        """The exchange's outputs (on the communication mesh, if any): waits for a handoff in progress."""
        self.launched = arrived(self.launched)
        return self.launched


class OverlappedOuter:
    """Jitted programs of the `delayed` / `eager` outer step for each parameter group.

    **Arguments (keyword-only):**

    - `mesh`, `comm_mesh`: the compute mesh and (optionally) the communication mesh the
      exchanges run on.
    - `groups`: the parameter groups; group i owns `outer_states[i]`, `residuals[i]`,
      `mail_mean[i]` and `mail_own[i]`.
    - `outer_opt`: the outer optimizer.
    - `mode`: `delayed` or `eager`.
    - `fmt`, `exchange`: wire format and collective (see `_exchange`).
    - `skip_nonfinite`, `error_feedback`, `error_feedback_decay`: as for the blocking sync.
    - `shardings`: the state's shardings.
    - `num_replicas`: R, when the mesh's rows hold several replicas each (default: its rows).
    - `value_specs`: per group, its values' PartitionSpecs over the inner axes (a sharded
      island: each device exchanges, and rounds, its own shard; None: replicated).
    - `compiler_options`: XLA options for every program (these run once a round; see `_rare_programs`).
    - `handoff`: where `comm_mesh` is the host's CPU devices, the worker thread that copies each
      exchange's values there and dispatches it (see `_host`); None: the calling thread does.
    """

    def __init__(self, *, mesh: Mesh, comm_mesh: Mesh | None, groups: tuple[ParamGroup, ...],
                 outer_opt: optax.GradientTransformation, mode: str, fmt: str, exchange: str,
                 skip_nonfinite: bool, error_feedback: bool, shardings: TrainState, num_replicas: int | None = None,
                 error_feedback_decay: float = 1.0,
                 value_specs: tuple[list[PartitionSpec], ...] | None = None,
                 compiler_options: dict[str, Any] | None = None, handoff: HostHandoff | None = None):
        self.mesh, self.comm_mesh, self.groups, self.outer_opt = mesh, comm_mesh, groups, outer_opt
        self.handoff = handoff if comm_mesh is not None else None
        jit = functools.partial(jax.jit, compiler_options=compiler_options)
        self.mode, self.fmt, self.error_feedback, self.skip_nonfinite = mode, fmt, error_feedback, skip_nonfinite
        self.ef_decay = error_feedback_decay
        self.num_replicas = num_replicas or mesh.shape["diloco"]
        exchange_mesh = comm_mesh or mesh
        self.method = resolve_method(exchange, self.num_replicas, fmt)
        self.value_specs = value_specs or (None,) * len(groups)
        on = lambda spec: NamedSharding(exchange_mesh, spec)  # noqa: E731
        # Results of a sharded island (on its own or its communication devices) keep the exchange's
        # own layout: each device's shard, nothing gathered.
        placed = (on(PartitionSpec()), on(PartitionSpec("diloco")), on(PartitionSpec("diloco"))) \
            if value_specs is None else None
        self._exchange = [jit(self._exchange_fn(exchange_mesh, specs), out_shardings=placed)
                          for specs in self.value_specs]
        per_replica = lambda specs: NamedSharding(mesh, PartitionSpec("diloco")) if specs is None else [  # noqa: E731
            NamedSharding(mesh, spec) for spec in value_specs_in(specs, True)]
        self._outer = [jit(self._outer_fn(i), donate_argnums=0, out_shardings=(shardings, per_replica(specs)))
                       for i, specs in enumerate(self.value_specs)]
        self._install = [jit(self._install_fn(i), donate_argnums=0, out_shardings=shardings)
                         for i in range(len(groups))]
        self._drain = [jit(self._drain_fn(i), donate_argnums=0, out_shardings=shardings)
                       for i in range(len(groups))]

    # -- the exchange (runs in the background) --------------------------------------------------

    def _exchange_fn(self, mesh: Mesh, specs: list[PartitionSpec] | None):
        fmt, method, skip = self.fmt, self.method, self.skip_nonfinite

        def body(sent):  # each leaf: (K, ...), this row's K replicas (this device's shard of them)
            finite = all_rows_finite(row_finite(sent), sharded_axes(specs))
            means, own_error = per_payload(specs, sent, lambda part: replica_mean(
                part, finite, fmt=fmt, method=method, skip_nonfinite=skip))
            # a float32 psum loses nothing
            own_error = [jnp.zeros_like(x) if e is None else e for x, e in zip(sent, own_error)]
            return means, finite, own_error

        replica_specs = value_specs_in(specs, True)
        return jax.shard_map(body, mesh=mesh, in_specs=(replica_specs,),
                             out_specs=(value_specs_in(specs, False), PartitionSpec("diloco"), replica_specs))

    # -- the outer step at a sync of group i ----------------------------------------------------

    def _wire_value(self, x):
        """What a replica's vector decodes to on the other side of the wire."""
        if as_codec(self.fmt).lossless:
            return x
        flat = jnp.concatenate([v.ravel() for v in x])
        # Exactly the sender's rounding of the exchange (per chunk for two-phase: with top-k the
        # selection is per chunk too).
        return unflatten_like(sent_values(flat, self.fmt, self.num_replicas, self.method), x)

    def _wire_values(self, sent: list, specs: list[PartitionSpec] | None) -> list:
        """`_wire_value` of every replica's `sent` (leading replica axis). In a sharded island each
        device rounds its own shard, payload by payload, as the exchange does."""
        if specs is None or as_codec(self.fmt).lossless:
            return jax.vmap(self._wire_value)(sent)

        def body(local):  # this device's shard of its replicas' values, one payload at a time
            return per_payload(specs, local, lambda part: (jax.vmap(self._wire_value)(part),))[0]

        replica_specs = value_specs_in(specs, True)
        return jax.shard_map(body, mesh=self.mesh, in_specs=(replica_specs,), out_specs=replica_specs)(sent)

    def _outer_fn(self, i: int):
        group, opt, R, eager = self.groups[i], self.outer_opt, self.num_replicas, self.mode == "eager"

        def outer(state: TrainState):
            replicas = group.get(state.params, layer_axis=1)
            anchors = group.get(state.global_params, layer_axis=1 if eager else 0)
            deltas = [jnp.broadcast_to(a, r.shape) - r.astype(a.dtype) for a, r in zip(anchors, replicas)]
            sent = deltas if not self.error_feedback else with_residuals(deltas, state.residuals[i], self.ef_decay)
            mean_prev = state.mail_mean[i]
            with jax.numpy_dtype_promotion("standard"):  # optax mixes weak floats and int32 counts
                if eager:
                    own_prev = state.mail_own[i]
                    proxies = [d / R + (jnp.broadcast_to(m, d.shape) - o / R)
                               for d, m, o in zip(deltas, mean_prev, own_prev)]
                    updates, outer_state = jax.vmap(opt.update)(proxies, state.outer_states[i], anchors)
                else:
                    updates, outer_state = opt.update(mean_prev, state.outer_states[i], anchors)
            # The anchors never take a non-finite value (the host raises on the flags of the
            # exchange that brought it); the replicas then restart from the old anchors.
            new_anchors = optax.apply_updates(anchors, updates)
            ok = all_finite(new_anchors)
            anchors, outer_state = keep_if(ok, (new_anchors, outer_state), (anchors, state.outer_states[i]))
            restart = anchors if eager else [jnp.broadcast_to(a, r.shape) for a, r in zip(anchors, replicas)]
            restart = cast_like(restart, replicas)
            state = dataclasses.replace(
                state,
                params=group.put(state.params, restart, layer_axis=1),
                global_params=group.put(state.global_params, anchors, layer_axis=1 if eager else 0),
                outer_states=_replace(state.outer_states, i, outer_state),
            )
            if eager:
                own = self._wire_values(sent, self.value_specs[i])
                state = dataclasses.replace(state, mail_own=_replace(state.mail_own, i, own))
            # Fresh copies: the state is donated to the next inner step while these are in flight.
            return state, [jnp.copy(x) for x in sent]

        return outer

    def _install_fn(self, i: int):
        def install(state: TrainState, mean, own_error) -> TrainState:
            state = dataclasses.replace(state, mail_mean=_replace(state.mail_mean, i, mean))
            if self.error_feedback:
                state = dataclasses.replace(state, residuals=_replace(state.residuals, i, own_error))
            return state

        return install

    def _drain_fn(self, i: int):
        group, opt, R, eager = self.groups[i], self.outer_opt, self.num_replicas, self.mode == "eager"

        def drain(state: TrainState) -> TrainState:
            anchors = group.get(state.global_params, layer_axis=1 if eager else 0)
            mean = state.mail_mean[i]
            update = jax.vmap(opt.update) if eager else opt.update
            if eager:
                rem = [jnp.broadcast_to(m, o.shape) - o / R for m, o in zip(mean, state.mail_own[i])]
            else:
                rem = list(mean)
            with jax.numpy_dtype_promotion("standard"):  # optax mixes weak floats and int32 counts
                with_rem, _ = update(rem, state.outer_states[i], anchors)
                without, _ = update([jnp.zeros_like(r) for r in rem], state.outer_states[i], anchors)
            # An empty remainder (nothing arrived, R = 1, or drained already) leaves the anchors
            # bit-exact: u(0) - u(0) may round to a few ulps once XLA folds the zeros.
            landed = jnp.any(jnp.stack([jnp.any(r != 0) for r in rem]))
            landed_anchors = [a + (u - z) for a, u, z in zip(anchors, with_rem, without)]
            landed = landed & all_finite(landed_anchors)  # never a non-finite global model
            anchors = keep_if(landed, landed_anchors, anchors)
            replicas = group.get(state.params, layer_axis=1)
            restart = anchors if eager else [jnp.broadcast_to(a, r.shape) for a, r in zip(anchors, replicas)]
            restart = cast_like(restart, replicas)
            empty = lambda mail: _replace(mail, i, [jnp.zeros_like(x) for x in mail[i]])  # noqa: E731
            return dataclasses.replace(
                state,
                params=group.put(state.params, restart, layer_axis=1),
                global_params=group.put(state.global_params, anchors, layer_axis=1 if eager else 0),
                mail_mean=empty(state.mail_mean),
                mail_own=empty(state.mail_own) if eager else state.mail_own,
            )

        return drain

    # -- host-side API ---------------------------------------------------------------------------

    def sync(self, state: TrainState, group: int) -> tuple[TrainState, InFlightExchange]:
        """Outer step of `group` with the arrived mean; then launch this round's exchange."""
        state, sent = self._outer[group](state)
        if self.handoff is not None:  # the copy to the host waits for the outer step: off this thread
            job = functools.partial(self._dispatch, group, sent, abstract_like(state))
            return state, InFlightExchange(group, self.handoff.submit(job))
        return state, InFlightExchange(group, self._dispatch(group, sent, state))

    def _dispatch(self, group: int, sent: list, state: TrainState) -> PyTree:
        """Move what the replicas send to the communication mesh, dispatch the exchange there, and compile
        the install of its result (once) for `state` (concrete or abstract)."""
        if self.comm_mesh is not None:
            sent = move_to_mesh(sent, self.mesh, self.comm_mesh)
        outputs = self._exchange[group](sent)
        mean, _, own_error = outputs
        compile_install_ahead(self._install[group], state, (mean, own_error), self.mesh)
        return outputs

    def install(self, state: TrainState, in_flight: InFlightExchange) -> tuple[TrainState, jax.Array]:
        """Put an arrived exchange into the state's mailbox (waits for it). Returns (state, finite)."""
        mean, finite, own_error = in_flight.outputs
        if self.comm_mesh is not None:
            mean, finite, own_error = move_to_mesh((mean, finite, own_error), self.comm_mesh, self.mesh)
        return self._install[in_flight.group](state, mean, own_error), finite

    def drain(self, state: TrainState, group: int) -> TrainState:
        """Apply what the arrived exchange of `group` brought that no outer step used yet (see the module doc)."""
        return self._drain[group](state)
