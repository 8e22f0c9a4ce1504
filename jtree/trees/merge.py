"""Several trees merged into one trie at their common prefixes, every path keeping its own data.

Each tree of a step is one group (one prompt's rollouts), and its advantages were computed from
that group alone when it was read (`jtree.objectives.advantages`). In agentic RL every group of a
step begins with the same system prompt and tool schemas; merged, those tokens are one node of
one tree and computed once. Nothing per path changes: a path of the merged tree is the same token
sequence with the same loss mask, advantages, old log-probs, weight and rewards as the path it
came from, so its per-token losses and coefficients (c[p,t], and the normalizer shares of
`jtree.layout.coefficients.path_normalizers`) are the ones it had in its own tree; only the
regrouping over tree tokens (docs/design.md section 2) now runs over more paths.

A sequence-level objective (GSPO) needs one trained bit per tree token; two groups may disagree
on it for the same tokens (one trains what the other reads as prompt), so with `shared_masks`
tokens are only merged where the paths agree on their scored mask too.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jtree.trees.loss_masks import scored_masks
from jtree.trees.tree import TrajectoryTree


def _all_or_none(trees: Sequence[TrajectoryTree], field: str) -> list[np.ndarray] | None:
    """Every path's `field`, in tree then path order; None when some tree does not carry it."""
    values = [getattr(t, field) for t in trees]
    if any(v is None for v in values):
        return None
    return [a for v in values for a in v]


def _routing(trees: Sequence[TrajectoryTree]) -> list[np.ndarray] | None:
    """Every path's routed experts (routing replay), -1 throughout (the trainer's own routing)
    on the paths of a tree that carries none; None when no tree carries them."""
    shapes = {r.shape[1:] for t in trees if t.routed_experts is not None
              for r in t.routed_experts}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise ValueError(f"routed_experts: trees route [layers, k] of shapes {sorted(shapes)}")
    shape = shapes.pop()
    return [r for t in trees for r in (t.routed_experts if t.routed_experts is not None else
                                       [np.full((n, *shape), -1, np.int32)
                                        for n in t.path_lengths])]


def merge_trees(trees: Sequence[TrajectoryTree], *, shared_masks: bool = False
                ) -> TrajectoryTree:
    """One tree holding every path of `trees` (path order: the trees' paths in order), each
    shared prefix of any of them stored once (maximal segments, as `from_sequences`).

    Per-path data travels with the path (routed experts too: -1, the trainer's own routing, on
    the paths of a tree without them). A field that some tree lacks (old log-probs, rewards,
    advantages) is left out of the merged tree: a training step recomputes old log-probs when any
    of its trees lacks them (`jtree.training.step_builders.step_info`), and the objectives that
    read advantages or rewards require them on every tree when the trees are read
    (`jtree.training.tree_files`). `shared_masks`: merge a token only where the paths also agree
    on its scored loss-mask bit (GSPO's one trained bit per tree token)."""
    if not trees:
        raise ValueError("trees: need at least one tree to merge")
    paths = [t.path_tokens(p) for t in trees for p in range(t.n_paths)]
    data = dict(loss_masks=_all_or_none(trees, "loss_masks"),
                advantages=_all_or_none(trees, "advantages"),
                old_logprobs=_all_or_none(trees, "old_logprobs"),
                rewards=_all_or_none(trees, "turn_rewards"),
                weights=np.concatenate([t.weights for t in trees]),
                routed_experts=_routing(trees))
    if not shared_masks:
        return TrajectoryTree.from_sequences(paths, **data)
    bits = [m.astype(np.int64) for t in trees for m in scored_masks(t)]
    keyed = TrajectoryTree.from_sequences([2 * s.astype(np.int64) + b
                                           for s, b in zip(paths, bits)])
    return TrajectoryTree.from_nodes(keyed.parents.tolist(), [s // 2 for s in keyed.segments],
                                     path_nodes=keyed.path_nodes.tolist(), **data)
