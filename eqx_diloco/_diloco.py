"""`DiLoCo`: the model-agnostic core. Bring an Equinox model, a loss and optax optimizers.

The object owns everything between "a batch per replica" and "a trained global model":
the mesh, the per-replica inner step, the fragments and their sync schedule, the outer
optimizer, quantized exchanges, overlapped syncs on communication devices and their merges,
and checkpoint wiring. The LM trainer (`eqx_diloco.Trainer`) is one client of it.

Host-side bookkeeping: a sync launched with overlap (tau > 0) runs in the background and
its result is installed tau steps later. Those in-flight results live in this object, not
in the state, and the state always *reads* as if syncs were blocking once `settle` has
run; `save` and `global_model` do that for you.
"""

import functools
from typing import Any, Callable, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jaxtyping import Array, PRNGKeyArray

from . import quantize as _quantize
from . import schedule
from ._errors import ConfigError, NonFiniteError
from ._checkpoint import Checkpointer
from ._groups import make_groups
from ._mesh import build_meshes
from ._eager import InFlightExchange, OverlappedOuter
from ._elastic import IslandSnapshots, agree_on_step, island_payload, own_replica, reform_state
from ._outer import InFlightSync, OuterSync, move_to_mesh, sync_nbytes, sync_wire_nbytes
from ._state import TrainState, build_state, state_shardings
from ._step import LossFn, make_inner_step

