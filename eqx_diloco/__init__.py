"""eqx_diloco: DiLoCo and Streaming DiLoCo for Equinox models in JAX.

Two tiers. This package is the library core: `DiLoCo` takes any Equinox model, a loss and
optax optimizers, and owns the whole training lifecycle (`init`, `step`, `finish`,
`global_model`, `save`/`restore`). `eqx_diloco.lm` is the application built on it: the
command-line trainer for the bundled language models (`python -m eqx_diloco.train`).
The core never imports the application tier.
"""

import importlib

# Names load on first use (`eqx_diloco.DiLoCo` imports JAX then), so `python -m
# eqx_diloco.train` can check its flags and describe the run before JAX starts.
_LAZY = {
    **dict.fromkeys(["DiLoCo", "default_outer_optimizer"], "._diloco"),
    "IslandSnapshots": "._elastic",
    **dict.fromkeys(["ConfigError", "NonFiniteError"], "._errors"),
    **dict.fromkeys(["CheckpointError", "Checkpointer"], "._checkpoint"),
    "use_cpu_devices": "._mesh",
    "fsdp_specs": "._sharding",
    "TrainState": "._state",
}
_SUBMODULES = ("decoupled", "quantize", "schedule")


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'eqx_diloco' has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "Checkpointer",
    "ConfigError",
    "DiLoCo",
    "IslandSnapshots",
    "NonFiniteError",
    "TrainState",
    "decoupled",
    "default_outer_optimizer",
    "fsdp_specs",
    "quantize",
    "schedule",
    "use_cpu_devices",
]
