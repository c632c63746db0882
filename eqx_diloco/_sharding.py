"""Where each parameter lives inside a replica: PartitionSpecs over the inner mesh axes.

A replica (an island) may span `fsdp x tensor` devices (times `data`, over which
parameters are replicated). Each parameter leaf gets one `PartitionSpec` over the inner
axes `fsdp` and `tensor`, written for the leaf as the model holds it (no replica axis).
Every array of the train state that mirrors a parameter (the replicas, the inner optimizer
moments, theta_g, the outer optimizer state, the error-feedback residuals and mailboxes)
follows that spec; the state's replica axis adds `diloco` in front.

The layer axis of a stacked leaf is never sharded: Streaming DiLoCo's fragments are slices
of it, and slicing an unsharded axis keeps every device's slice local.

The default rule is FSDP (`fsdp_specs`): each leaf's largest dimension that `fsdp`
divides is sharded over `fsdp`. Tensor parallelism needs the model's own rules (which
dimensions are heads, which the MLP's hidden units): `param_specs=` brings them.
"""

from typing import Any, Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec
from jaxtyping import Array, Bool

from ._errors import ConfigError
from ._fragments import stack_flags
from ._mesh import INNER

PyTree = Any
INNER_AXES = ("fsdp", "tensor")


def axes_of(entry) -> tuple[str, ...]:
    """The mesh axes one entry of a PartitionSpec names (None, a name, or a tuple of names)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _trainable(x) -> bool:
    if isinstance(x, jax.ShapeDtypeStruct):
        return jnp.issubdtype(x.dtype, jnp.inexact)
    return eqx.is_inexact_array(x)


def _fsdp_rule(leaves: list, fsdp: int, in_stack: tuple[bool, ...], bases: list[PartitionSpec],
               tensor: int = 1) -> list[PartitionSpec]:
    out = []
    for x, spec, stacked in zip(leaves, bases, in_stack):
        entries = list(spec) + [None] * (len(x.shape) - len(spec))
        named = {a for e in entries for a in axes_of(e)}
        # An array the tensor rules leave whole is spread over the tensor devices too, so no
        # device of the island holds (or sends) more than its share of it.
        options = [(("fsdp", "tensor"), fsdp * tensor)] if tensor > 1 and "tensor" not in named else []
        options.append((("fsdp",), fsdp))
        for axes, size in options:
            free = [i for i, n in enumerate(x.shape)
                    if entries[i] is None and not (stacked and i == 0) and size > 1 and n % size == 0]
            if free:
                dim = max(free, key=lambda i: (x.shape[i], -i))  # the largest; the first of equals
                entries[dim] = axes if len(axes) > 1 else axes[0]
                break
        while entries and entries[-1] is None:
            entries.pop()
        out.append(PartitionSpec(*entries))
    return out


def fsdp_specs(
    model: PyTree, fsdp: int, *, layers: Callable[[PyTree], Any] | None = None, base: PyTree | None = None,
    tensor: int = 1,
) -> PyTree:
    """The default rule: shard each array's largest dimension divisible by `fsdp` over `fsdp`.

    **Arguments:**

    - `model`: the model, or its trainable arrays (concrete or `jax.ShapeDtypeStruct` leaves).
    - `fsdp`: the size of the `fsdp` mesh axis (1 gives every array `PartitionSpec()`, or `base`).
    - `layers`: the selector of the model's layer stack (as for `DiLoCo`), whose leading layer
      axis is never sharded; None: no stack.
    - `base`: optional specs (a tree like the model's arrays) to add `fsdp` to, e.g. a model's
      tensor rules (`Transformer.tensor_specs()`); dimensions they already shard are left alone.
    - `tensor`: the size of the `tensor` axis. Arrays that `base` does not shard over `tensor`
      (embeddings, norms) are then sharded over `fsdp x tensor` where that product divides a
      dimension, so no device holds or sends more than its share of them.

    **Returns:** a tree like `eqx.filter(model, trainable)` with a PartitionSpec per array; pass
    `param_specs=lambda m: fsdp_specs(m, N, layers=..., base=...)` to `DiLoCo`. An array none of
    whose free dimensions `fsdp` divides stays replicated over `fsdp` (an odd-width norm scale).
    """
    params = eqx.filter(model, _trainable)
    leaves, treedef = jax.tree.flatten(params)
    try:
        in_stack = stack_flags(params, layers)[0]
    except ValueError as e:
        raise ConfigError(str(e)) from None
    bases = [PartitionSpec()] * len(leaves) if base is None else flatten_specs(base, params, name="base")
    return jax.tree.unflatten(treedef, _fsdp_rule(leaves, fsdp, in_stack, bases, tensor))


def flatten_specs(specs: PyTree, params: PyTree, *, name: str = "param_specs") -> list[PartitionSpec]:
    """One PartitionSpec per leaf of `params` (flatten order), read from `specs`, a tree shaped like
    `params` with a PartitionSpec (or None: replicated) where `params` has an array."""
    treedef = jax.tree.structure(params)
    try:
        per_leaf = treedef.flatten_up_to(specs)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{name} must return a tree shaped like the model's arrays, with a PartitionSpec "
                          f"per array ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    out = []
    for spec in per_leaf:
        if spec is None:
            spec = PartitionSpec()
        if not isinstance(spec, PartitionSpec):
            raise ConfigError(f"{name} must give a PartitionSpec or None per array (got {type(spec).__name__})")
        out.append(spec)
    return out


def check_specs(
    specs: list[PartitionSpec], params: PyTree, sizes: dict[str, int], in_stack: tuple[bool, ...] | None
) -> None:
    """Raise `ConfigError` naming the leaf for a spec that cannot lay out its leaf on the inner axes.

    `sizes` maps each inner axis to its mesh size.
    """
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    in_stack = in_stack or (False,) * len(paths)
    for path, x, spec, stacked in zip(paths, jax.tree.leaves(params), specs, in_stack):
        shape = tuple(x.shape)
        if len(spec) > len(shape):
            raise ConfigError(f"param_specs gives {path} (shape {shape}) a spec of {len(spec)} dimensions: {spec}")
        used = [a for entry in spec for a in axes_of(entry)]
        for axis in used:
            if axis not in INNER_AXES:
                raise ConfigError(f"param_specs names axis {axis!r} for {path}; a replica's parameters shard "
                                  f"over {' and '.join(INNER_AXES)} only")
        if len(set(used)) != len(used):
            raise ConfigError(f"param_specs uses an axis twice in the spec of {path}: {spec}")
        for dim, entry in enumerate(spec):
            axes = axes_of(entry)
            if axes and stacked and dim == 0:
                raise ConfigError(f"param_specs shards the layer axis of {path}; fragments slice that axis, so it "
                                  f"stays whole (shard another dimension)")
            size = int(np.prod([sizes[a] for a in axes])) if axes else 1
            if shape[dim] % size:
                raise ConfigError(f"param_specs shards dimension {dim} of {path} (size {shape[dim]}) over "
                                  f"{'x'.join(axes)} = {size}, which does not divide it")


def resolve_specs(
    param_specs: Callable[[PyTree], PyTree] | None,
    abstract_model: PyTree,
    params: PyTree,
    *,
    fsdp: int,
    tensor: int,
    in_stack: tuple[bool, ...] | None,
) -> tuple[PartitionSpec, ...]:
    """Each trainable leaf's spec (flatten order): `param_specs(abstract_model)`, or the FSDP rule.

    Raises `ConfigError` for `tensor > 1` without `param_specs` (the default rule knows no heads)
    and for specs that do not fit (see `check_specs`).
    """
    if param_specs is None:
        if tensor > 1:
            raise ConfigError(f"tensor={tensor} needs param_specs= (tensor-parallel rules for this model: which "
                              f"dimensions are heads or hidden units); the default rule is FSDP only")
        leaves = jax.tree.leaves(params)
        specs = _fsdp_rule(leaves, fsdp, in_stack or (False,) * len(leaves), [PartitionSpec()] * len(leaves))
    else:
        specs = flatten_specs(param_specs(abstract_model), params)
    check_specs(specs, params, {"fsdp": fsdp, "tensor": tensor}, in_stack)
    return tuple(specs)


def local_shape(shape: tuple[int, ...], spec: PartitionSpec, sizes: dict[str, int]) -> tuple[int, ...]:
    """The shape of one device's shard of an array of `shape` laid out by `spec`."""
    out = list(shape)
    for dim, entry in enumerate(spec):
        for axis in axes_of(entry):
            out[dim] //= sizes[axis]
    return tuple(out)


# -- inside the outer sync (a shard_map manual over every axis) ------------------------------

def value_specs_in(specs: list[PartitionSpec] | None, per_replica: bool) -> list[PartitionSpec] | PartitionSpec:
    """shard_map specs of a group's values laid out by `specs` (their specs over the inner axes;
    None: replicated inside a replica), with the leading replica axis over `diloco` if `per_replica`."""
    head = ("diloco",) if per_replica else ()
    if specs is None:
        return PartitionSpec(*head)
    return [PartitionSpec(*head, *s) for s in specs]


def sharded_axes(specs: list[PartitionSpec] | None) -> tuple[str, ...]:
    """The inner mesh axes some of `specs` shard over (those a replica's shards differ along)."""
    named = {a for s in specs or () for entry in s if entry is not None
             for a in (entry if isinstance(entry, tuple) else (entry,))}
    return tuple(a for a in INNER if a in named)


def payload_parts(specs: list[PartitionSpec] | None, count: int) -> list[list[int]]:
    """The group's values cut into payloads by the inner axes they are sharded over.

    A quantized sync sends each part as one flat payload. Values laid out alike go together,
    so a payload (and its scales) is one device's own shard of each: a value replicated
    inside a replica (a norm scale) travels in its own payload, which every device of the
    replica computes alike, instead of sharing quantization blocks with sharded values.
    """
    if specs is None:
        return [list(range(count))]
    parts: dict[tuple[str, ...], list[int]] = {}
    for i, spec in enumerate(specs):
        parts.setdefault(sharded_axes([spec]), []).append(i)
    return list(parts.values())


def per_payload(specs: list[PartitionSpec] | None, values: list, fn: Callable[[list], tuple]) -> tuple[list, ...]:
    """`fn` on each payload part of `values` (see `payload_parts`); its results back in `values` order.

    `fn(part_values)` returns a tuple of lists (one entry per value of the part) or of None;
    each becomes one list over all of `values` (None where `fn` gave None).
    """
    outs: list[list] | None = None
    for part in payload_parts(specs, len(values)):
        results = fn([values[i] for i in part])
        if outs is None:
            outs = [[None] * len(values) for _ in results]
        for out, result in zip(outs, results):
            for j, i in enumerate(part):
                out[i] = None if result is None else result[j]
    return tuple(outs or ())


def all_rows_finite(finite: Bool[Array, " K"], axes: tuple[str, ...]) -> Bool[Array, " K"]:
    """Inside a shard_map manual over every axis: (K,) flags true only where every device of the
    replica (each holding its own shard, differing along `axes`) found its shard finite."""
    return jax.lax.psum((~finite).astype(jnp.int32), axes) == 0 if axes else finite
