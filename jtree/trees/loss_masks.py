"""Which tokens each path of a tree trains: its loss mask with position 0 cleared (a sequence's first
token has no context to score it), and the check that paths sharing a token agree on it, which a
sequence-level objective (GSPO) needs."""

from __future__ import annotations

import numpy as np

from jtree.trees.tree import TrajectoryTree


def scored_masks(tree: TrajectoryTree) -> list[np.ndarray]:
    """Loss masks with position 0 cleared: a sequence's first token has no context to score it."""
    out = []
    for m in tree.loss_masks:
        m = m.copy()
        m[0] = 0.0
        out.append(m)
    return out


def check_shared_masks(tree: TrajectoryTree) -> None:
    """Raise unless the paths (of positive weight) that share a token agree on its loss mask.

    A sequence-level objective (GSPO) averages each path's log-ratios over the path's trained
    tokens with one path sum over the tree; that needs one "trained" bit per tree token."""
    flat = np.concatenate(scored_masks(tree))
    live = np.repeat(tree.weights > 0, tree.path_lengths)
    idx = tree.flat_token_index[live]
    lo = np.full(tree.n_tree_tokens, np.inf)
    hi = np.full(tree.n_tree_tokens, -np.inf)
    np.minimum.at(lo, idx, flat[live])
    np.maximum.at(hi, idx, flat[live])
    mixed = np.flatnonzero(lo < hi)
    if mixed.size:
        sharing = np.flatnonzero(live & (tree.flat_token_index == mixed[0]))
        first, other = sharing[0], sharing[flat[sharing] != flat[sharing[0]]][0]
        starts = np.r_[0, np.cumsum(tree.path_lengths)]
        path_of = np.searchsorted(starts, [first, other], side="right") - 1
        raise ValueError(
            f"path {path_of[1]}: loss_mask[{other - starts[path_of[1]]}] = {int(flat[other])} "
            f"differs from path {path_of[0]}'s on the token they share (objective.kind=gspo "
            "needs one loss mask per tree token)")
