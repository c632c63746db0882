"""Fit before the first step: on an accelerator, the inner step is compiled on abstract inputs and its
memory (`memory_analysis()`: arguments, outputs and temporaries per device) compared with the device's.
The flags as given if they fit; else `--model.remat block` over a rolled stack; else a one-line error saying
what would fit."""

import dataclasses
import math
import re
from typing import TYPE_CHECKING

import equinox as eqx
import jax
from jax.sharding import NamedSharding

from models import Transformer

from .._errors import ConfigError
from .._mesh import BATCH_SPEC
from ._banner import format_bytes

if TYPE_CHECKING:
    from .config import Config


LEAN_FLAGS = "--model.remat block --model.scan-unroll 1"  # what `least_memory` sets


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """One compiled inner step's memory per device: `state` (its arguments: the train state and the
    batch), `temporaries`, and `total` (arguments, outputs not aliased to them, temporaries), with the
    replicas `per_device` that share a device."""

    state: int
    temporaries: int
    total: int
    per_device: int


def step_memory(config: "Config", *, compile=lambda lowered: lowered.compile()) -> StepMemory:
    """Compile `config`'s inner step on abstract inputs (nothing is allocated) and read its memory.

    A compiler that refuses a program larger than the device (XLA:TPU does, at compile time) gives its
    figure for the temporaries instead (`refused_temporaries`). `compile` is the seam tests use."""
    from ._core import make_diloco

    abstract_model = eqx.filter_eval_shape(Transformer, config.model, key=jax.random.key(0))
    core = make_diloco(config, abstract_model)
    t = config.train
    # Laid out as the trainer places them, so the compiled program is the one that will run.
    state = jax.tree.map(lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                         core.abstract_state, core.shardings)
    batch = jax.ShapeDtypeStruct((config.diloco.num_replicas, t.batch_size, t.seq_len + 1), "int32",
                                 sharding=NamedSharding(core.mesh, BATCH_SPEC))
    per_device = config.diloco.num_replicas // core.mesh.shape["diloco"]
    try:
        analysis = compile(core.inner_step.lower(state, batch)).memory_analysis()
    except jax.errors.JaxRuntimeError as e:
        temporaries = refused_temporaries(e)
        if temporaries is None:
            raise
        arguments = sum(_bytes_per_device(x) for x in jax.tree.leaves((state, batch)))
        return StepMemory(arguments, temporaries, arguments + temporaries, per_device)
    outputs = analysis.output_size_in_bytes - analysis.alias_size_in_bytes
    total = analysis.argument_size_in_bytes + outputs + analysis.temp_size_in_bytes
    return StepMemory(analysis.argument_size_in_bytes, analysis.temp_size_in_bytes, total, per_device)


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def refused_temporaries(error: Exception) -> int | None:
    """The temporaries, in bytes, of a program the compiler refused as larger than the device, read from
    its message (XLA:TPU: "RESOURCE_EXHAUSTED: ... memory required for HLO temporaries (29.98G) exceeds
    available HBM (15.75G)"), or None for any other error."""
    text = str(error)
    found = re.search(r"temporaries \(([0-9.]+)([KMGT]?)\)", text)
    if "RESOURCE_EXHAUSTED" not in text or found is None:
        return None
    return int(float(found.group(1)) * _UNITS[found.group(2)])


def _bytes_per_device(x: jax.ShapeDtypeStruct) -> int:
    return math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Fit:
    """The config to train with (`--model.remat` may have changed) and the banner's line about it (None
    where nothing was checked: CPU)."""

    config: "Config"
    line: str | None


def fit_on_device(config: "Config", device_memory: int | None, platform: str,
                  measure=step_memory) -> Fit:
    """Check `config`'s inner step against `device_memory` bytes per device (None: no check, as on CPU).

    Returns the config as given if its step fits, else `least_memory(config)` if that fits; raises
    `ConfigError` with what would fit otherwise. `measure`
    is `step_memory` (a test may count its calls)."""
    if device_memory is None:
        return Fit(config, None)
    need = measure(config)
    of = f"of {format_bytes(device_memory)} per {platform} device"
    if need.total <= device_memory:
        return Fit(config, f"  memory       the step needs {format_bytes(need.total)} {of}: fits with "
                           f"--model.remat {config.model.remat}")
    lean = least_memory(config)
    if lean is not config:
        need_lean = measure(lean)
        if need_lean.total <= device_memory:
            return Fit(lean, f"  memory       {LEAN_FLAGS}: the step needs {format_bytes(need_lean.total)} {of} "
                             f"(as given: {format_bytes(need.total)})")
        need = need_lean
    raise ConfigError(does_not_fit(config, need, device_memory, platform))


def least_memory(config: "Config") -> "Config":
    """`config` with `--model.remat block` and a rolled layer stack (`--model.scan-unroll 1`): only each
    block's input is kept for the backward pass. Both: unrolled, XLA merges the recomputation with the
    forward pass, and the step kept every activation (in a CPU compile its temporaries did not move)."""
    m = config.model
    if m.remat == "block" and m.layers_per_iteration() == 1:
        return config
    return dataclasses.replace(config, model=dataclasses.replace(m, remat="block", scan_unroll=1))


def does_not_fit(config: "Config", need: StepMemory, device_memory: int, platform: str) -> str:
    """The one line for a step that does not fit even with `--model.remat block`: what would, with numbers.

    Scaling estimates: the state and temporaries of a device shrink as 1/fsdp and with the replicas
    sharing it; temporaries grow with the batch."""
    m, t = config.mesh, config.train
    ratio = need.total / device_memory
    options = [f"--mesh.fsdp {math.ceil(m.fsdp * ratio)} (devices per island; now {m.fsdp})"]
    if need.per_device > 1:
        K = max(1, math.floor(need.per_device / ratio))
        options.append(f"--mesh.replicas-per-device {K} (now {need.per_device}, so more devices)")
    split = m.data * m.fsdp
    room = device_memory - need.state
    if room > 0 and need.temporaries > 0:
        batch = math.floor(t.batch_size * room / need.temporaries) // split * split
        if batch >= split:
            options.append(f"--train.batch-size {batch} (now {t.batch_size})")
    return (f"the inner step needs {format_bytes(need.total)} per {platform} device with {LEAN_FLAGS} "
            f"(train state and batch {format_bytes(need.state)}, temporaries {format_bytes(need.temporaries)}), "
            f"{format_bytes(device_memory)} available; would fit about: {', or '.join(options)}")
