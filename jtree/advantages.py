"""Advantages from rewards, computed on the host from the tree (docs/rl.md).

The group of a GRPO-style estimator is the set of paths of one tree: the rollouts that share a
prompt (and, in tree search, whatever prefix they branch from). With K paths of rewards R_p:

- `grpo`: A_p = (R_p - mean R) / (std R + eps), std the population standard deviation (ddof 0)
- `dr_grpo`: A_p = R_p - mean R (Dr. GRPO drops the std; pair it with a length-independent
  normalization such as `seq_mean_token_sum` or `token_mean`)
- `rloo`: A_p = R_p - mean over the other paths = K / (K - 1) (R_p - mean R); 0 when K = 1
- `tree`: per node n, V(n) = mean of R_p over the paths through n (paths ending at n or below);
  every token of n gets A = V(n) - V(parent(n)), and a root node's tokens V(root) - mean R. This
  is the local (parent-relative) advantage of TreeRL (Hou et al., 2025, arXiv:2506.11902), without
  its global term and its 1/sqrt(leaves) scaling. A token's advantage is the same on every path
  through it, tokens shared by every path get 0, and along a path the advantages telescope to
  V(end node) - mean R.
- `given`: the advantages the records carry.

Means are unweighted (path weights scale the loss, not the baseline). The results are per-path
advantages (`grpo`, `dr_grpo`, `rloo`: one number per path; `tree`: one per token), which
`jtree.loss` folds into the P/N coefficients as before, so training stays exact on the tree.
"""

from __future__ import annotations

from typing import Literal, get_args

import numpy as np

from jtree.tree import TrajectoryTree

Estimator = Literal["given", "grpo", "dr_grpo", "rloo", "tree"]
ESTIMATORS: tuple[str, ...] = get_args(Estimator)

# Added to the std of GRPO's rewards, so a group whose rewards are all equal gets advantage 0.
GRPO_EPS = 1e-6


def group_advantages(rewards: np.ndarray, estimator: Estimator) -> np.ndarray:
    """Per-path advantages of one group of rewards (`grpo`, `dr_grpo` or `rloo`), float64."""
    r = np.asarray(rewards, np.float64)
    centered = r - r.mean()
    if estimator == "grpo":
        return centered / (r.std() + GRPO_EPS)
    if estimator == "dr_grpo":
        return centered
    if estimator == "rloo":
        k = r.size
        return centered * (k / (k - 1)) if k > 1 else np.zeros_like(r)
    raise ValueError(f"estimator: {estimator!r} is not a group estimator (grpo, dr_grpo, rloo)")


def node_values(tree: TrajectoryTree, rewards: np.ndarray) -> np.ndarray:
    """V(n): the mean reward of the paths through each node (paths ending in its subtree)."""
    total = np.zeros(tree.n_nodes)
    count = np.zeros(tree.n_nodes)
    np.add.at(total, tree.path_nodes, rewards)
    np.add.at(count, tree.path_nodes, 1.0)
    for n in range(tree.n_nodes - 1, -1, -1):  # DFS pre-order: children after parents
        p = tree.parents[n]
        if p >= 0:
            total[p] += total[n]
            count[p] += count[n]
    return total / np.maximum(count, 1.0)  # a node no path reaches has no tokens trained


def tree_token_advantages(tree: TrajectoryTree, rewards: np.ndarray) -> np.ndarray:
    """The `tree` estimator's advantage of every tree token (DFS order), float64."""
    v = node_values(tree, rewards)
    parent_v = np.where(tree.parents >= 0, v[np.maximum(tree.parents, 0)],
                        np.mean(rewards))
    return np.repeat(v - parent_v, np.diff(tree.node_offsets))


def with_advantages(tree: TrajectoryTree, estimator: Estimator) -> TrajectoryTree:
    """`tree` with the advantages of `estimator` computed from its rewards (`given`: unchanged,
    but it must carry advantages). Errors say which field is missing."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"objective.advantage: {estimator!r} is not one of {ESTIMATORS}")
    if estimator == "given":
        if tree.advantages is None:
            raise ValueError("path 0: no advantage (objective.advantage=given reads one per "
                             "path; give rewards and set objective.advantage to grpo, dr_grpo, "
                             "rloo or tree to compute them)")
        return tree
    rewards = tree.rewards
    if rewards is None:
        raise ValueError(f"path 0: no reward (objective.advantage={estimator} computes "
                         "advantages from one reward per path)")
    if estimator == "tree":
        per_token = tree_token_advantages(tree, rewards)
        return tree.with_advantages([per_token[tree.path_token_index(p)]
                                     for p in range(tree.n_paths)])
    return tree.with_advantages(list(group_advantages(rewards, estimator)))
