"""What a replica sends: a model's values as chunks (layer, values) grouped by fragment,
for the paper's 1B/10B/100B models or a real `models.TransformerConfig`."""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

# Parameter counts behind the paper's names.
PAPER_PARAMS = {"1B": 1e9, "10B": 1e10, "100B": 1e11}
PAPER_MODELS = {  # layers, step time (FLOPs at 60% MFU) and fragments of the Streaming DiLoCo paper's Table 4
    "1B": {"layers": 24, "step_s": 0.1, "fragments": 8},
    "10B": {"layers": 48, "step_s": 0.8, "fragments": 16},
    "100B": {"layers": 108, "step_s": 4.9, "fragments": 36},
}


@dataclasses.dataclass(frozen=True)
class ModelComm:
    """What a replica sends, as chunks `(layer or None, values)` grouped by fragment.

    `layer` is the chunk's index in the layer stack (None: outside the stack); it only
    matters for `backward_fraction > 0`. DDP and DiLoCo send every chunk at once.
    """

    name: str
    num_layers: int
    fragments: tuple[tuple[tuple[int | None, float], ...], ...]

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    @property
    def values(self) -> float:
        return sum(v for frag in self.fragments for _, v in frag)

    def fragment_values(self) -> list[float]:
        return [sum(v for _, v in frag) for frag in self.fragments]


def paper_model(
    name: str, params: float | None = None, layers: int | None = None, fragments: int | None = None
) -> ModelComm:
    """A paper-style model: `params` values spread evenly over `layers`, strided layer fragments."""
    spec = PAPER_MODELS.get(name, {})
    params = PAPER_PARAMS[name] if params is None else params
    layers = spec["layers"] if layers is None else layers
    fragments = spec["fragments"] if fragments is None else fragments
    if layers % fragments:
        raise ValueError(f"layers={layers} is not divisible by fragments={fragments}")
    per_layer = params / layers
    return ModelComm(
        name, layers, tuple(tuple((l, per_layer) for l in range(f, layers, fragments)) for f in range(fragments))
    )


def real_model(
    config, num_fragments: int, pattern: Literal["strided", "sequential"] = "strided", name: str = "local"
) -> ModelComm:
    """Exact per-fragment values of a `models.TransformerConfig`, from an abstract model (no FLOPs, no memory)."""
    import equinox as eqx
    import jax

    import models
    from eqx_diloco._fragments import Fragmenter

    abstract = eqx.filter_eval_shape(models.Transformer, config, key=jax.random.key(0))
    itemsizes = {np.dtype(x.dtype).itemsize for x in jax.tree.leaves(abstract)}
    if len(itemsizes) != 1:
        raise ValueError(f"params of mixed dtype sizes {sorted(itemsizes)}: cannot count values from bytes")
    itemsize = itemsizes.pop()
    frag = Fragmenter.for_model(abstract, lambda m: m.blocks, num_fragments, pattern)
    chunks = []
    for f in range(num_fragments):
        values = frag.nbytes(abstract, f) / itemsize
        layers = frag.layers(f)
        if layers is None:
            chunks.append(((None, values),))
        else:
            chunks.append(tuple((int(l), values / len(layers)) for l in layers))
    total = Fragmenter(config.num_layers, 1, pattern).nbytes(abstract, 0) / itemsize
    comm = ModelComm(name, config.num_layers, tuple(chunks))
    assert abs(comm.values - total) < 0.5, (comm.values, total)
    return comm
