"""Attention and recurrence kernels for tree-shaped batches. Imports nothing from `jtree`."""

from jtree.kernels.tree_attention import available_impls, tree_attention

__all__ = ["available_impls", "tree_attention"]
