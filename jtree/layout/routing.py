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

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class RoutingCounts:
    """Routing replay's per-step gauges, as tree-token counts (they add over trees):
    `shared` tokens that two or more paths give an engine routing for, `disagreeing` those of them
    whose paths give different expert sets (`tree_routing`'s count); `trained` tokens some path
    trains (loss mask 1), `replayed` those of them that carry an engine routing."""

    shared: int = 0
    disagreeing: int = 0
    trained: int = 0
    replayed: int = 0

    def __add__(self, other: RoutingCounts) -> RoutingCounts:
        return RoutingCounts(*(a + b for a, b in zip(dataclasses.astuple(self),
                                                     dataclasses.astuple(other))))

    @property
    def disagreement(self) -> float:
        """The fraction of shared routed tokens whose paths' routings differ (0 without any)."""
        return self.disagreeing / self.shared if self.shared else 0.0

    @property
    def coverage(self) -> float:
        """The fraction of trained tokens replayed (1 without any trained token)."""
        return self.replayed / self.trained if self.trained else 1.0


def routing_counts(tree: TrajectoryTree) -> RoutingCounts:
    """`RoutingCounts` of `tree`'s own routed experts (all zero without them)."""
    if tree.routed_experts is None:
        return RoutingCounts()
    folded, disagreeing = tree_routing(tree, tree.routed_experts)
    flat = np.concatenate(tree.routed_experts)
    given = ~np.all(flat == -1, axis=(1, 2))
    idx = tree.flat_token_index
    routes = np.bincount(idx[given], minlength=tree.n_tree_tokens)
    trained = np.zeros(tree.n_tree_tokens, bool)
    trained[idx[np.concatenate(tree.loss_masks) > 0]] = True
    replayed = ~np.all(folded == -1, axis=(1, 2))
    return RoutingCounts(int((routes >= 2).sum()), disagreeing, int(trained.sum()),
                         int((trained & replayed).sum()))
