"""eqx_diloco: DiLoCo and Streaming DiLoCo for Equinox models in JAX.

Two tiers. The library core takes any Equinox model: `DiLoCo` (with `TrainState`,
`Checkpointer` and the building blocks below it). The command-line trainer for the bundled
language models is one client of it: `Config`, `Trainer`, `train`.
"""

from . import quantize, schedule
from ._diloco import DiLoCo, default_outer_optimizer
from ._errors import ConfigError, NonFiniteError
from .checkpoint import CheckpointError, Checkpointer
from .fragments import Fragmenter, layer_groups, stack_flags
from .groups import FragmentGroup, LeafGroup, ParamGroup, make_groups
from .mesh import build_meshes
from .outer import OuterSync, mean_outer_gradient
from .state import TrainState, build_state, state_shardings
from .step import make_inner_step

# The CLI trainer's layer (it imports the bundled models; the core above does not).
from .config import (  # noqa: E402
    CheckpointConfig,
    Config,
    DataConfig,
    DiLoCoConfig,
    MeshConfig,
    TrainConfig,
    validate,
)
from .trainer import Trainer, global_model, train  # noqa: E402

__all__ = [
    "CheckpointConfig",
    "CheckpointError",
    "Checkpointer",
    "Config",
    "ConfigError",
    "DataConfig",
    "DiLoCo",
    "DiLoCoConfig",
    "FragmentGroup",
    "Fragmenter",
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
