"""Per-token loss coefficients (host side) and tree losses (device side).

The per-path objective sum_p sum_t c[p,t] * l_t regroups over unique tree tokens as
sum_t W_t * l_t with W_t = sum over paths through t of c[p,t]. For the clipped PPO/GRPO surrogate the
coefficient is split by the sign of the advantage into P_t (A >= 0) and N_t (A < 0), which keeps the
clipping exact even when paths sharing a token disagree on the advantage (docs/design.md section 2).

All normalizers are computed on the host over the whole training batch so that micro-batches,
devices and partitions of a tree add up to exactly the full-batch loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np

from jtree.batch import LossCoefficients
from jtree.tree import TrajectoryTree

Normalization = Literal["seq_mean_token_mean", "seq_mean_token_sum", "token_mean"]
NORMALIZATIONS: tuple[str, ...] = get_args(Normalization)


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
    """Per-tree-token coefficients: `weight` (W), `adv_pos` (P) and `adv_neg` (N)."""
    coeffs = np.concatenate(path_coefficients(tree, normalization, normalizer)).astype(np.float64)
    idx = tree.flat_token_index
    n = tree.n_tree_tokens
    weight = np.bincount(idx, weights=coeffs, minlength=n)
    if tree.advantages is None:
        zeros = np.zeros(n, np.float32)
        return {"weight": weight.astype(np.float32), "adv_pos": zeros, "adv_neg": zeros}
    ca = coeffs * np.concatenate(tree.advantages)
    pos = np.bincount(idx, weights=np.where(ca >= 0, ca, 0.0), minlength=n)
    neg = np.bincount(idx, weights=np.where(ca < 0, ca, 0.0), minlength=n)
    return {
        "weight": weight.astype(np.float32),
        "adv_pos": pos.astype(np.float32),
        "adv_neg": neg.astype(np.float32),
    }


# ---------------------------------------------------------------------- device-side losses


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
    old_logprobs, ref_logprobs = coefficients.old_logprobs, coefficients.ref_logprobs
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
    if ref_logprobs is not None and kl_coef:
        d = jnp.where(weight != 0, ref_logprobs - logprobs, 0.0)
        kl = jnp.sum(weight * (jnp.exp(d) - d - 1.0))
        metrics["kl_ref"] = kl
        loss = loss + kl_coef * kl
    if entropy is not None and entropy_coef:
        ent = jnp.sum(weight * entropy)
        metrics["entropy"] = ent
        loss = loss - entropy_coef * ent
    return loss, metrics
