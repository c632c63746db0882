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

import jax
import numpy as np
from jax.sharding import PartitionSpec

from ._errors import ConfigError

PyTree = Any
INNER_AXES = ("fsdp", "tensor")


def _axes_of(entry) -> tuple[str, ...]:
    """The mesh axes one entry of a PartitionSpec names (None, a name, or a tuple of names)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def fsdp_specs(
    params: PyTree, fsdp: int, *, in_stack: tuple[bool, ...] | None = None, base: PyTree | None = None
) -> PyTree:
    """The default rule: shard each leaf's largest dimension divisible by `fsdp` over `fsdp`.

    **Arguments:**

    - `params`: the model's trainable arrays (concrete or `jax.ShapeDtypeStruct`).
    - `fsdp`: the size of the `fsdp` mesh axis (1 gives every leaf `PartitionSpec()` or `base`).
    - `in_stack`: per leaf (flatten order), whether it is a stacked layer leaf, whose leading
      layer axis is never sharded (see `fragments.stack_flags`); None: no stack.
    - `base`: optional specs (a tree like `params`) to add `fsdp` to, e.g. a model's tensor rules;
      dimensions they already shard are left alone.

    A leaf none of whose free dimensions `fsdp` divides stays replicated over `fsdp` (norm
    scales of an odd width, scalars).
    """
    leaves, treedef = jax.tree.flatten(params)
    bases = [PartitionSpec()] * len(leaves) if base is None else flatten_specs(base, params, name="base")
    in_stack = in_stack or (False,) * len(leaves)
    out = []
    for x, spec, stacked in zip(leaves, bases, in_stack):
        entries = list(spec) + [None] * (len(x.shape) - len(spec))
        free = [i for i, n in enumerate(x.shape)
                if entries[i] is None and not (stacked and i == 0) and fsdp > 1 and n % fsdp == 0]
        if free:
            dim = max(free, key=lambda i: (x.shape[i], -i))  # the largest; the first of equals
            entries[dim] = "fsdp"
        while entries and entries[-1] is None:
            entries.pop()
        out.append(PartitionSpec(*entries))
    return jax.tree.unflatten(treedef, out)


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
        used: list[str] = []
        for dim, entry in enumerate(spec):
            axes = _axes_of(entry)
            for axis in axes:
                if axis not in INNER_AXES:
                    raise ConfigError(f"param_specs names axis {axis!r} for {path}; a replica's parameters shard "
                                      f"over {' and '.join(INNER_AXES)} only")
            used += axes
            if axes and stacked and dim == 0:
                raise ConfigError(f"param_specs shards the layer axis of {path}; fragments slice that axis, so it "
                                  f"stays whole (shard another dimension)")
            size = int(np.prod([sizes[a] for a in axes])) if axes else 1
            if shape[dim] % size:
                raise ConfigError(f"param_specs shards dimension {dim} of {path} (size {shape[dim]}) over "
                                  f"{'x'.join(axes)} = {size}, which does not divide it")
        if len(set(used)) != len(used):
            raise ConfigError(f"param_specs uses an axis twice in the spec of {path}: {spec}")


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
        specs = flatten_specs(fsdp_specs(params, fsdp, in_stack=in_stack), params)
    else:
        specs = flatten_specs(param_specs(abstract_model), params)
    check_specs(specs, params, {"fsdp": fsdp, "tensor": tensor}, in_stack)
    return tuple(specs)


def local_shape(shape: tuple[int, ...], spec: PartitionSpec, sizes: dict[str, int]) -> tuple[int, ...]:
    """The shape of one device's shard of an array of `shape` laid out by `spec`."""
    out = list(shape)
    for dim, entry in enumerate(spec):
        for axis in _axes_of(entry):
            out[dim] //= sizes[axis]
    return tuple(out)
