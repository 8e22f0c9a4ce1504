"""Per-token loss coefficients (host side) and tree losses (device side).

The per-path objective sum_p sum_t c[p,t] * l_t regroups over unique tree tokens as
sum_t W_t * l_t with W_t = sum over paths through t of c[p,t]. For the clipped PPO/GRPO surrogate the
coefficient is split by the sign of the advantage into P_t (A >= 0) and N_t (A < 0), which keeps the
clipping exact even when paths sharing a token disagree on the advantage (docs/design.md section 2).
GSPO's sequence-level objective reads one coefficient per path instead, at the path's last token
(`seq_pos` / `seq_neg`), and the path's mean log-ratio from a path sum (`jtree.objectives.path_sum`).

All normalizers are computed on the host over the whole training batch so that micro-batches,
devices and partitions of a tree add up to exactly the full-batch loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jtree.layout.batch import LossCoefficients
from jtree.objectives.path_sum import path_sum
from jtree.trees.tree import TrajectoryTree
from jtree.config.objective import NORMALIZATIONS
from jtree.config.objective import Normalization


# The per-token coefficient arrays `token_coefficients` returns (fields of `LossCoefficients`).
COEFFICIENT_FIELDS = ("weight", "adv_pos", "adv_neg", "seq_pos", "seq_neg")


def _effective_masks(tree: TrajectoryTree) -> list[np.ndarray]:
    """Loss masks with position 0 cleared: a sequence's first token has no context to score it."""
    out = []
    for m in tree.loss_masks:
        m = m.copy()
        m[0] = 0.0
        out.append(m)
    return out


def _check_normalization(normalization: str) -> None:
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization: {normalization!r} is not one of {NORMALIZATIONS}")


def batch_normalizer(trees: Sequence[TrajectoryTree], normalization: Normalization) -> float:
    """The global denominator of `normalization` over every path of every tree in the batch."""
    _check_normalization(normalization)
    if normalization == "token_mean":
        return float(
            sum(
                float(np.dot(t.weights, [m.sum() for m in _effective_masks(t)]))
                for t in trees
            )
        )
    return float(sum(float(t.weights.sum()) for t in trees))


def path_coefficients(
    tree: TrajectoryTree, normalization: Normalization, normalizer: float
) -> list[np.ndarray]:
    """c[p, t] for every path p of `tree` (one float32 array per path, aligned with its tokens)."""
    _check_normalization(normalization)
    out = []
    for w, m in zip(tree.weights, _effective_masks(tree)):
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
    tree: TrajectoryTree, normalization: Normalization, normalizer: float
) -> dict[str, np.ndarray]:
    """Per-tree-token coefficients (`COEFFICIENT_FIELDS`): `weight` (W), `adv_pos` (P),
    `adv_neg` (N), and the sequence-level `seq_pos` / `seq_neg`: at the last token of each path
    p, s_p = sum_t c[p,t] A[p,t] (c_p A_p for one advantage per path, c_p = sum_t c[p,t]), added
    to `seq_pos` when s_p >= 0, else to `seq_neg` (paths ending at one token share its sum)."""
    coeffs = np.concatenate(path_coefficients(tree, normalization, normalizer)).astype(np.float64)
    idx = tree.flat_token_index
    n = tree.n_tree_tokens
    weight = np.bincount(idx, weights=coeffs, minlength=n)
    if tree.advantages is None:
        zeros = np.zeros(n, np.float32)
        return {"weight": weight.astype(np.float32),
                **{name: zeros for name in COEFFICIENT_FIELDS[1:]}}
    ca = coeffs * np.concatenate(tree.advantages)
    pos = np.bincount(idx, weights=np.where(ca >= 0, ca, 0.0), minlength=n)
    neg = np.bincount(idx, weights=np.where(ca < 0, ca, 0.0), minlength=n)
    per_path = np.add.reduceat(ca, np.r_[0, np.cumsum(tree.path_lengths)[:-1]])
    last = tree.node_offsets[tree.path_nodes + 1] - 1
    seq_pos = np.bincount(last, weights=np.where(per_path >= 0, per_path, 0.0), minlength=n)
    seq_neg = np.bincount(last, weights=np.where(per_path < 0, per_path, 0.0), minlength=n)
    return {name: a.astype(np.float32) for name, a in
            zip(COEFFICIENT_FIELDS, (weight, pos, neg, seq_pos, seq_neg))}


def check_shared_masks(tree: TrajectoryTree) -> None:
    """Raise unless the paths (of positive weight) that share a token agree on its loss mask.

    A sequence-level objective (GSPO) averages each path's log-ratios over the path's trained
    tokens with one path sum over the tree; that needs one "trained" bit per tree token."""
    flat = np.concatenate(_effective_masks(tree))
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


# ---------------------------------------------------------------------- device-side losses


def _regularizers(loss: jax.Array, metrics: dict[str, jax.Array], logprobs: jax.Array,
                  coefficients: LossCoefficients, kl_coef: float, entropy: jax.Array | None,
                  entropy_coef: float) -> jax.Array:
    """`loss` plus the KL-to-reference (k3 estimator, when the coefficients carry
    `ref_logprobs`) and minus the entropy bonus, both weighted by W_t; records them in
    `metrics`."""
    weight, ref_logprobs = coefficients.weight, coefficients.ref_logprobs
    if ref_logprobs is not None and kl_coef:
        d = jnp.where(weight != 0, ref_logprobs - logprobs, 0.0)
        kl = jnp.sum(weight * (jnp.exp(d) - d - 1.0))
        metrics["kl_ref"] = kl
        loss = loss + kl_coef * kl
    if entropy is not None and entropy_coef:
        ent = jnp.sum(weight * entropy)
        metrics["entropy"] = ent
        loss = loss - entropy_coef * ent
    return loss