PyTree = Any


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _is_trainable(x) -> bool:
    """Inexact arrays are trained; so are their abstract stand-ins (for `abstract(model)`)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jnp.issubdtype(x.dtype, jnp.inexact)
    return eqx.is_inexact_array(x)


def default_outer_optimizer() -> optax.GradientTransformation:
    """SGD with lr 1.0 and Nesterov momentum 0.3 (lr 1.0 without momentum is plain averaging).

    The CLI's default, chosen from `benchmarks/outer_sweep.py` (at 512 tokens per replica step
    it beat plain averaging at H = 20 and tied it at H = 10; the papers' lr 0.7 / Nesterov 0.9
    was 5-10% behind DDP there); for long runs at large per-replica batches pass
    `optax.sgd(0.7, momentum=0.9, nesterov=True)`.
    """
    return optax.sgd(1.0, momentum=0.3, nesterov=True)


class DiLoCo:
    """DiLoCo / Streaming DiLoCo for any Equinox model.

    **Arguments (all keyword-only; names match the CLI's `--diloco.*` flags):**

    - `loss_fn`: `loss_fn(model, batch, key) -> (loss, aux)` or `-> loss`: a scalar loss of
      one replica's batch (its share on one `data` device) and optionally a dict of arrays to
      report. `key` is a fresh PRNG key per replica, step and `data` device.
    - `layers`: a selector returning the model's stacked layer module(s), as for
      `eqx.tree_at` (`lambda m: m.blocks`, or a tuple of nodes with one common leading
      layer axis); None for a model without a layer stack (then only `num_fragments=1`).
    - `num_replicas`: R, independently training replicas (islands).
    - `sync_period`: H, inner steps between two syncs of the same parameters.
    - `inner_optimizer`: the per-replica optax optimizer (state never synced or reset).
    - `outer_optimizer`: the optax optimizer applied to the averaged outer gradient
      `theta_g - mean(theta_r)` as if it were a gradient (default: lr 1 with Nesterov 0.3,
      see `default_outer_optimizer`; `optax.sgd(1.0)` is plain averaging).
    - `num_fragments`: P (Streaming DiLoCo when > 1). Fragment 0 holds everything outside
      the layer stack; fragments 1..P-1 hold layers; P - 1 must divide the stack depth.
    - `fragment_pattern`: `strided` or `sequential` dealing of layers to fragments, or
      `balanced` (strided layers; embeddings, head and other leaves outside the stack spread
      over the fragments, largest first onto the smallest, to cut the peak sync size).
    - `overlap_steps`: tau, inner steps a sync overlaps before its merge (< H / P).
    - `alpha`: merge weight of the replica's own values (0 replaces them).
    - `quantize`: wire format of outer gradients: none, bf16, fp8, int8, int4, e3m0.
    - `error_feedback`: carry each replica's quantization residual to its next sync.
    - `outer_overlap`: `none` (a sync blocks, or overlaps tau steps), or overlap each sync's
      whole exchange with the next round of that group (arXiv 2502.12996, see `_eager`):
      `delayed` applies the averaged outer gradient one outer step late, `eager` uses each
      replica's fresh outer gradient in place of its stale share and corrects with the
      others' when they arrive. Needs overlap_steps=0, alpha=0, no router group; eager
      also needs on_nonfinite="stop".
    - `exchange`: the collective of a quantized sync: `gather` (one-shot all-gather of every
      replica's payload: (R - 1) payloads sent, R decoded), `two_phase` (packed
      reduce-scatter + all-gather: 2 (R - 1) / R of a payload sent, O(n) decode memory, two
      roundings) or `auto` (gather at R <= 2, two_phase above; float32 syncs use a psum).
    - `routers`: optional `routers(params) -> tree of bools` flagging leaves that sync on
      their own period (MoE routers); `router_sync_period`: that period K (0 = off).
    - `on_nonfinite`: `stop` (outer gradients are averaged as they are; whoever reads the
      metrics stops) or `skip` (a non-finite replica keeps its step / is left out of the mean).
    - `data_parallel`: devices per replica on the `data` mesh axis.
    - `comm_device`: with tau > 0, run syncs on one extra device per replica so they
      overlap compute for real: `auto` (on CPU), `on`, `off`.
    - `algorithm`: `diloco`, or `ddp` (gradients averaged every step; the baseline).
    - `mesh`, `comm_mesh`: bring your own ("diloco", "data") meshes instead.

    **Usage:**

    ```python
    state = diloco.init(model)
    state, metrics = diloco.step(state, batch)   # batch leaves: (R, B, ...)
    model = diloco.global_model(state)
    ```
    """

    def __init__(
        self,
        *,
        loss_fn: LossFn,
        layers: Callable[[PyTree], Any] | None,
        num_replicas: int,
        sync_period: int,
        inner_optimizer: optax.GradientTransformation,
        outer_optimizer: optax.GradientTransformation | None = None,
        num_fragments: int = 1,
        fragment_pattern: Literal["strided", "sequential", "balanced"] = "strided",
        overlap_steps: int = 0,
        alpha: float = 0.0,
        quantize: str = "none",
        error_feedback: bool = False,
        outer_overlap: Literal["none", "delayed", "eager"] = "none",
        exchange: Literal["auto", "gather", "two_phase"] = "auto",
        routers: Callable[[PyTree], PyTree] | None = None,
        router_sync_period: int = 0,
        on_nonfinite: Literal["stop", "skip"] = "stop",
        data_parallel: int = 1,
        comm_device: Literal["auto", "on", "off"] = "auto",
        algorithm: Literal["diloco", "ddp"] = "diloco",
        mesh: Mesh | None = None,
        comm_mesh: Mesh | None = None,
    ):
        _require(callable(loss_fn), "loss_fn must be callable: loss_fn(model, batch, key) -> (loss, aux)")
        _require(layers is None or callable(layers), "layers must be a selector (lambda model: model.blocks) or None")
        for name, value in [("num_replicas", num_replicas), ("sync_period", sync_period),
                            ("num_fragments", num_fragments), ("data_parallel", data_parallel)]:
            _require(isinstance(value, int) and value >= 1, f"{name} must be an int >= 1 (got {value!r})")
        _require(overlap_steps >= 0, f"overlap_steps must be >= 0 (got {overlap_steps})")
        _require(router_sync_period >= 0, f"router_sync_period must be >= 0 (got {router_sync_period})")
        _require(algorithm in ("diloco", "ddp"), f"algorithm must be diloco or ddp (got {algorithm!r})")
        _require(on_nonfinite in ("stop", "skip"), f"on_nonfinite must be stop or skip (got {on_nonfinite!r})")
        _require(comm_device in ("auto", "on", "off"), f"comm_device must be auto, on or off (got {comm_device!r})")
        _require(quantize in _quantize.FORMATS, f"quantize must be one of {', '.join(_quantize.FORMATS)} (got {quantize!r})")
        _require(exchange in ("auto", "gather", "two_phase"),
                 f"exchange must be auto, gather or two_phase (got {exchange!r})")
        _require(fragment_pattern in ("strided", "sequential", "balanced"),
                 f"fragment_pattern must be strided, sequential or balanced (got {fragment_pattern!r})")
        if algorithm == "diloco":
            _require(sync_period % num_fragments == 0,
                     f"sync_period must be divisible by num_fragments (got H={sync_period}, P={num_fragments})")
            _require(overlap_steps < sync_period // num_fragments,
                     f"overlap_steps must be < sync_period / num_fragments (got tau={overlap_steps}, "
                     f"H/P={sync_period // num_fragments})")
            _require(0 <= alpha <= 1, f"alpha must be in [0, 1] (got {alpha})")
            _require(not error_feedback or quantize != "none", "error_feedback needs a lossy quantize format (got none)")
            _require(not router_sync_period or routers is not None, "router_sync_period needs a routers selector")
            _require(not router_sync_period or sync_period % router_sync_period == 0,
                     f"router_sync_period must divide sync_period (got K={router_sync_period}, H={sync_period})")
            _require(outer_overlap in ("none", "delayed", "eager"),
                     f"outer_overlap must be none, delayed or eager (got {outer_overlap!r})")
            if outer_overlap != "none":
                _require(overlap_steps == 0, f"outer_overlap={outer_overlap} already overlaps a whole round; "
                                             f"it does not combine with overlap_steps > 0")
                _require(alpha == 0, f"outer_overlap={outer_overlap} restarts replicas from the new anchor; "
                                     f"it does not combine with alpha > 0")
                _require(router_sync_period == 0, f"outer_overlap={outer_overlap} does not combine with router_sync_period")
                _require(outer_overlap != "eager" or on_nonfinite == "stop",
                         "outer_overlap=eager needs on_nonfinite='stop' (a skipped replica cannot be taken out "
                         "of proxies the others already applied)")
        else:
            for name, off in [("outer_overlap", outer_overlap == "none"), ("num_fragments", num_fragments == 1), ("overlap_steps", overlap_steps == 0),
                              ("alpha", alpha == 0), ("quantize", quantize == "none"),
                              ("error_feedback", not error_feedback), ("router_sync_period", router_sync_period == 0)]:
                _require(off, f"{name} applies to algorithm='diloco' only, not ddp")
        self.loss_fn, self.layers = loss_fn, layers
        self.num_replicas, self.sync_period, self.num_fragments = num_replicas, sync_period, num_fragments
        self.inner_optimizer = inner_optimizer
        self.outer_optimizer = outer_optimizer if outer_optimizer is not None else default_outer_optimizer()
        self.fragment_pattern, self.overlap_steps, self.alpha = fragment_pattern, overlap_steps, alpha
        self.quantize, self.error_feedback, self.exchange = quantize, error_feedback, exchange
        self.outer_overlap = outer_overlap if algorithm == "diloco" else "none"
        self.routers, self.router_sync_period = routers, router_sync_period
        self.on_nonfinite, self.algorithm = on_nonfinite, algorithm
        self.is_diloco = algorithm == "diloco"
        if mesh is None:
            overlapped = self.is_diloco and (overlap_steps > 0 or self.outer_overlap != "none")
            comm = comm_device if overlapped else "off"
            mesh, comm_mesh = build_meshes(num_replicas, data_parallel, comm_device=comm)
        _require(mesh.axis_names == ("diloco", "data"), f"mesh axes must be ('diloco', 'data') (got {mesh.axis_names})")
        _require(mesh.shape["diloco"] == num_replicas,
                 f"mesh has {mesh.shape['diloco']} rows on 'diloco', num_replicas is {num_replicas}")
        self.mesh, self.comm_mesh = mesh, comm_mesh
        # Host-side state, all of it. The device state (`TrainState`) is the rest.
        self._bound = None  # (treedef, shapes) of the model this object was set up for
        # Launched syncs (tau > 0) or exchanges (outer_overlap) by group, not installed yet.
        self._in_flight: dict[int, InFlightSync | InFlightExchange] = {}
        # The state this object handed out last and its step: `step` reads t from here
        # instead of from the device (which would wait for the step in flight).
        self._last_state, self._next_step = None, 0
        # Finite flags (R,) of finished syncs, by the step after which each finished; read
        # in the next step, after its inner step is dispatched (so reading does not stall it).
        self._unchecked: list[tuple[int, Array]] = []

    # -- set-up for one model shape -----------------------------------------------------------

    def _bind(self, model: PyTree) -> PyTree:
        """Build the programs for models shaped like `model`; returns its array part."""
        params, static = eqx.partition(model, _is_trainable)
        signature = (jax.tree.structure(params), tuple((x.shape, x.dtype) for x in jax.tree.leaves(params)))
        if self._bound is not None:
            _require(signature == self._bound, "this DiLoCo object was set up for a model of another structure or shape")
            return params
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        separate = None
        if self.is_diloco and self.router_sync_period:
            separate = tuple(bool(f) for f in jax.tree.leaves(self.routers(abstract)))
        try:
            self.groups = () if not self.is_diloco else make_groups(
                abstract, layers=self.layers, num_fragments=self.num_fragments,
                fragment_pattern=self.fragment_pattern, separate=separate,
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None
        # With its own sync period, the router group comes after the P fragments.
        self.router_group = self.num_fragments if separate is not None else None
        self._static = static
        self._build_kwargs = dict(
            num_replicas=self.num_replicas, groups=self.groups, inner_opt=self.inner_optimizer,
            outer_opt=self.outer_optimizer if self.is_diloco else None, error_feedback=self.error_feedback,
            outer_overlap=self.outer_overlap,
        )
        self.abstract_state = eqx.filter_eval_shape(
            lambda p: build_state(p, **self._build_kwargs, key=jax.random.key(0)), abstract
        )
        eager = self.outer_overlap == "eager"
        self.shardings = state_shardings(self.abstract_state, self.mesh, per_replica_anchors=eager)
        skip = self.on_nonfinite == "skip"
        self.inner_step = make_inner_step(
            self.mesh, self.inner_optimizer, self.loss_fn, static, ddp=not self.is_diloco, skip_nonfinite=skip
        )
        self.outer = None
        self.group_bytes: list[int] = []
        self.group_wire_bytes: list[int] = []
        self.overlapped = None
        if self.outer_overlap != "none":
            self.overlapped = OverlappedOuter(
                mesh=self.mesh, comm_mesh=self.comm_mesh, groups=self.groups, outer_opt=self.outer_optimizer,
                mode=self.outer_overlap, fmt=self.quantize, exchange=self.exchange, skip_nonfinite=skip,
                error_feedback=self.error_feedback, shardings=self.shardings,
            )
        if self.is_diloco:
            self.outer = None if self.overlapped is not None else OuterSync(
                mesh=self.mesh, groups=self.groups, outer_opt=self.outer_optimizer, fmt=self.quantize,
                alpha=self.alpha, skip_nonfinite=skip, error_feedback=self.error_feedback,
                shardings=self.shardings, comm_mesh=self.comm_mesh, exchange=self.exchange,
            )
            shapes = [[v.shape for v in group.get(abstract)] for group in self.groups]
            self.group_bytes = [sync_nbytes(s, self.quantize, self.num_replicas, self.exchange) for s in shapes]
            self.group_wire_bytes = [sync_wire_nbytes(s, self.quantize, self.num_replicas, self.exchange) for s in shapes]
        # A data-parallel step sends one full float32 gradient: the denominator of every bandwidth claim.
        shapes = [x.shape for x in jax.tree.leaves(abstract)]
        self.ddp_step_bytes = sync_nbytes(shapes, "none")
        self.ddp_step_wire_bytes = sync_wire_nbytes(shapes, "none", self.num_replicas)
        self._bound = signature
        return params

    def init(self, model: PyTree, *, key: PRNGKeyArray | None = None) -> TrainState:
        """A fresh state on the mesh: every replica (and theta_g) starts from `model`.

        **Arguments:**

        - `model`: an Equinox model (its inexact arrays are trained, the rest is static).
        - `key`: seeds each replica's PRNG stream for `loss_fn` (default `jax.random.key(0)`).
        """
        params = self._bind(model)
        key = jax.random.key(0) if key is None else key
        build = jax.jit(lambda p, k: build_state(p, **self._build_kwargs, key=k), out_shardings=self.shardings)
        # Fresh buffers: jit may hand an input straight back as theta_g, and the first step
        # donates the state, which would delete the caller's model arrays with it.
        state = build(jax.tree.map(jnp.copy, params), key)
        self._in_flight.clear()
        self._unchecked.clear()
        self._last_state, self._next_step = state, 0
        return state

    # -- the schedule -------------------------------------------------------------------------

    def events(self, t: int) -> tuple[int | None, int | None]:
        """(fragment whose sync starts after step t, fragment merged after step t)."""
        if not self.is_diloco:
            return None, None
        return (
            schedule.synced_fragment(t, self.sync_period, self.num_fragments),
            schedule.applied_fragment(t, self.sync_period, self.num_fragments, self.overlap_steps),
        )

    def router_due(self, t: int) -> bool:
        """Whether the router group takes its own outer step after step t."""
        return self.router_group is not None and schedule.router_synced(t, self.router_sync_period)

    def _bytes_at(self, t: int, per_group: list[int], ddp: int) -> int:
        if not self.is_diloco:
            return ddp
        synced, _ = self.events(t)
        sent = 0 if synced is None else per_group[synced]
        if self.router_due(t):
            sent += per_group[self.router_group]
        return sent

    def sent_bytes_at(self, t: int) -> int:
        """Payload bytes one replica encodes for the syncs that start at step t (scales included)."""
        return self._bytes_at(t, self.group_bytes, self.ddp_step_bytes)

    def wire_bytes_at(self, t: int) -> int:
        """Bytes one replica's collectives move for the syncs that start at step t.

        A float32 psum counts as a ring all-reduce (2 (R - 1) / R of the buffer), a payload
        all-gather as R - 1 payloads, the two-phase exchange as 2 (R - 1) / R of a payload.
        """
        return self._bytes_at(t, self.group_wire_bytes, self.ddp_step_wire_bytes)

    # -- stepping ----------------------------------------------------------------------------

    def outer_steps(self, state: TrainState, t: int) -> tuple[TrainState, Array | None, int | None, int | None]:
        """Run the syncs and merges due after step t. Returns (state, finite, synced, applied).

        With tau = 0 a sync and its merge are one program. With tau > 0 the sync is launched
        (on the communication devices, if any) and the host moves on; tau steps later its
        result is installed and merged. `finite` (R,) belongs to the syncs that finished here.
        """
        if not self.is_diloco:
            return state, None, None, None
        synced, applied = self.events(t)
        if self.overlapped is not None:
            return self._overlapped_outer_steps(state, synced)
        finished = []
        if self.router_due(t):  # routers are small: a blocking sync, merged at once
            state, finite = self.outer.sync_and_merge(state, self.router_group)
            finished.append(finite)
        if synced is not None and synced == applied:  # tau = 0: apply at once
            state, finite = self.outer.sync_and_merge(state, synced)
            finished.append(finite)
        else:
            if applied is not None:
                if applied in self._in_flight:  # else installed early (settle) or restored
                    state, finite = self.outer.install(state, self._in_flight.pop(applied))
                    finished.append(finite)
                state = self.outer.merge(state, applied)
            if synced is not None:
                self._in_flight[synced] = self.outer.launch(state, synced)
        finite = functools.reduce(jnp.logical_and, finished) if finished else None
        return state, finite, synced, applied

    def _overlapped_outer_steps(self, state: TrainState, synced: int | None):
        """delayed / eager: take the arrived exchange of this group, step, launch the next one."""
        if synced is None:
            return state, None, None, None
        finite = None
        if synced in self._in_flight:  # else settled early (evaluation, checkpoint), restored, or the first round
            state, finite = self.overlapped.install(state, self._in_flight.pop(synced))
        state, self._in_flight[synced] = self.overlapped.sync(state, synced)
        return state, finite, synced, synced

    def _current_step(self, state: TrainState) -> int:
        if state is self._last_state:
            return self._next_step
        return int(jax.device_get(state.step))  # a state we did not hand out: ask the device

    def step(
        self, state: TrainState, batch: PyTree, *, before_sync: Callable[[TrainState], Any] | None = None
    ) -> tuple[TrainState, dict[str, Any]]:
        """One inner step on every replica, then every sync and merge due after it.

        **Arguments:**

        - `state`: the current state (donated: do not use it afterwards).
        - `batch`: a pytree whose leaves have shape (R, B, ...): replica r's batch is row r.
        - `before_sync`: optional diagnostic `f(state)` run after the inner step of a step
          that starts a sync, before it (e.g. how far replicas drifted); its result is
          `metrics["before_sync"]` (None at other steps).

        **Returns:** `(state, metrics)`. `metrics` holds device arrays `loss`, `grad_norm`,
        `finite` of shape (R,), the loss's aux outputs with a leading R axis, and, when a
        sync finished at this step, `sync_finite` (R,); plus host ints (or None)
        `synced_fragment` / `applied_fragment`. Reading metrics blocks; the step does not.

        **Raises:** `NonFiniteError` in the step after a sync whose outer gradient was non-finite
        (`on_nonfinite="stop"`: in any replica; `"skip"`: in every replica) or whose outer step
        would have made theta_g non-finite. Such an outer step is never applied.
        `ConfigError` if a batch leaf lacks the leading replica axis of size R.
        """
        self._check_batch(batch)
        t = self._current_step(state) + 1
        state, metrics = self.inner_step(state, batch)
        if self._unchecked:
            # The flags of syncs that finished before this step, read once this step is
            # dispatched: the devices keep working while the host waits for them.
            self._check_nonfinite()
        if before_sync is not None:
            due = self.is_diloco and (self.events(t)[0] is not None or self.router_due(t))
            metrics["before_sync"] = before_sync(state) if due else None
        state, finite, synced, applied = self.outer_steps(state, t)
        if finite is not None:
            metrics["sync_finite"] = finite
            self._unchecked.append((t, finite))
        metrics["synced_fragment"], metrics["applied_fragment"] = synced, applied
        self._last_state, self._next_step = state, t
        return state, metrics

    # -- reading the result -----------------------------------------------------------------

    def settle(self, state: TrainState) -> tuple[TrainState, list[Array]]:
        """Wait for every in-flight sync and put its result into the state (merges stay scheduled).

        The global params then read as if the syncs had been blocking, which is what an
        evaluation or a checkpoint must see. Returns (state, finite flags of those syncs).
        """
        finished = []
        install = self.overlapped.install if self.overlapped is not None else self.outer.install if self.outer else None
        for group in sorted(self._in_flight):
            state, finite = install(state, self._in_flight.pop(group))
            finished.append(finite)
            self._unchecked.append((self._next_step, finite))
        if self._last_state is not None:
            self._last_state = state
        return state, finished

    def sync_now(self, state: TrainState, group: int) -> TrainState:
        """Outside the schedule: the outer step of `group` now, with `outer_overlap` delayed / eager.

        For the end of training (the trainer's final sync): a group whose last scheduled sync
        is older than the last step takes one more outer step, so its inner steps since then
        are sent too; `drain` then lands that exchange. Needs nothing of `group` in flight
        (`settle` first).
        """
        _require(self.outer_overlap != "none", "sync_now is for outer_overlap='delayed' or 'eager'")
        _require(group not in self._in_flight, f"group {group} has an exchange in flight: settle first")
        state, self._in_flight[group] = self.overlapped.sync(state, group)
        if self._last_state is not None:
            self._last_state = state
        return state

    def drain(self, state: TrainState) -> TrainState:
        """When training is over: land every exchange still on its way in the global model.

        `outer_overlap` delayed / eager: the last round's exchange has no next sync to be used
        at; this waits for it and applies the share no outer step has used yet (the part of
        an outer step that share is responsible for, see `_eager`), restarts the replicas from
        the new anchors and empties the mailbox (a second drain does nothing). Otherwise it is
        `settle`. Returns the state to evaluate, export or save.
        """
        state, _ = self.settle(state)
        if self.overlapped is not None:
            for group in range(len(self.groups)):
                state = self.overlapped.drain(state, group)
            if self._last_state is not None:
                self._last_state = state
        return state

    def finish(self, state: TrainState) -> TrainState:
        """End of training: after it, `global_model(state)` includes every inner step taken.

        Settles the syncs in flight, gives every parameter group whose last sync is older than
        the last step one more outer step (with Streaming DiLoCo every fragment but the one
        that synced last; with any `sync_period` that does not divide the step count, all of
        them), and lands the exchanges still on their way (`outer_overlap` delayed / eager).
        The replicas are not merged: training is over. Call it once, after the last `step`;
        data-parallel training has nothing to finish.

        **Arguments:**

        - `state`: the state after the last step (donated: use the returned one).

        **Returns:** the finished state, to evaluate, export or save.

        **Raises:** `NonFiniteError` as `step` does, for every sync it ran or settled.
        """
        if not self.is_diloco:
            return state
        t = self._current_step(state)
        state, _ = self.settle(state)
        stale = self.stale_groups(t)
        if self.overlapped is not None:
            for group in stale:
                state = self.sync_now(state, group)
            state, _ = self.settle(state)  # their flags are checked before the exchanges land
            self._check_nonfinite()
            state = self.drain(state)
        else:
            for group in stale:
                state, finite = self.outer.sync(state, group)
                self._unchecked.append((t, finite))
        self._check_nonfinite()
        self._last_state, self._next_step = state, t
        return state

    def stale_groups(self, t: int) -> list[int]:
        """The parameter groups whose last scheduled sync is older than step `t` (see `finish`)."""
        stale = []
        for group in range(len(self.groups)):
            if group == self.router_group:
                last = t - t % self.router_sync_period
            else:
                last = max(schedule.sync_steps(group, self.sync_period, self.num_fragments, t), default=0)
            if last < t:
                stale.append(group)
        return stale

    def _check_nonfinite(self) -> None:
        """Raise `NonFiniteError` for the first unread sync flags that the policy does not accept.

        A process reads the rows of the replicas it holds (no collective); in a multi-process
        run the process holding a bad replica raises.
        """
        unchecked, self._unchecked = self._unchecked, []
        for t, finite in unchecked:
            rows = {}
            for shard in finite.addressable_shards:
                start = shard.index[0].start or 0
                for offset, ok in enumerate(np.asarray(shard.data)):
                    rows[start + offset] = bool(ok)
            bad = sorted(r for r, ok in rows.items() if not ok)
            if not bad:
                continue
            if self.on_nonfinite == "stop":
                raise NonFiniteError(
                    f"non-finite outer gradient (or outer step) of replica {bad[0]} at the sync after step {t}; "
                    f"the global model keeps its last finite values (on_nonfinite='stop'; 'skip' leaves such a "
                    f"replica out of the mean)"
                )
            if len(bad) == self.num_replicas:
                raise NonFiniteError(
                    f"non-finite outer gradient (or outer step) in every replica at the sync after step {t}: "
                    f"on_nonfinite='skip' has nothing left to average"
                )

    def _check_batch(self, batch: PyTree) -> None:
        R = self.num_replicas
        for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
            shape = getattr(leaf, "shape", ())
            if len(shape) < 2 or shape[0] != R:
                raise ConfigError(
                    f"batch leaf {jax.tree_util.keystr(path) or 'batch'} has shape {tuple(shape)}: every leaf "
                    f"needs a leading replica axis of size num_replicas={R}, then the replica's batch axis"
                )

    def global_params(self, state: TrainState) -> PyTree:
        """theta_g with in-flight results included (the state is not consumed); ddp: replica 0."""
        if not self.is_diloco:
            return jax.tree.map(lambda x: x[0], state.params)
        if self.outer_overlap == "eager":  # per-replica anchors: their mean
            return jax.tree.map(lambda x: jnp.mean(x, axis=0), state.global_params)
        if self.overlapped is not None:  # delayed: theta_g only moves at its syncs
            return state.global_params
        global_params = state.global_params
        for group in sorted(self._in_flight):
            new_values = self._in_flight[group].outputs[0]
            if self.comm_mesh is not None:
                new_values = move_to_mesh(new_values, self.comm_mesh, self.mesh)
            global_params = self.groups[group].put(global_params, new_values)
        return global_params

    def global_model(self, state: TrainState) -> PyTree:
        """The model to evaluate or export: theta_g (replica 0 for ddp), an instance of your model class.

        In-flight syncs are included without consuming `state`; the arrays are a copy.
        """
        _require(self._bound is not None, "call init(model) (or restore) before global_model")
        # A copy: the next step donates the state, and the model handed out must outlive it.
        return eqx.combine(jax.tree.map(jnp.copy, self.global_params(state)), self._static)

    # -- checkpoints -------------------------------------------------------------------------

    def save(
        self, checkpointer: Checkpointer, state: TrainState, *, metadata: Any = None, force: bool = False
    ) -> TrainState:
        """Save when `checkpointer.every` says a save is due at the state's step (or `force`).

        Call it after every step: off-schedule steps return at once. A due save settles the
        in-flight syncs, then starts an asynchronous Orbax save.

        **Arguments:**

        - `checkpointer`: where and how often (`every`; 0 never saves, not even with `force`).
        - `state`: the current state (donated when a save is due: use the returned one).
        - `metadata`: JSON-able (e.g. your config), stored beside the arrays and handed to
          `restore`'s `check`.
        - `force`: save at this step even if it is off the schedule (the end of a run).

        **Returns:** the state to use from here on (settled if a save ran).
        """
        step = self._current_step(state)
        if not (force or checkpointer.due(step)):
            return state
        state, _ = self.settle(state)
        checkpointer.save(step, state, metadata)
        return state

    def restore(
        self,
        checkpointer: Checkpointer,
        model: PyTree,
        *,
        step: int | None = None,
        check: Callable[[dict, int], str | None] | None = None,
    ) -> TrainState | None:
        """The newest intact checkpoint's state (or checkpoint `step`), placed on the mesh; None if none.

        `model` gives the structure (its values are not used). Resuming is bit-exact: the
        data position is yours to derive from `int(state.step)`.
        """
        self._bind(model)
        restored = checkpointer.restore_latest(self.abstract_state, self.shardings, check, step=step)
        if restored is None:
            return None
        state, saved_step = restored
        self._in_flight.clear()
        self._last_state, self._next_step = state, saved_step
        return state

    # -- elastic islands (one replica per process; see `_elastic`) ------------------------------

    @property
    def settled(self) -> bool:
        """Whether no sync is in flight: right after a sync or merge, a sync boundary."""
        return not self._in_flight

    def own_replica(self) -> int:
        """The replica whose rows this process holds (an island holds exactly one)."""
        return own_replica(self.shardings.keys, self.num_replicas)

    def island_snapshot(self, state: TrainState, *, island: int) -> dict[str, Any]:
        """Host copies of what island `island` (this process) needs to come back at this step.

        Call it at a sync boundary (`settled`); blocks until `state` is computed. Write the
        result with `IslandSnapshots.write`.
        """
        _require(self.settled, "island_snapshot needs a sync boundary: no sync may be in flight")
        return island_payload(state, step=self._current_step(state), replica=self.own_replica(), island=island)

    def reform(self, snapshots: IslandSnapshots, *, island: int, key: PRNGKeyArray) -> TrainState | None:
        """The state re-formed from the live islands' newest snapshot (None if no island has one).

        Every process calls it (it agrees on the step and broadcasts theta_g and the outer
        state from an island that has them); this island keeps its own rows if it has that
        step, else starts from theta_g with a fresh inner optimizer state. `key` seeds that
        fresh PRNG stream. Needs `init`, `abstract` or `restore` first (for the shapes).
        """
        _require(self._bound is not None, "call abstract(model) (or init / restore) before reform")
        step, source = agree_on_step(snapshots)
        if step is None:
            return None
        state = reform_state(self, snapshots, step=step, source=source, island=island,
                             replica=self.own_replica(), key=key)
        self._in_flight.clear()
        self._last_state, self._next_step = state, step
        return state

    def abstract(self, model: PyTree) -> TrainState:
        """The state's shapes and dtypes (`jax.ShapeDtypeStruct` leaves) for models like `model`."""
        self._bind(model)
        return self.abstract_state
