"""Off-policy weights in the step: the importance weights and sequence masks of
`objective.off_policy` (TIS, MIS, their sequence forms, the geometric-mean sequence mask and
DeepSeek-V3.2's KL sequence mask; docs/rl.md, "Off-policy correction") formed on the device,
after the trainer's old log-probs pi_old are known, and folded into the policy's P / N (GSPO's
`seq_pos` / `seq_neg`) exactly.

The weight of path p at its trained token t reads r_{p,t} = exp(pi_old(t) - mu_p(t)): pi_old is per
tree token, but the behavior log-prob mu is the path's own (each rollout reports its own), so two
paths through a shared token may weigh it differently. The batch therefore carries one entry
per (path, trained token) (`jtree.objectives.pairs`: position, c[p,t], A[p,t], mu_p(t)); the step
forms each pair's weight and adds the pairs' c A w into their tokens by sign (design.md
section 2), or, for GSPO, each path's sum at its last token. A sequence mask is a per-path
quantity (a mean over the path's pairs, `pair_path_sums`) that zeroes the weight of the path's
pairs, never of a tree token, so a token shared with a kept path keeps that path's term.
Weights are >= 0, so every term
keeps its sign and the P / N regrouping stays exact. The host fold of the same weights, for
callers that know pi_old beforehand, is `jtree.layout.off_policy`; both weigh ratios with its
`ratio_weights`, and the tests hold both to a per-path reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jtree.config.objective import Objective, OffPolicyConfig
from jtree.layout.batch import DeviceBatch, PathPairs
from jtree.layout.off_policy import ratio_weights
from jtree.objectives.pairs import pair_path_sums, pair_token_sums
from jtree.parallel.context import gathered_row, local_index

# Metrics that `off_policy_coefficients` returns as sums over pairs and `finish_off_policy_metrics`
# turns into means (the names of `jtree.layout.off_policy.off_policy_metrics`).
MEAN_METRICS = ("offpolicy_kl_k1", "offpolicy_kl_k3", "offpolicy_corrected_frac")
# Returned as a sum over paths (each counted on the device holding its last token) and made a
# mean over the step's paths, `offpolicy_paths`.
PATH_METRICS = ("offpolicy_masked_seq_frac",)


def path_means(values: jax.Array, pairs: PathPairs) -> jax.Array:
    """[..., Q] per-pair values (0 on padding) -> their mean over each pair's path, on every
    pair of the path: a per-sequence mean over the path's trained tokens, as the path alone
    would give it."""
    count = pair_path_sums((pairs.index >= 0).astype(values.dtype), pairs)
    return pair_path_sums(values, pairs) / jnp.maximum(count, 1.0)


def pair_weights(log_ratio: jax.Array, pairs: PathPairs, config: OffPolicyConfig
                 ) -> tuple[jax.Array, jax.Array]:
    """(weight, corrected) of every pair [..., Q] from its log-ratio pi_old - mu (0 on padding):
    the ratio is the pair's own or, for the sequence kinds, its path's geometric mean over the
    path's pairs; truncated at `cap`, masked to 0 outside [low, high], or (`seq_mask`) 1 inside
    and 0 outside (`jtree.layout.off_policy.ratio_weights`). `corrected`: where the weight is
    not the ratio. Kind `none` weighs every pair by 1."""
    if config.kind == "none":
        return jnp.ones_like(log_ratio), jnp.zeros(log_ratio.shape, bool)
    if config.sequence_level:
        log_ratio = path_means(log_ratio, pairs)
    return ratio_weights(jnp.exp(log_ratio), config, jnp)


def kl_masked(log_ratio: jax.Array, advantage: jax.Array, pairs: PathPairs, delta: float
              ) -> jax.Array:
    """DeepSeek-V3.2's off-policy sequence mask, per pair [..., Q]: True where the pair's
    advantage is negative and its path's mean mu - pi_old over the path's trained tokens (k1,
    an estimate of KL(mu || pi_old) from mu's samples) exceeds `delta`. Only negative
    advantages are dropped: pushing down a sample the policy has drifted far from is what
    destabilizes, while a positive one still pulls the policy towards good behavior."""
    return (pairs.index >= 0) & (advantage < 0) & (path_means(-log_ratio, pairs) > delta)


def off_policy_coefficients(inputs: DeviceBatch, objective: Objective, *,
                            context_axis: str | None = None
                            ) -> tuple[DeviceBatch, dict[str, jax.Array]]:
    """`inputs` with the policy's P / N (`ppo`) or `seq_pos` / `seq_neg` (`gspo`) summed from
    the pairs' weighted c A, pi_old read from the batch's `old_logprobs` (no gradient: they are
    inputs), and the off-policy metrics as sums over the pairs (`MEAN_METRICS` and the pair count
    `offpolicy_pairs`) and over the paths (`PATH_METRICS`, a path counted as masked when any of
    its pairs is, and the path count `offpolicy_paths`); `finish_off_policy_metrics` makes them
    means.

    Under context parallelism (`context_axis`) the pairs are the whole rows' (not split): pi_old
    is gathered over the axis, every device forms every pair's weight (a sequence kind's ratio
    needs the whole path), and each keeps the pairs whose token (GSPO: whose path end) it holds,
    for its coefficients and its share of the metrics."""
    pairs = inputs.pairs
    if pairs is None or pairs.behavior is None:
        raise ValueError("inputs: off-policy 'pairs' missing; objective.off_policy needs "
                         "jtree.objectives.pairs.with_pairs(..., off_policy=True) on the batch")
    s = inputs.tokens.shape[-1]
    old, index, end = inputs.coefficients.old_logprobs, pairs.index, pairs.end
    if context_axis is not None:
        old = gathered_row(old, context_axis)
        index, end = (local_index(x, s, context_axis) for x in (index, end))
    live = pairs.index >= 0
    pi_old = jnp.take_along_axis(old, jnp.maximum(pairs.index, 0), axis=-1)
    log_ratio = jnp.where(live, pi_old - pairs.behavior, 0.0)
    config = objective.off_policy
    weight, corrected = pair_weights(log_ratio, pairs, config)
    masked = corrected if config.kind in ("mis", "seq_mis", "seq_mask") else \
        jnp.zeros(live.shape, bool)
    if config.kl_mask_delta is not None:
        dropped = kl_masked(log_ratio, pairs.advantage, pairs, config.kl_mask_delta)
        weight, masked = jnp.where(dropped, 0.0, weight), masked | dropped
    ca = jnp.where(live, pairs.coef * pairs.advantage * weight, 0.0)
    if objective.kind == "gspo":  # each path's weighted c_p A_p at its last token
        per_path = pair_path_sums(ca, pairs)
        at = jnp.where(live & pairs.last, end, -1)
        inputs = inputs.with_coefficients(
            seq_pos=pair_token_sums(jnp.where(per_path >= 0, per_path, 0.0), pairs, s, at),
            seq_neg=pair_token_sums(jnp.where(per_path < 0, per_path, 0.0), pairs, s, at))
    else:
        inputs = inputs.with_coefficients(
            adv_pos=pair_token_sums(jnp.where(ca >= 0, ca, 0.0), pairs, s, index),
            adv_neg=pair_token_sums(jnp.where(ca < 0, ca, 0.0), pairs, s, index))
    own = (index >= 0).astype(log_ratio.dtype)  # each pair counted on one device
    # each path counted once, on the device holding its last token
    own_path = (live & pairs.last & (end >= 0)).astype(log_ratio.dtype)
    path_masked = pair_path_sums((live & masked).astype(log_ratio.dtype), pairs) > 0
    metrics = {
        "offpolicy_kl_k1": jnp.sum(own * -log_ratio),
        "offpolicy_kl_k3": jnp.sum(own * (jnp.expm1(log_ratio) - log_ratio)),
        "offpolicy_corrected_frac": jnp.sum(own * corrected),
        "offpolicy_masked_seq_frac": jnp.sum(own_path * path_masked),
        "offpolicy_pairs": jnp.sum(own),
        "offpolicy_paths": jnp.sum(own_path),
    }
    return inputs, metrics


def finish_off_policy_metrics(metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The summed off-policy metrics as means over the step's pairs, and the masked-sequence
    count as a fraction of its paths (unchanged without them)."""
    if "offpolicy_pairs" not in metrics:
        return metrics
    metrics = dict(metrics)
    n = jnp.maximum(metrics.pop("offpolicy_pairs"), 1.0)
    paths = jnp.maximum(metrics.pop("offpolicy_paths"), 1.0)
    return dict(metrics, **{name: metrics[name] / n for name in MEAN_METRICS},
                **{name: metrics[name] / paths for name in PATH_METRICS})
