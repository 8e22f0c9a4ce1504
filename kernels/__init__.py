"""Attention and recurrence kernels for tree-shaped batches. Imports nothing from `jtree`."""

from jtree.kernels.tree_attention import available_impls, tree_attention
from jtree.kernels.tree_mask import TreeMask

__all__ = ["TreeMask", "available_impls", "tree_attention"]
