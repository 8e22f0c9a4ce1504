"""The per-branch baseline: every path trained as its own sequence, sequence-packed.

Each path becomes a one-node tree, so the baseline runs through exactly the same linearization,
model and kernels as tree mode; its `end` array is the ordinary packed-causal (segment) mask. This
is the reference for every equivalence test and every speedup figure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jtree.layout.linearize import TreeBatch, linearize, unlinearize
from jtree.trees.tree import TrajectoryTree


def flatten_paths(trees: Sequence[TrajectoryTree]) -> list[TrajectoryTree]:
    """One single-path tree per path, in order (tree 0's paths first)."""
    return [t.path_as_tree(p) for t in trees for p in range(t.n_paths)]


def linearize_baseline(trees: Sequence[TrajectoryTree], seq_len: int, **options: Any
                       ) -> TreeBatch:
    """Pack the paths of `trees` as separate sequences (`options`: `RowOptions`' fields, as for
    `linearize`)."""
    for i, t in enumerate(trees):
        longest = int(t.path_lengths.max())
        if longest > seq_len:
            raise ValueError(f"tree {i}: a path of {longest} tokens exceeds seq_len={seq_len}")
    return linearize(flatten_paths(trees), seq_len, **options)


def unlinearize_baseline(
    batch: TreeBatch, per_token_values: np.ndarray, trees: Sequence[TrajectoryTree]
) -> list[list[np.ndarray]]:
    """Like `unlinearize`, regrouped per original tree: result[k][p] is path p of trees[k]."""
    per_path = [paths[0] for paths in unlinearize(batch, per_token_values)]
    out, i = [], 0
    for t in trees:
        out.append(per_path[i : i + t.n_paths])
        i += t.n_paths
    return out
