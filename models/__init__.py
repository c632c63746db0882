"""Equinox language models whose repeated blocks live in one stacked module.

`TransformerConfig` is plain Python; the modules load on first use, so reading a config (the
CLI does, before it starts JAX) does not import JAX.
"""

import importlib

from ._config import TransformerConfig

_LAZY = {"RMSNorm": "._norm", **dict.fromkeys(["Attention", "Block", "MLP", "SwiGLU", "Transformer"], ".transformer")}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")


__all__ = ["Attention", "Block", "MLP", "RMSNorm", "SwiGLU", "Transformer", "TransformerConfig"]
