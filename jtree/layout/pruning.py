"""Zero-gradient pruning: leave out of a step the paths that no term of the objective reaches.

A path whose advantage is 0 on every token it trains (a GRPO group whose rewards all agree) has
c[p,t] A[p,t] = 0 everywhere, so it adds nothing to P / N (token-level PPO/GRPO) nor to its
sequence sum s_p (GSPO), with or without off-policy weights (they multiply c A). It still counts
in the batch normalizer, and it would still add c[p,t] to W, which the KL and entropy terms read;
the critic's value loss and SFT read every trained token too. So pruning applies only to objectives
whose every term goes through c A (`pruning_blocker` names the others), and the pruned step keeps
the unpruned normalizer: each tree's full share (`PrunedTree.normalizer`, the sum of
`jtree.layout.coefficients.path_normalizers`) stays in the step, whether or not its paths do.

What remains of a tree is the union of the remaining paths' root-to-end chains
(`jtree.trees.part.TreePart.from_paths`): a remaining path reads exactly the tokens it read before,
so its log-probs, and with them the loss and every gradient, are unchanged. The model's router
load-balancing loss (MoE) counts every computed token and so also blocks pruning.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jtree.config.objective import Normalization, Objective
from jtree.layout.coefficients import path_normalizers
from jtree.trees.loss_masks import scored_masks
from jtree.trees.part import TreePart
from jtree.trees.tree import TrajectoryTree


@dataclasses.dataclass(frozen=True)
class PrunedTree:
    """One tree after pruning: `tree` holds its remaining paths (the input tree itself when none
    was dropped, None when none remains), `normalizer` is the whole input tree's share of the
    batch normalizer, `saved_tokens` the tree tokens no remaining path needs."""

    tree: TrajectoryTree | None
    normalizer: float
    saved_tokens: int


def pruning_blocker(objective: Objective, router_aux_loss: bool = False) -> str | None:
    """Why no path of any tree is prunable under `objective` (None: zero-advantage paths are).
    `router_aux_loss`: the model adds its MoE router loss, a statistic of every computed token."""
    if objective.kind == "sft":
        return "objective.kind=sft trains every trained token"
    if objective.critic is not None:
        return "objective.critic's value loss reads every trained token"
    if objective.kl_coef > 0:
        return "objective.kl_coef > 0 weighs every trained token"
    if objective.entropy_coef > 0:
        return "objective.entropy_coef > 0 weighs every trained token"
    if objective.distill is not None:
        return "objective.distill weighs every trained token"
    if router_aux_loss:
        return "the model's router loss (output_router_logits) counts every computed token"
    return None


def zero_gradient_paths(tree: TrajectoryTree) -> np.ndarray:
    """Which paths (bool per path) carry no advantage-weighted term: weight 0, or advantage 0 on
    every scored token. A tree without advantages has none (nothing to prove zero)."""
    if tree.advantages is None:
        return np.zeros(tree.n_paths, bool)
    return np.array([w == 0 or not np.any(a[m > 0])
                     for w, a, m in zip(tree.weights, tree.advantages, scored_masks(tree))])


def prune_tree(tree: TrajectoryTree, normalization: Normalization) -> PrunedTree:
    """`tree` without its zero-gradient paths and the nodes only they need. The caller has
    checked that the objective allows it (`pruning_blocker`)."""
    normalizer = float(path_normalizers(tree, normalization).sum())
    keep = np.flatnonzero(~zero_gradient_paths(tree))
    if len(keep) == tree.n_paths:
        return PrunedTree(tree, normalizer, 0)
    if len(keep) == 0:
        return PrunedTree(None, normalizer, tree.n_tree_tokens)
    part = TreePart.from_paths(tree, keep)
    return PrunedTree(part, normalizer, tree.n_tree_tokens - part.n_tree_tokens)


def prune_trees(trees: Sequence[TrajectoryTree], objective: Objective,
                router_aux_loss: bool = False) -> list[PrunedTree]:
    """Every tree pruned (`prune_tree`), or each kept whole when `pruning_blocker` says no path
    is prunable under `objective`; always with each tree's full normalizer share."""
    if pruning_blocker(objective, router_aux_loss) is not None:
        return [PrunedTree(t, float(path_normalizers(t, objective.normalization).sum()), 0)
                for t in trees]
    return [prune_tree(t, objective.normalization) for t in trees]
