"""What `DiLoCo` builds for one model shape: its parameter groups, state layout and programs."""

import dataclasses
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.numpy as jnp

from ._eager import OverlappedOuter
from ._errors import ConfigError
from ._fragments import stack_flags
from ._groups import ParamGroup, make_groups
from ._host import HostHandoff
from ._outer import OuterSync, sync_nbytes, sync_wire_nbytes
from ._sharding import resolve_specs
from ._state import TrainState, build_state, state_shardings
from ._step import make_inner_step

if TYPE_CHECKING:
    from ._diloco import DiLoCo

PyTree = Any


def is_trainable(x) -> bool:
    """Inexact arrays are trained; so are their abstract stand-ins (for `abstract(model)`)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jnp.issubdtype(x.dtype, jnp.inexact)
    return eqx.is_inexact_array(x)


def signature(params: PyTree) -> tuple:
    """Structure, shapes and dtypes: models with equal signatures share their programs."""
    return jax.tree.structure(params), tuple((x.shape, x.dtype) for x in jax.tree.leaves(params))


@dataclasses.dataclass(frozen=True)
class Programs:
    """The programs and layout `DiLoCo` builds for models of one signature (read them as
    `diloco.<field>` once a model is bound by `init`, `restore` or `abstract`)."""

    signature: tuple
    leaf_specs: tuple  # per trainable leaf (flatten order), its PartitionSpec over the inner axes
    value_specs: tuple | None  # per group, its values' specs (None unless the islands are sharded)
    groups: tuple[ParamGroup, ...]  # fragments 0..P-1, then the router group if it has its own period
    router_group: int | None
    static: PyTree  # the model's non-trainable part
    build_kwargs: dict  # `build_state`'s arguments other than the params and key
    abstract_state: TrainState
    shardings: TrainState
    inner_step: Any  # `make_inner_step`'s jitted step
    outer: OuterSync | None  # blocking / tau-overlapped syncs (outer_overlap none)
    overlapped: OverlappedOuter | None  # delayed / eager whole-round exchanges
    ddp_step_bytes: int  # one float32 gradient: the denominator of every bandwidth claim
    ddp_step_wire_bytes: int


FIELDS = frozenset(f.name for f in dataclasses.fields(Programs))


def build_programs(d: "DiLoCo", params: PyTree, static: PyTree) -> Programs:
    """The `Programs` of `DiLoCo` `d` for models whose trainable part is shaped like `params`."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    separate = None
    if d.is_diloco and d.router_sync_period:
        separate = tuple(bool(f) for f in jax.tree.leaves(d.routers(abstract)))
    try:
        groups = () if not d.is_diloco else make_groups(
            abstract, layers=d.layers, num_fragments=d.num_fragments, fragment_pattern=d.fragment_pattern,
            separate=separate,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    build_kwargs = dict(
        num_replicas=d.num_replicas, groups=groups, inner_opt=d.inner_optimizer,
        outer_opt=d.outer_optimizer if d.is_diloco else None, error_feedback=d.error_feedback,
        outer_overlap=d.outer_overlap,
    )
    abstract_state = eqx.filter_eval_shape(lambda p: build_state(p, **build_kwargs, key=jax.random.key(0)), abstract)
    try:
        in_stack = stack_flags(abstract, d.layers)[0] if d.layers is not None else None
    except ValueError as e:
        raise ConfigError(str(e)) from None
    leaf_specs = resolve_specs(d.param_specs, eqx.combine(abstract, static), abstract, fsdp=d.fsdp, tensor=d.tensor,
                               in_stack=in_stack)
    sharded = d.fsdp * d.tensor > 1
    shardings = state_shardings(
        abstract_state, d.mesh, per_replica_anchors=d.outer_overlap == "eager", leaf_specs=leaf_specs if sharded else None,
        groups=groups, inner_opt=d.inner_optimizer, outer_opt=d.outer_optimizer if d.is_diloco else None,
        outer_state_memory=d.outer_state_memory,
    )
    # Per group, its values' specs (a fragment's slice of a leaf keeps the leaf's layout).
    value_specs = tuple([leaf_specs[j] for j in g.leaf_indices(abstract)] for g in groups) if sharded else None
    skip = d.on_nonfinite == "skip"
    inner_step = make_inner_step(d.mesh, d.inner_optimizer, d.loss_fn, static, ddp=not d.is_diloco, skip_nonfinite=skip,
                                 shardings=shardings)
    outer = overlapped = None
    # Syncs on the host's CPUs are copied there and dispatched by a thread of their own (see `_host`).
    handoff = HostHandoff() if d.sync_on_host else None
    if d.outer_overlap != "none":
        overlapped = OverlappedOuter(
            mesh=d.mesh, comm_mesh=d.comm_mesh, groups=groups, outer_opt=d.outer_optimizer, mode=d.outer_overlap,
            fmt=d.wire, exchange=d.exchange, skip_nonfinite=skip, error_feedback=d.error_feedback,
            error_feedback_decay=d.error_feedback_decay, shardings=shardings, num_replicas=d.num_replicas, value_specs=value_specs,
            compiler_options=d.sync_compiler_options, handoff=handoff,
        )
    elif d.is_diloco:
        outer = OuterSync(
            mesh=d.mesh, groups=groups, outer_opt=d.outer_optimizer, fmt=d.wire, alpha=d.alpha,
            skip_nonfinite=skip, error_feedback=d.error_feedback, error_feedback_decay=d.error_feedback_decay,
            shardings=shardings, comm_mesh=d.comm_mesh,
            exchange=d.exchange, num_replicas=d.num_replicas, value_specs=value_specs,
            compiler_options=d.sync_compiler_options, handoff=handoff,
        )
    all_shapes = [x.shape for x in jax.tree.leaves(abstract)]
    return Programs(
        signature=signature(params), leaf_specs=leaf_specs, value_specs=value_specs, groups=groups,
        # With its own sync period, the router group comes after the P fragments.
        router_group=d.num_fragments if separate is not None else None,
        static=static, build_kwargs=build_kwargs, abstract_state=abstract_state, shardings=shardings,
        inner_step=inner_step, outer=outer, overlapped=overlapped,
        ddp_step_bytes=sync_nbytes(all_shapes, "none") if d.num_replicas > 1 else 0,
        ddp_step_wire_bytes=sync_wire_nbytes(all_shapes, "none", d.num_replicas),
    )
