"""eqx_diloco: DiLoCo and Streaming DiLoCo for Equinox models in JAX.

Two tiers. The library core takes any Equinox model: `DiLoCo` (with `TrainState`,
`Checkpointer` and the building blocks below it). The command-line trainer for the bundled
language models is one client of it: `Config`, `Trainer`, `train`.
"""

import importlib

# Everything loads on first use (`eqx_diloco.DiLoCo` imports JAX then), so `python -m
# eqx_diloco.train` can check its flags and describe the run before JAX starts. The CLI layer
# (Config, Trainer, train) also imports the bundled models; the core does not.
_LAZY = {
    **dict.fromkeys(["DiLoCo", "default_outer_optimizer"], "._diloco"),
    "IslandSnapshots": "._elastic",
    **dict.fromkeys(["ConfigError", "NonFiniteError"], "._errors"),
    **dict.fromkeys(["CheckpointError", "Checkpointer"], ".checkpoint"),
    **dict.fromkeys(["Fragmenter", "layer_groups", "stack_flags"], ".fragments"),
    **dict.fromkeys(["FragmentGroup", "LeafGroup", "ParamGroup", "make_groups"], ".groups"),
    "build_meshes": ".mesh",
    **dict.fromkeys(["OuterSync", "mean_outer_gradient"], ".outer"),
    **dict.fromkeys(["TrainState", "build_state", "state_shardings"], ".state"),
    "make_inner_step": ".step",
    **dict.fromkeys(
        ["CheckpointConfig", "Config", "DataConfig", "DiLoCoConfig", "ElasticConfig", "MeshConfig", "TrainConfig",
         "validate"],
        ".config",
    ),
    **dict.fromkeys(["Trainer", "global_model", "train"], ".trainer"),
}
_SUBMODULES = ("quantize", "schedule")


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'eqx_diloco' has no attribute {name!r}")


__all__ = [
    "CheckpointConfig",
    "CheckpointError",
    "Checkpointer",
    "Config",
    "ConfigError",
    "DataConfig",
    "DiLoCo",
    "DiLoCoConfig",
    "ElasticConfig",
    "FragmentGroup",
    "Fragmenter",
    "IslandSnapshots",
    "LeafGroup",
    "MeshConfig",
    "NonFiniteError",
    "OuterSync",
    "ParamGroup",
    "TrainConfig",
    "TrainState",
    "Trainer",
    "build_meshes",
    "build_state",
    "default_outer_optimizer",
    "global_model",
    "layer_groups",
    "make_groups",
    "make_inner_step",
    "mean_outer_gradient",
    "quantize",
    "schedule",
    "stack_flags",
    "state_shardings",
    "train",
    "validate",
]
