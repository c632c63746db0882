"""The language-model application on top of the `eqx_diloco` core.

Config dataclasses (the tyro CLI), the `Trainer` host loop, token data, metrics and
TensorBoard logs, the local launcher, export, sampling, plotting and tokenizing. The entry
points keep their short paths: `python -m eqx_diloco.train` (`.launch`, `.plot`, `.prepare`,
`.sample`, `.export`).
"""

import importlib

# Lazy like the core: the CLI reads its flags before JAX is imported.
_LAZY = {
    **dict.fromkeys(
        ["CheckpointConfig", "Config", "DataConfig", "DiLoCoConfig", "ElasticConfig", "MeshConfig", "TrainConfig",
         "validate"],
        ".config",
    ),
    "Trainer": ".trainer",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'eqx_diloco.lm' has no attribute {name!r}")


__all__ = sorted(_LAZY)
