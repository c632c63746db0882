"""`DiLoCo`: the model-agnostic core. Bring an Equinox model, a loss and optax optimizers.

The object owns everything between "a batch per replica" and "a trained global model":
the mesh, the per-replica inner step, the fragments and their sync schedule, the outer
optimizer, quantized exchanges, overlapped syncs on communication devices and their merges,
and checkpoint wiring. The LM trainer (`eqx_diloco.Trainer`) is one client of it.

Host-side bookkeeping: a sync launched with overlap (tau > 0) runs in the background and
its result is installed tau steps later. Those in-flight results live in this object (one
`SyncGroup` per parameter group holds its own), not in the state, and the state always
*reads* as if syncs were blocking once `settle` has run (`save` and `global_model` do that).
"""

import functools
from typing import Any, Callable, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jaxtyping import Array, PRNGKeyArray

from . import schedule
from ._arguments import check_arguments, check_batch, error_feedback_decay
from ._codec import Codec
from ._compile_ahead import compile_outer_ahead
from ._errors import ConfigError
from ._mesh import as_full_mesh, build_meshes, check_comm_mesh
from ._persistence import Persistence
from ._programs import FIELDS as PROGRAM_FIELDS
from ._programs import Programs, build_programs, is_trainable, signature
from ._results import Results
from ._rare_programs import rare_program_options
from ._traffic import Traffic
from ._state import TrainState, build_state
from ._step import LossFn
from ._sync_group import SyncGroup, make_sync_groups

PyTree = Any

# `DiLoCo` attributes read as one list over the parameter groups: the `SyncGroup` field each lists.
_GROUP_FIELDS = {"group_bytes": "sent_bytes", "group_wire_bytes": "wire_bytes"}


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def default_outer_optimizer() -> optax.GradientTransformation:
    """SGD with lr 1.0 and Nesterov momentum 0.3, the CLI's default from `benchmarks/outer_sweep.py`
    (at 512 tokens per replica step it beat plain averaging at H = 20 and tied it at H = 10; the
    papers' `optax.sgd(0.7, momentum=0.9, nesterov=True)` was 5-10% behind DDP there)."""
    return optax.sgd(1.0, momentum=0.3, nesterov=True)


