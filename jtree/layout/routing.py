"""Routing replay on trees: per-path routed experts folded onto tree tokens (docs/rl.md,
"Routing replay").

A tree token is shared by every path through it, but it is computed once, so it has one routing.
Paths that pass through it may carry different engine routings for it (a rollout whose prompt
repeats another rollout's output: that output's tokens are routed once as generated, once as
prefill, and engines route a token differently in the two, or nondeterministically across
batches). The rule: a token takes the routing of the first path in path order that gives one
(not -1), the rule the old log-probs follow (`TrajectoryTree.tree_token_values`,
`jtree.trees.traces`), so a token's replayed routing and its behavior log-prob come from the same
rollout; a token no path gives stays -1 (the trainer's own routing). The tokens where two paths
give different expert sets are counted (`routing_disagreements`) and reported, never silently
averaged: exactness against per-path training holds for the paths whose routing was taken, and
the count says how many tokens of the others were routed by another path's choice. Splitting the
node instead would give up the shared prefix (the point of tree training) for every disagreement,
and disagreements concentrate on long shared prompts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jtree.trees.tree import TrajectoryTree


def tree_routing(tree: TrajectoryTree, per_path: Sequence[np.ndarray]) -> tuple[np.ndarray, int]:
    """Per-path routed experts (`per_path[p]` [len(path p), L, k], -1 rows: none) -> the tree
    tokens' [n_tree_tokens, L, k] by the module's rule, and the number of tree tokens whose
    paths give different expert sets."""
    if len(per_path) != tree.n_paths:
        raise ValueError(f"routed_experts: {len(per_path)} paths' routings for a tree of "
                         f"{tree.n_paths} paths")
    for p, r in enumerate(per_path):
        if r.ndim != 3 or len(r) != tree.path_lengths[p]:
            raise ValueError(f"routed_experts: path {p}: shape {r.shape}, expected "
                             f"[{tree.path_lengths[p]}, layers, k]")
    flat = np.concatenate(per_path).astype(np.int32)
    given = ~np.all(flat == -1, axis=(1, 2))
    idx = tree.flat_token_index[given]
    out = np.full((tree.n_tree_tokens, *flat.shape[1:]), -1, np.int32)
    tokens, first = np.unique(idx, return_index=True)
    out[tokens] = flat[given][first]
    as_sets = np.sort(flat[given], axis=-1)
    differs = np.any(as_sets != np.sort(out[idx], axis=-1), axis=(1, 2))
    return out, int(np.unique(idx[differs]).size)
