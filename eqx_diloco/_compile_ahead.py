"""Compiling the outer syncs' programs before their first use.

A program's first call compiles it (or loads it from the persistent cache). For the step
that is the start of training, which everyone waits for anyway. A sync's programs first run
one round (or tau steps) in: compiled there, they stall the host while the devices run dry,
and in a multi-process run every other process waits at the collective for this one, so
the stall lands mid-run, after the warm-up. `jit(f).lower(...).compile()` fills the cache
that the later call `f(...)` uses, so these functions compile them where waiting is free.
"""

import weakref
from typing import TYPE_CHECKING, Any, Callable

import jax
from jax.sharding import Mesh, NamedSharding

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