def sft_loss(logprobs: jax.Array, coefficients: LossCoefficients) -> jax.Array:
    """Weighted negative log-likelihood: sum_t W_t * (-log p_t)."""
    return -jnp.sum(coefficients.weight * logprobs)


def ppo_loss(
    logprobs: jax.Array,
    coefficients: LossCoefficients,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    kl_coef: float = 0.0,
    entropy: jax.Array | None = None,
    entropy_coef: float = 0.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped PPO/GRPO surrogate on a tree, exactly equal to the per-path sum.

    -[P_t * min(r_t, clip(r_t)) + N_t * max(r_t, clip(r_t))] summed over tokens, with
    r_t = exp(logp_t - old_t). Optional KL-to-reference (k3 estimator, when the coefficients carry
    `ref_logprobs`) and entropy bonus use W_t.
    `clip_low`/`clip_high` allow asymmetric (DAPO-style) clipping.
    """
    pos, neg, weight = coefficients.adv_pos, coefficients.adv_neg, coefficients.weight
    old_logprobs = coefficients.old_logprobs
    active = (pos != 0) | (neg != 0)
    log_ratio = jnp.where(active, logprobs - old_logprobs, 0.0)
    ratio = jnp.exp(log_ratio)
    clipped = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    surrogate = pos * jnp.minimum(ratio, clipped) + neg * jnp.maximum(ratio, clipped)
    loss = -jnp.sum(surrogate)
    abs_adv = jnp.abs(pos) + jnp.abs(neg)
    metrics = {
        "policy_loss": loss,
        "clip_frac": jnp.sum(abs_adv * (ratio != clipped)) / jnp.maximum(jnp.sum(abs_adv), 1e-30),
        "approx_kl_old": jnp.sum(weight * (ratio - 1.0 - log_ratio)),
    }
    return _regularizers(loss, metrics, logprobs, coefficients, kl_coef, entropy,
                         entropy_coef), metrics


def gspo_loss(
    logprobs: jax.Array,
    coefficients: LossCoefficients,
    end: jax.Array,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    kl_coef: float = 0.0,
    entropy: jax.Array | None = None,
    entropy_coef: float = 0.0,
    owned: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GSPO's clipped sequence-level surrogate on a tree, equal to the per-path sum.

    Arrays are [..., S] over every token of the layout (`end` its subtree ends). A path p ending
    at token e has the sequence ratio s_e = exp(sum_{t in p} m_t (logp_t - old_t) / sum_{t in p}
    m_t), both sums path sums (`jtree.objectives.path_sum`; m_t = [W_t > 0], the trained tokens); the loss is
    -sum_e [seq_pos_e min(s_e, clip(s_e)) + seq_neg_e max(s_e, clip(s_e))], which is GSPO's
    -sum_p c_p min(s_p A_p, clip(s_p) A_p) since every path ending at e has the same ratio. Its
    gradient reaches every token of the path through the path sum's transpose (GSPO's
    token-level form: each token's log-prob gradient times s_p A_p / n_p, where unclipped).
    KL and entropy terms use W_t as in `ppo_loss`.

    `owned` [..., S] bool (default all): the tokens whose terms (path ends, KL, entropy) this
    call sums, the path sums still running over every token; under context parallelism a
    device's slice of the gathered row (`jtree.parallel.context.owned`).
    """
    c = coefficients
    own = 1.0 if owned is None else owned.astype(logprobs.dtype)
    trained = (c.weight > 0).astype(logprobs.dtype)
    log_ratio = trained * (logprobs - c.old_logprobs)
    ends = (c.seq_pos != 0) | (c.seq_neg != 0)
    n_trained = path_sum(trained, end)
    mean_log_ratio = jnp.where(ends, path_sum(log_ratio, end) / jnp.maximum(n_trained, 1.0), 0.0)
    ratio = jnp.exp(mean_log_ratio)
    clipped = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    surrogate = c.seq_pos * jnp.minimum(ratio, clipped) + c.seq_neg * jnp.maximum(ratio, clipped)
    loss = -jnp.sum(own * surrogate)
    abs_adv = own * (jnp.abs(c.seq_pos) + jnp.abs(c.seq_neg))
    token_ratio = jnp.exp(log_ratio)
    weight = own * c.weight
    metrics = {
        "policy_loss": loss,
        "clip_frac": jnp.sum(abs_adv * (ratio != clipped)) / jnp.maximum(jnp.sum(abs_adv), 1e-30),
        "approx_kl_old": jnp.sum(weight * (token_ratio - 1.0 - log_ratio)),
    }
    return _regularizers(loss, metrics, logprobs, dataclasses.replace(c, weight=weight), kl_coef,
                         entropy, entropy_coef), metrics


def value_loss(values: jax.Array, old_values: jax.Array, returns: jax.Array, coef: jax.Array,
               clip: float) -> jax.Array:
    """PPO's clipped value loss over (path, token) pairs (`jtree.layout.batch.CriticPairs`):
    sum_k c_k 0.5 max((V_k - R_k)^2, (clip(V_k, Vold_k - clip, Vold_k + clip) - R_k)^2).

    Summed per pair, not per tree token: a shared token's return differs per path, and which
    side of the max wins depends on it, so no per-token coefficient regroups the clipped loss
    exactly. A pair is a few scalars; the values themselves are computed once per tree token.
    """
    clipped = jnp.clip(values, old_values - clip, old_values + clip)
    return 0.5 * jnp.sum(coef * jnp.maximum((values - returns) ** 2, (clipped - returns) ** 2))
