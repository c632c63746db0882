"""eqx_diloco: DiLoCo and Streaming DiLoCo for Equinox models in JAX.

Two tiers. The library core takes any Equinox model: `DiLoCo` (with `TrainState`,
`Checkpointer` and the building blocks below it). The command-line trainer for the bundled
language models is one client of it: `Config`, `Trainer`, `train`.
"""

import importlib

from . import quantize, schedule
from ._diloco import DiLoCo, default_outer_optimizer
from ._elastic import IslandSnapshots
from ._errors import ConfigError, NonFiniteError
from .checkpoint import CheckpointError, Checkpointer
from .fragments import Fragmenter, layer_groups, stack_flags
from .groups import FragmentGroup, LeafGroup, ParamGroup, make_groups
from .mesh import build_meshes
from .outer import OuterSync, mean_outer_gradient
from .state import TrainState, build_state, state_shardings
from .step import make_inner_step

# The CLI trainer's layer imports the bundled models; the core above does not, so it is
# loaded on first use (`eqx_diloco.Trainer`), and `import eqx_diloco` stays model-free.
_CLI_LAYER = {
    **dict.fromkeys(
        ["CheckpointConfig", "Config", "DataConfig", "DiLoCoConfig", "ElasticConfig", "MeshConfig", "TrainConfig",
         "validate"],
        ".config",
    ),
    **dict.fromkeys(["Trainer", "global_model", "train"], ".trainer"),
}


def __getattr__(name: str):
    if name in _CLI_LAYER:
        return getattr(importlib.import_module(_CLI_LAYER[name], __name__), name)
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
