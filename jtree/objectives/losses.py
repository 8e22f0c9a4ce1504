"""Tree losses on device: SFT, PPO/GRPO's clipped surrogate, GSPO and the critic's value loss.

Each reads the per-token coefficients `jtree.layout.coefficients` computed on the host (W, P / N,
per-path sequence coefficients; their normalizers span the whole batch) and so sums exactly to
the per-path loss. GSPO's mean log-ratio per path comes from a path sum
(`jtree.objectives.path_sum`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jtree.layout.batch import LossCoefficients
from jtree.objectives.path_sum import path_sum


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


def distill_loss(logprobs: jax.Array, coefficients: LossCoefficients) -> jax.Array:
    """On-policy distillation's reverse KL, KL(pi || teacher), by its sampled-token estimate:
    sum_t W_t k_t with k_t = log pi(y_t) - log pi_teacher(y_t) at the policy's own sampled
    token y_t. The value is that estimate; the gradient is the policy-gradient form
    sum_t W_t k_t grad log pi(y_t) (advantage -k_t, per token, no later tokens), the score
    function's unbiased estimate of the per-token reverse KL's gradient. The direct surrogate's
    gradient, sum_t W_t grad log pi(y_t), has expectation 0 under the samples, so it would not
    move the policy toward the teacher. One term per tree token weighted by W_t (the sum over
    the paths through it of c[p,t]) is the per-path sum, since k_t depends on the prefix
    only."""
    weight = coefficients.weight
    k = jax.lax.stop_gradient(jnp.where(weight != 0, logprobs - coefficients.teacher_logprobs,
                                        0.0))
    # logprobs - stop_gradient(logprobs) is 0 in value and carries grad log pi.
    return jnp.sum(weight * k * (1.0 + logprobs - jax.lax.stop_gradient(logprobs)))


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
    """PPO's clipped value loss over (path, token) pairs (`jtree.layout.batch.PathPairs`):
    sum_k c_k 0.5 max((V_k - R_k)^2, (clip(V_k, Vold_k - clip, Vold_k + clip) - R_k)^2).

    Summed per pair, not per tree token: a shared token's return differs per path, and which
    side of the max wins depends on it, so no per-token coefficient regroups the clipped loss
    exactly. A pair is a few scalars; the values themselves are computed once per tree token.
    """
    clipped = jnp.clip(values, old_values - clip, old_values + clip)
    return 0.5 * jnp.sum(coef * jnp.maximum((values - returns) ** 2, (clipped - returns) ** 2))
