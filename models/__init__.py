"""Equinox language models whose repeated blocks live in one stacked module."""

from ._norm import RMSNorm
from .transformer import Attention, Block, MLP, Transformer, TransformerConfig

__all__ = ["Attention", "Block", "MLP", "RMSNorm", "Transformer", "TransformerConfig"]