class DiLoCo(Results, Persistence, Traffic):
    """DiLoCo / Streaming DiLoCo for any Equinox model.

    **Arguments (all keyword-only; names match the CLI's `--diloco.*` flags):**

    - `loss_fn`: `loss_fn(model, batch, key) -> (loss, aux)` or `-> loss`: a scalar loss of
      one replica's batch (its share on one `data` device) and optionally a dict of arrays to
      report. `key` is a fresh PRNG key per replica, step and `data` device. (In a sharded
      island, `fsdp` or `tensor` > 1, it sees the replica's whole batch and one key per
      replica and step: XLA splits the work.)
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
    - `quantize`: wire format of outer gradients (of their kept values, with `topk`): none,
      bf16, fp8, int8, int4, e3m0, int2.
    - `topk`: send only the largest-magnitude fraction `topk` (a density in (0, 1]) of each
      chunk of `topk_chunk` values of an outer gradient, with their positions (SparseLoCo,
      see `_codec`); None sends everything. Needs `error_feedback` (what is left out is
      carried to the next sync).
    - `topk_chunk`: values per top-k chunk, a power of two from 8 to 65536 (positions travel
      as an Elias-Fano code per chunk); the default 65536 selects nearly over the whole group,
      which trained far better than 256-value chunks (`benchmarks/compression.py`).
    - `error_feedback`: carry each replica's quantization residual to its next sync: True, or a
      decay beta in (0, 1] on the carried residual (SparseLoCo's accumulator, used with no outer
      momentum: beta 0.95; True is beta 1).
    - `outer_overlap`: `none` (a sync blocks, or overlaps tau steps), or overlap each sync's
      whole exchange with the next round of that group (arXiv 2502.12996, see `_eager`):
      `delayed` applies the averaged outer gradient one outer step late, `eager` uses each
      replica's fresh outer gradient in place of its stale share and corrects with the
      others' when they arrive. Needs overlap_steps=0, alpha=0, no router group; eager
      also needs on_nonfinite="stop".
    - `exchange`: the collective of a quantized sync: `gather` (one-shot all-gather of every
      replica's payload: (R - 1) payloads sent, R decoded), `two_phase` (packed
      reduce-scatter + all-gather: 2 (R - 1) / R of a payload sent, O(n) decode memory, two
      roundings) or `auto` (gather at R <= 2 and top-k up to R = 8, else two_phase; float32: psum).
    - `routers`: optional `routers(params) -> tree of bools` flagging leaves that sync on
      their own period (MoE routers); `router_sync_period`: that period K (0 = off).
    - `on_nonfinite`: `stop` (a non-finite loss or outer gradient raises `NonFiniteError`) or
      `skip` (such a replica keeps its step / is left out; all of them raise). `check_losses=False`
      leaves the loss flags to the caller (the CLI checks the losses it exchanges over processes).
    - `data_parallel`: devices per replica on the `data` mesh axis.
    - `comm_device`: with tau > 0 (or `outer_overlap`), run syncs on devices of their own so they
      overlap compute for real, `fsdp x tensor` of them per mesh row (one per shard): `on` (extra
      devices of the compute backend), `host` (the process's CPU devices: beside a GPU or TPU the
      CPU client's, `jax.devices("cpu")`, as many as `use_cpu_devices` asked for; values are
      copied there and back, see `_host`), `off` (the compute devices), or `auto`: `on` on a CPU
      backend, `host` on a GPU or TPU, where the process has the devices.
    - `algorithm`: `diloco`, or `ddp` (gradients averaged every step; the baseline).
    - `replicas_per_device`: K, replicas that share one row of `data_parallel` devices, run
      vmapped in one program (a sync sums them before the `psum` over `diloco`); must divide
      R / process count. None: 1 where there are devices enough, else the smallest K that
      fits (so R replicas train on one device). Results do not depend on K (up to float32
      summation order); checkpoints resume onto any K.
    - `fsdp`, `tensor`: devices per replica on the `fsdp` and `tensor` mesh axes (a replica, or
      island, spanning `data_parallel x fsdp x tensor` devices). Every array that mirrors a
      parameter (replicas, inner and outer optimizer states, theta_g, residuals, mailboxes)
      is sharded by `param_specs`; a sync moves each device's own shard over `diloco` (see
      `_sharding`). Batches are split over `data x fsdp`.
    - `param_specs`: `param_specs(abstract_model) -> tree of PartitionSpec` over the axes
      `fsdp` and `tensor`, shaped like the model's trainable arrays (None in a slot:
      replicated); the layer axis of the stack stays whole. None: the FSDP rule
      (`fsdp_specs`: each leaf's largest dimension `fsdp` divides). `tensor > 1` needs it
      (the bundled `Transformer.param_specs` gives the tensor-parallel rules).
    - `outer_state_memory`: `device`, or `host`: theta_g and the outer optimizer state live in
      the devices' `pinned_host` memory (JAX memory kinds) and visit device memory only
      inside a sync or merge, saving two parameter-sized copies per device between syncs.
      Needs `outer_overlap="none"`.
    - `sync_compiler_options`: XLA `compiler_options` of the sync programs (None: XLA's defaults).
    - `mesh`, `comm_mesh`: bring your own ("diloco", "data", "fsdp", "tensor") or
      ("diloco", "data") meshes instead (`comm_mesh`: rows x 1 x fsdp x tensor devices of
      their own, each in the process of the shard it partners).

    **Precision.** theta_g, the outer optimizer state, error-feedback residuals and the eager
    mailboxes are float32 even where the model's parameters are bfloat16 or float16 (a small
    outer step would round away in 8 mantissa bits); the replicas keep the model's dtypes,
    outer gradients are formed in float32 and merges cast back.

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
        topk: float | None = None,
        topk_chunk: int = 65536,
        error_feedback: bool | float = False,
        outer_overlap: Literal["none", "delayed", "eager"] = "none",
        exchange: Literal["auto", "gather", "two_phase"] = "auto",
        routers: Callable[[PyTree], PyTree] | None = None,
        router_sync_period: int = 0,
        on_nonfinite: Literal["stop", "skip"] = "stop",
        check_losses: bool = True,
        data_parallel: int = 1,
        comm_device: Literal["auto", "on", "host", "off"] = "auto",
        algorithm: Literal["diloco", "ddp"] = "diloco",
        replicas_per_device: int | None = None,
        mesh: Mesh | None = None,
        comm_mesh: Mesh | None = None,
        fsdp: int = 1,
        tensor: int = 1,
        param_specs: Callable[[PyTree], PyTree] | None = None,
        outer_state_memory: Literal["device", "host"] = "device",
        sync_compiler_options: dict[str, Any] | None = None,
    ):
        _require(callable(loss_fn), "loss_fn must be callable: loss_fn(model, batch, key) -> (loss, aux) or loss")
        _require(layers is None or callable(layers), "layers must be a selector (lambda model: model.blocks) or None")
        check_arguments(
            check_losses=check_losses, num_replicas=num_replicas, sync_period=sync_period, num_fragments=num_fragments,
            fragment_pattern=fragment_pattern, overlap_steps=overlap_steps, alpha=alpha, quantize=quantize,
            topk=topk, topk_chunk=topk_chunk,
            error_feedback=error_feedback, outer_overlap=outer_overlap, exchange=exchange,
            router_sync_period=router_sync_period, has_routers=routers is not None, on_nonfinite=on_nonfinite,
            data_parallel=data_parallel, comm_device=comm_device, algorithm=algorithm,
            replicas_per_device=replicas_per_device, fsdp=fsdp, tensor=tensor, outer_state_memory=outer_state_memory,
            param_specs=param_specs, sync_compiler_options=sync_compiler_options,
        )
        self.loss_fn, self.layers = loss_fn, layers
        self.num_replicas, self.sync_period, self.num_fragments = num_replicas, sync_period, num_fragments
        self.inner_optimizer = inner_optimizer
        self.outer_optimizer = outer_optimizer if outer_optimizer is not None else default_outer_optimizer()
        self.fragment_pattern, self.overlap_steps, self.alpha = fragment_pattern, overlap_steps, alpha
        self.quantize, self.error_feedback, self.exchange = quantize, bool(error_feedback), exchange
        self.error_feedback_decay = error_feedback_decay(error_feedback)
        self.topk, self.topk_chunk = topk, topk_chunk
        self.wire = Codec(quantize, topk, topk_chunk)  # what an outer gradient becomes on the wire
        self.outer_overlap = outer_overlap if algorithm == "diloco" else "none"
        self.routers, self.router_sync_period = routers, router_sync_period
        self.on_nonfinite, self.algorithm, self.check_losses = on_nonfinite, algorithm, check_losses
        self.is_diloco = algorithm == "diloco"
        if mesh is None:
            overlapped = self.is_diloco and (overlap_steps > 0 or self.outer_overlap != "none")
            comm = comm_device if overlapped else "off"
            mesh, comm_mesh = build_meshes(num_replicas, data_parallel, comm_device=comm,
                                           replicas_per_device=replicas_per_device, fsdp=fsdp, tensor=tensor)
        mesh = as_full_mesh(mesh)
        comm_mesh = None if comm_mesh is None else as_full_mesh(comm_mesh)
        # A mesh brought by the caller says how big an island is.
        self.fsdp, self.tensor, self.param_specs = mesh.shape["fsdp"], mesh.shape["tensor"], param_specs
        self.outer_state_memory, self.sync_compiler_options = outer_state_memory, sync_compiler_options
        kinds = {m.kind for m in mesh.devices.flat[0].addressable_memories()}
        _require(outer_state_memory == "device" or "pinned_host" in kinds,
                 f"outer_state_memory host needs the 'pinned_host' memory kind, which {mesh.devices.flat[0].platform} "
                 f"devices do not have (they have {', '.join(sorted(kinds))})")
        check_comm_mesh(mesh, comm_mesh)
        rows = mesh.shape["diloco"]
        _require(num_replicas % rows == 0 and replicas_per_device in (None, num_replicas // rows),
                 f"mesh has {rows} rows on 'diloco': num_replicas ({num_replicas}) must be rows x replicas_per_device"
                 f" ({replicas_per_device})")
        self.mesh, self.comm_mesh = mesh, comm_mesh
        # Syncs run on the host's CPUs where asked, or where a comm_mesh brought by the caller is on another
        # backend than the compute mesh: then a thread of their own copies and dispatches them (`_host`).
        self.sync_on_host = comm_mesh is not None and (
            comm_device == "host" or comm_mesh.devices.flat[0].platform != mesh.devices.flat[0].platform)
        # K replicas live on each row of the mesh (stepped under vmap; a sync sums them locally).
        self.replicas_per_device = num_replicas // rows
        # Host-side state, all of it. The device state (`TrainState`) is the rest.
        self._programs: Programs | None = None  # built by the first init / restore / abstract
        # One per parameter group, built with the programs: its schedule, payload sizes and
        # launched sync (tau > 0) or exchange (outer_overlap) not installed yet.
        self._sync_groups: tuple[SyncGroup, ...] = ()
        # The state this object handed out last and its step: `step` reads t from here
        # instead of from the device (which would wait for the step in flight).
        self._last_state, self._next_step = None, 0
        # Finite flags (R,) of finished syncs, by the step after which each finished; read
        # in the next step, after its inner step is dispatched (so reading does not stall it).
        self._unchecked: list[tuple[int, Array]] = []
        # The same for inner steps (`check_losses`); the state `finish` returned (finishing it again changes nothing).
        self._unchecked_losses, self._finished_state = [], None

    # -- set-up for one model shape -----------------------------------------------------------

    def _bind(self, model: PyTree) -> PyTree:
        """Build the programs for models shaped like `model` (once); returns its array part."""
        params, static = eqx.partition(model, is_trainable)
        _require(len(jax.tree.leaves(params)) > 0, "model has no floating-point arrays: DiLoCo trains those")
        if self._programs is not None:
            _require(signature(params) == self._programs.signature,
                     "this DiLoCo object was set up for a model of another structure or shape")
            return params
        self._programs = build_programs(self, params, static)
        self._sync_groups = make_sync_groups(self, self._programs, params)
        return params

    def _drop_in_flight(self) -> None:
        # A fresh, restored or re-formed state has nothing in flight: an exchange launched from
        # an earlier state belongs to that state (checkpoints and island snapshots are settled).
        for sync_group in self._sync_groups:
            sync_group.in_flight = None
        self._unchecked_losses.clear()  # flags of the steps of an earlier state

    def __getattr__(self, name: str):
        # Reached only for names not set on the object: the bound programs' fields, and the
        # sync groups' byte counts as lists by group (what the trainer reads).
        if name in PROGRAM_FIELDS or name in _GROUP_FIELDS:
            programs = self.__dict__.get("_programs")
            if programs is None:
                raise AttributeError(f"DiLoCo.{name} exists once a model is bound: call init, restore or abstract")
            if name in _GROUP_FIELDS:
                return [getattr(sync_group, _GROUP_FIELDS[name]) for sync_group in self._sync_groups]
            return getattr(programs, name)
        raise AttributeError(f"'DiLoCo' object has no attribute {name!r}")

    def init(self, model: PyTree, *, key: PRNGKeyArray | None = None) -> TrainState:
        """A fresh state on the mesh: every replica (and theta_g) starts from `model`.

        **Arguments:**

        - `model`: an Equinox model (its inexact arrays are trained, the rest is static).
        - `key`: seeds each replica's PRNG stream for `loss_fn` (default `jax.random.key(0)`).
        """
        params = self._bind(model)
        key = jax.random.key(0) if key is None else key
        build = jax.jit(lambda p, k: build_state(p, **self.build_kwargs, key=k), out_shardings=self.shardings,
                        compiler_options=rare_program_options(sum(x.size for x in jax.tree.leaves(params))))
        # Fresh buffers: jit may return an input as theta_g, and the first step donates (deletes) the state.
        state = build(jax.tree.map(jnp.copy, params), key)
        self._drop_in_flight()
        self._unchecked.clear()
        self._last_state, self._next_step = state, 0
        return state

    # -- the schedule -------------------------------------------------------------------------

    def events(self, t: int) -> tuple[int | None, int | None]:
        """(fragment whose sync starts after step t, fragment merged after step t)."""
        if not self.is_diloco:
            return None, None
        return (schedule.synced_fragment(t, self.sync_period, self.num_fragments),
                schedule.applied_fragment(t, self.sync_period, self.num_fragments, self.overlap_steps))

    def router_due(self, t: int) -> bool:
        """Whether the router group takes its own outer step after step t."""
        return self.router_group is not None and self._sync_groups[self.router_group].syncs_after(t)

    def compile_outer_ahead(self, state: TrainState) -> None:
        """Compile every group's sync programs for `state` now, not at its first sync mid-run."""
        compile_outer_ahead(self, state)

    # -- stepping ----------------------------------------------------------------------------

    def outer_steps(self, state: TrainState, t: int) -> tuple[TrainState, Array | None, int | None, int | None]:
        """Run the syncs and merges due after step t. Returns (state, finite, synced, applied).

        With tau = 0 a sync and its merge are one program. With tau > 0 the sync is launched
        (on the communication devices or the host's CPUs, if any) and the host moves on; tau steps later its
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
                # Nothing in flight if it was installed early (settle) or the state restored.
                state, finite = self._sync_groups[applied].settle(state)
                if finite is not None:
                    finished.append(finite)
                state = self.outer.merge(state, applied)
            if synced is not None:
                state = self._sync_groups[synced].launch(state)
        finite = functools.reduce(jnp.logical_and, finished) if finished else None
        return state, finite, synced, applied

    def _overlapped_outer_steps(self, state: TrainState, synced: int | None):
        """delayed / eager: take the arrived exchange of this group, step, launch the next one."""
        if synced is None:
            return state, None, None, None
        sync_group = self._sync_groups[synced]
        # Nothing in flight if settled early (evaluation, checkpoint), restored, or the first round.
        state, finite = sync_group.settle(state)
        state = sync_group.launch(state)
        return state, finite, synced, synced

    def step(
        self, state: TrainState, batch: PyTree, *, before_sync: Callable[[TrainState], Any] | None = None
    ) -> tuple[TrainState, dict[str, Any]]:
        """One inner step on every replica, then every sync and merge due after it.

        **Arguments:**

        - `state`: the current state (donated: passing it again raises `ConfigError`).
        - `batch`: a pytree whose leaves have shape (R, B, ...): replica r's batch is row r.
        - `before_sync`: optional diagnostic `f(state)` run after the inner step of a step
          that starts a sync, before it (e.g. how far replicas drifted); its result is
          `metrics["before_sync"]` (None at other steps).

        **Returns:** `(state, metrics)`. `metrics` holds device arrays `loss`, `grad_norm`,
        `finite` of shape (R,), the loss's aux outputs with a leading R axis, and, when a
        sync finished at this step, `sync_finite` (R,); plus host ints (or None)
        `synced_fragment` / `applied_fragment`. Reading metrics blocks; the step does not.

        **Raises:** `NonFiniteError` in the step after a non-finite loss or outer gradient
        (`on_nonfinite="stop"`: in any replica; `"skip"`: in every one) or an outer step that
        would have made theta_g non-finite (never applied: `error.state` holds the last finite
        theta_g). `ConfigError` for a batch leaf without the replica axis R, or a non-scalar loss.
        """
        check_batch(batch, self.num_replicas, self.mesh.shape["data"] * self.mesh.shape["fsdp"])
        t = self._current_step(state) + 1
        state, metrics = self.inner_step(state, batch)
        self._check_flags(state, t, metrics["finite"])
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
