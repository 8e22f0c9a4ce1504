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
- `turn`: per-turn credit within a path, MT-GRPO's turn-level advantage (Zeng et al., 2025,
  arXiv:2505.11821) for any number of turns. The turns of a path are the runs of its trained
  tokens (`turn_spans`); r_{p,k} its reward for turn k. Each turn's rewards are normalized over
  the paths that have that turn, as GRPO normalizes, and a turn's tokens get the discounted sum
  of the normalized rewards of that turn and the later ones (gamma = `objective.turn_discount`,
  MT-GRPO's lambda; for two turns exactly its A^MT):
      Ahat_{p,k} = (r_{p,k} - mean_q r_{q,k}) / (std_q r_{q,k} + eps),
      A_{p,t} = sum_{k >= t} gamma^(k - t) Ahat_{p,k}.
  Tokens outside every turn (loss mask 0) get 0. A token shared by several paths gets each
  path's own turn advantage (the P/N coefficients add them up per path).
- `given`: the advantages the records carry.

Means are unweighted (path weights scale the loss, not the baseline). The results are per-path
advantages (`grpo`, `dr_grpo`, `rloo`: one number per path; `tree`, `turn`: one per token),
which `jtree.objectives.losses` folds into the P/N coefficients as before, so training stays exact on the tree.
"""

from __future__ import annotations

import numpy as np

from jtree.config.objective import ESTIMATORS, Estimator
from jtree.trees.loss_masks import check_shared_masks
from jtree.trees.tree import TrajectoryTree

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


def turn_spans(loss_mask: np.ndarray) -> list[tuple[int, int]]:
    """The turns of a path: (start, end) of every maximal run of trained tokens (loss mask 1),
    in order. Position 0 is never scored, so it belongs to no turn."""
    trained = np.asarray(loss_mask) != 0
    trained[:1] = False
    edges = np.diff(np.concatenate([[0], trained.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def turn_advantages(tree: TrajectoryTree, discount: float) -> list[np.ndarray]:
    """The `turn` estimator's per-token advantages of every path (float64, path order). A path
    whose per-turn rewards do not match its turns is an error naming it and its turns."""
    spans = [turn_spans(m) for m in tree.loss_masks]
    rewards = tree.turn_rewards
    for p, (r, s) in enumerate(zip(rewards, spans)):
        if r.size != len(s):
            shown = ", ".join(f"{a}..{b - 1}" for a, b in s[:4]) + (", ..." if len(s) > 4 else "")
            raise ValueError(f"path {p}: reward: {r.size} per-turn reward(s) for {len(s)} turn(s) "
                             f"(runs of loss_mask 1 at tokens: {shown or 'none'}; "
                             "objective.advantage=turn needs one reward per turn)")
    normalized = [np.zeros(r.size) for r in rewards]
    for k in range(max(r.size for r in rewards)):
        have = [p for p, r in enumerate(rewards) if r.size > k]
        for p, a in zip(have, group_advantages(np.array([rewards[p][k] for p in have]), "grpo")):
            normalized[p][k] = a
    out = []
    for p, (a_hat, s) in enumerate(zip(normalized, spans)):
        adv = np.zeros(int(tree.path_lengths[p]))
        to_go = 0.0
        for k in range(len(s) - 1, -1, -1):  # the discounted sum over turns k, k + 1, ...
            to_go = a_hat[k] + discount * to_go
            adv[s[k][0]:s[k][1]] = to_go
        out.append(adv)
    return out


def with_advantages(tree: TrajectoryTree, estimator: Estimator,
                    turn_discount: float = 1.0) -> TrajectoryTree:
    """`tree` with the advantages of `estimator` computed from its rewards (`given`: unchanged,
    but it must carry advantages; `turn` discounts later turns by `turn_discount`). Errors say
    which field is missing or does not fit."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"objective.advantage: {estimator!r} is not one of {ESTIMATORS}")
    if estimator == "given":
        if tree.advantages is None:
            raise ValueError("path 0: no advantage (objective.advantage=given reads one per "
                             "path; give rewards and set objective.advantage to grpo, dr_grpo, "
                             "rloo, tree or turn to compute them)")
        return tree
    rewards = tree.rewards
    if rewards is None:
        raise ValueError(f"path 0: no reward (objective.advantage={estimator} computes "
                         "advantages from one reward per path)")
    if estimator == "turn":
        return tree.with_advantages(turn_advantages(tree, turn_discount))
    if estimator == "tree":
        per_token = tree_token_advantages(tree, rewards)
        return tree.with_advantages([per_token[tree.path_token_index(p)]
                                     for p in range(tree.n_paths)])
    return tree.with_advantages(list(group_advantages(rewards, estimator)))


def for_objective(tree: TrajectoryTree, advantage: Estimator | None, shared_masks: bool,
                  turn_discount: float = 1.0) -> TrajectoryTree:
    """`tree` with what an objective needs from it when it is read: with `shared_masks` (GSPO),
    its paths must agree on the loss mask of the tokens they share; with an `advantage`
    estimator, its advantages are computed from the paths' rewards (None: the objective needs
    none; `turn` discounts later turns by `turn_discount`)."""
    if shared_masks:
        check_shared_masks(tree)
    return tree if advantage is None else with_advantages(tree, advantage, turn_discount)
