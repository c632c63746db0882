"""Compiling the outer syncs' programs before their first use.

A program's first call compiles it (or loads it from the persistent cache). For the step
that is the start of training, which everyone waits for anyway. A sync's programs first run
one round (or tau steps) in: compiled there, they stall the host while the devices run dry,
and in a multi-process run every other process waits at the collective for this one, so
the stall lands mid-run, after the warm-up. `jit(f).lower(...).compile()` fills the cache
that the later call `f(...)` uses, so these functions compile them where waiting is free.

Across processes, a sync's first collective also waits for every process to finish its
start-up (the first step's program loaded included), and connects them (gloo opens its TCP
pairs): `connect_sync_processes`, run once step 1 is dispatched, does both, so the first sync
costs what the others do.
"""

import weakref
from typing import TYPE_CHECKING, Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._state import TrainState

if TYPE_CHECKING:
    from ._diloco import DiLoCo

_compiled_ahead: "weakref.WeakSet[Callable]" = weakref.WeakSet()  # install programs compiled by the function below


def _abstract(shapes: Any, shardings: Any, mesh: Mesh | None = None) -> Any:
    """`shapes` (leaves with shape, dtype, weak_type) as ShapeDtypeStructs laid out as `shardings` (their
    specs on `mesh`, if given); a weak leaf stays weak, or it would be another program."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s if mesh is None else NamedSharding(mesh, s.spec),
                                          weak_type=x.weak_type),
        shapes, shardings)


def abstract_like(tree: Any) -> Any:
    """`tree`'s arrays as ShapeDtypeStructs with their shardings: what compiling a program for them needs,
    kept where the arrays themselves may be donated (deleted) before the compile runs."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding,
                                                       weak_type=x.aval.weak_type), tree)


def compile_install_ahead(install: Callable, state: TrainState, arriving: tuple, mesh: Mesh) -> None:
    """Compile the jitted `install(state, *arriving)` now (once), for values that will arrive on `mesh`.

    A launched exchange is installed tau steps (or a whole round) later; its launch is a
    first-call compile point anyway, so the install is compiled with it.
    """
    if install in _compiled_ahead:  # one program per group and object: its shapes never change
        return
    arrived = _abstract(arriving, jax.tree.map(lambda x: x.sharding, arriving), mesh)
    install.lower(state, *arrived).compile()
    _compiled_ahead.add(install)


def compile_outer_ahead(diloco: "DiLoCo", state: TrainState) -> None:
    """Compile every parameter group's sync programs for `state` now (see `DiLoCo.compile_outer_ahead`).

    tau = 0 (and the router group): one `sync_and_merge` program. tau > 0: the fragment's
    extract, launch (on the communication mesh, if any), install and merge. Outer steps
    overlapped with `outer_overlap` delayed / eager compile at their first use.
    """
    if not diloco.is_diloco or diloco.overlapped is not None:
        return
    outer = diloco.outer
    for group in diloco._sync_groups:
        fns = {name: table[group.index] for name, table in outer._fns.items()}
        if diloco.overlap_steps == 0 or group.index == diloco.router_group:
            fns["sync_and_merge"].lower(state).compile()
            continue
        fns["merge"].lower(state).compile()
        extracted = fns["extract"].lower(state).compile().output_shardings
        inputs = _abstract(jax.eval_shape(fns["extract"], state), extracted, outer.comm_mesh or outer.mesh)
        launched = fns["launch"].lower(*inputs).compile().output_shardings
        global_values, outer_state, _, residuals = _abstract(jax.eval_shape(fns["launch"], *inputs), launched)
        compile_install_ahead(fns["install"], state, (global_values, outer_state, residuals), outer.mesh)


def connect_sync_processes(meshes: list[Mesh | None], compiler_options: dict[str, Any] | None = None) -> None:
    """In a run of several processes, one psum of an int32 per device over `diloco` on each of `meshes`
    (None: skipped), waited for: the syncs' own device groups, so their processes are connected, and
    leave here together (on the compute mesh the psum runs after the steps dispatched before it).
    Without it the first sync pays for both: the processes reach it as each finished its start-up
    (tens of milliseconds apart; the faster waits), and gloo connects there."""
    if jax.process_count() == 1:
        return
    for mesh in {id(m): m for m in meshes if m is not None}.values():
        jax.block_until_ready(_count_over_diloco(mesh, compiler_options))


def _count_over_diloco(mesh: Mesh, compiler_options: dict[str, Any] | None) -> jax.Array:
    """On every device of `mesh`, the number of devices on its `diloco` axis (a psum of ones)."""
    spec, block = PartitionSpec(*mesh.axis_names), np.ones((1,) * mesh.devices.ndim, np.int32)
    ones = jax.make_array_from_callback(mesh.devices.shape, NamedSharding(mesh, spec), lambda index: block)
    psum = jax.shard_map(lambda x: jax.lax.psum(x, "diloco"), mesh=mesh, in_specs=spec, out_specs=spec)
    return jax.jit(psum, compiler_options=compiler_options)(ones)
