"""Per-token loss coefficients on the host: W, P / N and the per-path sequence coefficients.

The per-path objective sum_p sum_t c[p,t] * l_t regroups over unique tree tokens as
sum_t W_t * l_t with W_t = sum over paths through t of c[p,t]. For the clipped PPO/GRPO surrogate the
coefficient is split by the sign of the advantage into P_t (A >= 0) and N_t (A < 0), which keeps the
clipping exact even when paths sharing a token disagree on the advantage (docs/design.md section 2).
GSPO's sequence-level objective reads one coefficient per path instead, at the path's last token
(`seq_pos` / `seq_neg`).

All normalizers are computed on the host over the whole training batch so that micro-batches,
devices and partitions of a tree add up to exactly the full-batch loss. The device-side losses that
read these coefficients are `jtree.objectives.losses`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jtree.config.objective import NORMALIZATIONS, Normalization
from jtree.trees.loss_masks import scored_masks
from jtree.trees.tree import TrajectoryTree

# The per-token coefficient arrays `token_coefficients` returns (fields of `LossCoefficients`).
COEFFICIENT_FIELDS = ("weight", "adv_pos", "adv_neg", "seq_pos", "seq_neg")


def _check_normalization(normalization: str) -> None:
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization: {normalization!r} is not one of {NORMALIZATIONS}")


def batch_normalizer(trees: Sequence[TrajectoryTree], normalization: Normalization) -> float:
    """The global denominator of `normalization` over every path of every tree in the batch."""
    return float(sum(float(path_normalizers(t, normalization).sum()) for t in trees))


def path_normalizers(tree: TrajectoryTree, normalization: Normalization) -> np.ndarray:
    """Each path's share of the batch normalizer (float64, one per path): its weight, times its
    scored tokens under `token_mean`. Shares add, so a step that leaves a path out (pruning,
    `jtree.layout.pruning`) can still divide by the normalizer that counts it."""
    _check_normalization(normalization)
    if normalization == "token_mean":
        return tree.weights.astype(np.float64) * [float(m.sum()) for m in scored_masks(tree)]
    return tree.weights.astype(np.float64)


def path_coefficients(
    tree: TrajectoryTree, normalization: Normalization, normalizer: float
) -> list[np.ndarray]:
    """c[p, t] for every path p of `tree` (one float32 array per path, aligned with its tokens)."""
    _check_normalization(normalization)
    out = []
    for w, m in zip(tree.weights, scored_masks(tree)):
        if normalizer <= 0:
            out.append(np.zeros_like(m))
            continue
        c = m * (float(w) / normalizer)
        if normalization == "seq_mean_token_mean":
            n = m.sum()
            c = c / n if n > 0 else np.zeros_like(m)
        out.append(c.astype(np.float32))
    return out


def token_coefficients(
    tree: TrajectoryTree, normalization: Normalization, normalizer: float,
    path_weights: Sequence[np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Per-tree-token coefficients (`COEFFICIENT_FIELDS`): `weight` (W), `adv_pos` (P),
    `adv_neg` (N), and the sequence-level `seq_pos` / `seq_neg`: at the last token of each path
    p, s_p = sum_t c[p,t] A[p,t] (c_p A_p for one advantage per path, c_p = sum_t c[p,t]), added
    to `seq_pos` when s_p >= 0, else to `seq_neg` (paths ending at one token share its sum).

    `path_weights` (one non-negative array per path, aligned with its tokens: the off-policy
    importance weights of `jtree.layout.off_policy`) multiply c[p,t] A[p,t] before the sums, so a
    shared token's P_t / N_t add each path's weighted term and the surrogate stays the per-path
    one; W (the KL and entropy terms) is not weighted."""
    coeffs = np.concatenate(path_coefficients(tree, normalization, normalizer)).astype(np.float64)
    idx = tree.flat_token_index
    n = tree.n_tree_tokens
    weight = np.bincount(idx, weights=coeffs, minlength=n)
    if tree.advantages is None:
        zeros = np.zeros(n, np.float32)
        return {"weight": weight.astype(np.float32),
                **{name: zeros for name in COEFFICIENT_FIELDS[1:]}}
    ca = coeffs * np.concatenate(tree.advantages)
    if path_weights is not None:
        if [len(w) for w in path_weights] != tree.path_lengths.tolist():
            raise ValueError("path_weights: expected one weight per token of every path")
        ca = ca * np.concatenate(path_weights)
    pos = np.bincount(idx, weights=np.where(ca >= 0, ca, 0.0), minlength=n)
    neg = np.bincount(idx, weights=np.where(ca < 0, ca, 0.0), minlength=n)
    per_path = np.add.reduceat(ca, np.r_[0, np.cumsum(tree.path_lengths)[:-1]])
    last = tree.node_offsets[tree.path_nodes + 1] - 1
    seq_pos = np.bincount(last, weights=np.where(per_path >= 0, per_path, 0.0), minlength=n)
    seq_neg = np.bincount(last, weights=np.where(per_path < 0, per_path, 0.0), minlength=n)
    return {name: a.astype(np.float32) for name, a in
            zip(COEFFICIENT_FIELDS, (weight, pos, neg, seq_pos, seq_neg))}
