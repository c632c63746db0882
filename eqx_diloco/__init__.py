"""eqx_diloco: DiLoCo and Streaming DiLoCo for Equinox models in JAX."""

from . import quantize, schedule
from .config import (
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    DiLoCoConfig,
    MeshConfig,
    TrainConfig,
    validate,
)
from .fragments import Fragmenter, layer_groups
from .groups import FragmentGroup, LeafGroup, ParamGroup, make_groups
from .outer import OuterSync, mean_outer_gradient
from .state import TrainState, build_state, init_state, state_shardings
from .step import make_inner_step
from .trainer import NonFiniteError, Trainer, global_model, train

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DiLoCoConfig",
    "FragmentGroup",
    "Fragmenter",
    "LeafGroup",
    "ParamGroup",
    "MeshConfig",
    "NonFiniteError",
    "OuterSync",
    "TrainConfig",
    "TrainState",
    "Trainer",
    "build_state",
    "global_model",
    "init_state",
    "layer_groups",
    "make_groups",
    "make_inner_step",
    "mean_outer_gradient",
    "quantize",
    "schedule",
    "state_shardings",
    "train",
    "validate",
]
