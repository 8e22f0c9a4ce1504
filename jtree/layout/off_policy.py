"""Off-policy correction on the host: importance weights for the gap between the rollout
engine's behavior log-probs mu and the trainer's old log-probs pi_old, per (path, token).

mu is per path (the data's `old_logprobs`: the engine sampled each rollout on its own, so two
paths through one tree token may report different values); pi_old is per tree token (the
trainer scores each tree token once). The weight of path p at its trained token t is a function
of r_{p,t} = exp(pi_old(t) - mu_p(t)), so it may differ between the paths that share t. That is
why it is folded into each path's coefficients c[p,t] A[p,t] before they are summed into the
token's P_t / N_t (and each path's c_p A_p before GSPO's `seq_pos` / `seq_neg`): the weights are
positive or zero, so a term keeps its sign, lands where it would without them, and the tree loss
stays the per-path loss with the same weights (docs/rl.md, "Off-policy correction").

The weights are constants of the step (no gradient flows through them): they are numbers on the
host, multiplied into coefficients the device only reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from jtree.config.objective import OffPolicyConfig
from jtree.trees.loss_masks import scored_masks
from jtree.trees.tree import TrajectoryTree


def _behavior(tree: TrajectoryTree) -> tuple[np.ndarray, ...]:
    if tree.old_logprobs is None:
        raise ValueError("old_logprobs: off-policy correction needs the rollout engine's "
                         "behavior log-probs on every path (records' old_logprobs, traces' "
                         "output_logprobs)")
    return tree.old_logprobs


def path_log_ratios(tree: TrajectoryTree, policy_old: np.ndarray) -> list[np.ndarray]:
    """log r_{p,t} = pi_old(t) - mu_p(t) for every path p of `tree` (float64, aligned with the
    path's tokens; 0 where the path does not train the token). `policy_old` holds pi_old per tree
    token, in the tree's DFS order."""
    policy_old = np.asarray(policy_old, np.float64)
    if policy_old.shape != (tree.n_tree_tokens,):
        raise ValueError(f"policy_old: shape {policy_old.shape}, expected ({tree.n_tree_tokens},)"
                         " (one old log-prob per tree token)")
    out = []
    for p, (mu, m) in enumerate(zip(_behavior(tree), scored_masks(tree))):
        delta = policy_old[tree.path_token_index(p)] - np.asarray(mu, np.float64)
        out.append(np.where(m > 0, delta, 0.0))
    return out


def _ratios(tree: TrajectoryTree, log_ratios: list[np.ndarray], sequence_level: bool
            ) -> list[np.ndarray]:
    """The ratio each trained (path, token) is weighed by: its own, or its path's geometric mean
    (exp of the mean log-ratio over the path's trained tokens) on every token of the path."""
    if not sequence_level:
        return [np.exp(x) for x in log_ratios]
    out = []
    for x, m in zip(log_ratios, scored_masks(tree)):
        n = m.sum()
        out.append(np.full(x.shape, np.exp(x.sum() / n) if n > 0 else 1.0))
    return out


def ratio_weights(ratios: Any, config: OffPolicyConfig, xp: ModuleType = np) -> tuple[Any, Any]:
    """(weight, corrected) of importance ratios, in array module `xp` (numpy here, jax.numpy in
    the step, `jtree.objectives.off_policy`): min(r, cap) under truncation, r inside
    [low, high] and 0 outside under masking, 1 inside and 0 outside under `seq_mask` (a mask
    that keeps the surrogate unweighted); `corrected` where the weight is not the ratio itself
    (above the cap, or outside [low, high])."""
    if config.kind in ("tis", "seq_tis"):
        return xp.minimum(ratios, config.cap), ratios > config.cap
    corrected = (ratios < config.low) | (ratios > config.high)
    kept = xp.ones_like(ratios) if config.kind == "seq_mask" else ratios
    return xp.where(corrected, 0.0, kept), corrected


def path_weights(tree: TrajectoryTree, policy_old: np.ndarray, config: OffPolicyConfig
                 ) -> list[np.ndarray]:
    """The importance weight of every token of every path (float64, 1 on untrained tokens,
    whose coefficient is 0 anyway): min(r, cap) under truncation, r inside [low, high] and 0
    outside under masking (`seq_mask`: 1 inside), r the token's ratio (`tis`, `mis`) or its
    path's geometric mean (`seq_tis`, `seq_mis`, `seq_mask`). All ones for kind `none`.
    `kl_mask_delta` needs each pair's advantage and is formed in the step only
    (`jtree.objectives.off_policy`)."""
    masks = scored_masks(tree)
    if config.kl_mask_delta is not None:
        raise ValueError("kl_mask_delta: the KL sequence mask is formed in the step "
                         "(jtree.objectives.off_policy), not by the host fold")
    if config.kind == "none":
        return [np.ones(m.shape) for m in masks]
    ratios = _ratios(tree, path_log_ratios(tree, policy_old), config.sequence_level)
    return [np.where(m > 0, ratio_weights(r, config)[0], 1.0) for r, m in zip(ratios, masks)]


def behavior_disagreement(tree: TrajectoryTree) -> float:
    """max |mu_p(t) - mu_q(t)| over the tree tokens t that two paths p, q both train: how far
    the engine's log-probs of one sampled token differ between rollouts (engine
    nondeterminism), which a flat trainer, seeing each rollout alone, cannot measure."""
    flat_mask = np.concatenate(scored_masks(tree)) > 0
    mu = np.concatenate([np.asarray(x, np.float64) for x in _behavior(tree)])[flat_mask]
    idx = tree.flat_token_index[flat_mask]
    hi = np.full(tree.n_tree_tokens, -np.inf)
    lo = np.full(tree.n_tree_tokens, np.inf)
    np.maximum.at(hi, idx, mu)
    np.minimum.at(lo, idx, mu)
    seen = np.isfinite(hi)
    return float(np.max(hi[seen] - lo[seen], initial=0.0))


def off_policy_metrics(trees: Sequence[TrajectoryTree], policy_olds: Sequence[np.ndarray],
                       config: OffPolicyConfig) -> dict[str, float]:
    """The step's engine-vs-trainer gauges, over every trained (path, token) pair of `trees`
    (each pair counted once, as a flat trainer would): `offpolicy_kl_k1`, the mean of
    mu - pi_old, and `offpolicy_kl_k3`, the mean of r - 1 - log r (both estimate KL(mu || pi_old)
    from tokens sampled by mu; k3 is never negative); `offpolicy_corrected_frac`, the fraction of
    pairs whose weight is not their ratio (truncated at the cap, or masked to 0);
    `offpolicy_behavior_disagreement`, the largest `behavior_disagreement` of any tree."""
    log_r, corrected, disagreement = [], [], 0.0
    for tree, policy_old in zip(trees, policy_olds, strict=True):
        masks = [m > 0 for m in scored_masks(tree)]
        x = path_log_ratios(tree, policy_old)
        ratios = _ratios(tree, x, config.sequence_level)
        log_r += [xp[m] for xp, m in zip(x, masks)]
        if config.kind != "none":
            corrected += [ratio_weights(r[m], config)[1] for r, m in zip(ratios, masks)]
        disagreement = max(disagreement, behavior_disagreement(tree))
    x = np.concatenate(log_r) if log_r else np.zeros(0)
    n = max(x.size, 1)
    return {
        "offpolicy_kl_k1": float(np.sum(-x) / n),
        "offpolicy_kl_k3": float(np.sum(np.expm1(x) - x) / n),
        "offpolicy_corrected_frac": float(sum(c.sum() for c in corrected) / n),
        "offpolicy_behavior_disagreement": disagreement,
    }
