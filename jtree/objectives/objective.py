"""The objective a step differentiates, assembled from the device losses: SFT, PPO or GSPO from the
final hidden states (log-probs scored where a token is trained), the critic's value loss and GAE,
the router's auxiliary loss; plus the sums that micro-batches and mesh shards accumulate.

Coefficients either arrive normalized (host-side `normalizer`, as `linearize` does by default) or
raw (`normalizer=1`) with `row_norm`, each row's share of the batch normalizer;
`normalize_coefficients` then divides by the sum over all rows, micro-batches and data shards, so
every host can linearize its own trees without knowing the global batch
(`jtree.training.pipeline`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jtree.config.objective import CriticConfig, Objective
from jtree.layout.batch import DeviceBatch, LossCoefficients
from jtree.layout.coefficients import COEFFICIENT_FIELDS
from jtree.objectives.critic import gae, pair_values
from jtree.objectives.logprobs import full_reverse_kl, logprobs_from_hidden, scored_logprobs
from jtree.objectives.losses import distill_loss, gspo_loss, ppo_loss, sft_loss, value_loss
from jtree.objectives.off_policy import finish_off_policy_metrics, off_policy_coefficients
from jtree.objectives.pairs import pair_token_sums
from jtree.parallel.context import gathered_row, local_index, owned, scoring_view


def objective_loss(model: Any, inputs: DeviceBatch, objective: Objective, *,
                   vocab_axis: str | None = None):
    """The objective on one micro-batch, plus the model's auxiliary loss: (loss, metrics).

    Metrics are sums (so they add over micro-batches and devices); the PPO clip fraction is
    carried as its numerator `clipped_adv` and denominator `abs_adv` (see `finish_metrics`).
    Under context parallelism (the model's `runtime.context_axis`) `inputs` is this device's
    slice of the rows and the sums are the slice's (`jtree.parallel.context`).
    With `objective.off_policy`, the policy's coefficients are first weighted per (path, token)
    (`jtree.objectives.off_policy`), and its metrics join the step's.
    With `objective.mtp_weight`, the multi-token-prediction loss (`mtp_loss`, on the batch's
    own W, before any off-policy weighting) is added and reported as `mtp_nll`.
    """
    context_axis = model.runtime.context_axis
    out = model(inputs)
    extra = {}
    if objective.mtp_weight:
        extra["mtp_nll"] = mtp_loss(model, out, inputs, objective, vocab_axis=vocab_axis)
    mtp = objective.mtp_weight * extra.get("mtp_nll", 0.0)
    if objective.critic is None:
        if objective.off_policy.enabled:
            inputs, off_policy = off_policy_coefficients(inputs, objective,
                                                         context_axis=context_axis)
            extra.update(off_policy)
        loss, metrics = loss_from_hidden(model.output_embedding(), out.hidden, inputs.pred,
                                         out.aux_loss, inputs, objective, vocab_axis=vocab_axis,
                                         context_axis=context_axis)
        return loss + mtp, dict(metrics, **extra)
    values, critic_aux = model.values(inputs, out)
    inputs, v_loss = critic_objective(values, inputs, objective.critic,
                                      context_axis=context_axis)
    loss, metrics = loss_from_hidden(model.output_embedding(), out.hidden, inputs.pred,
                                     out.aux_loss + critic_aux, inputs, objective,
                                     vocab_axis=vocab_axis, context_axis=context_axis)
    return (loss + objective.critic.value_coef * v_loss + mtp,
            dict(metrics, value_loss=v_loss, **extra))


def mtp_loss(model: Any, out: Any, inputs: DeviceBatch, objective: Objective, *,
             vocab_axis: str | None = None) -> jax.Array:
    """The multi-token-prediction loss, averaged over the depths (docs/design.md, "Multi-token
    prediction on trees"): depth d's state at pred(k) scores token k with the main head, at
    temperature 1, and the term -W_k log q_d(t_k) counts where k has at least d + 1 tokens above
    it on its path (pos_k > d; the first d + 1 tokens of a path have no depth-d prediction).
    W is the main loss's weight of the token (its SFT weight under any objective), so the sum
    over tree tokens is the sum over paths of each path's MTP loss. `out`: the model's
    `ModelOutput`, whose `mtp` holds each depth's states."""
    if out.mtp is None or len(out.mtp) != objective.mtp_depth:
        have = 0 if out.mtp is None else len(out.mtp)
        raise ValueError(f"objective.mtp_weight: needs a model with MTP modules of depth "
                         f"{objective.mtp_depth} (mtp_depth of CausalLM), this one has {have}")
    w_out, tokens, pred = model.output_embedding(), inputs.tokens, inputs.pred
    weight, pos, index = inputs.coefficients.weight, jnp.asarray(inputs.pos), inputs.score_index
    if index is not None:  # only the tokens the main loss scores can carry a weight
        weight = gather_scored(inputs.coefficients, index).weight
        pos = jnp.take_along_axis(pos, jnp.where(index >= 0, index, 0), axis=-1)
    total = jnp.zeros((), jnp.float32)
    for d, states in enumerate(out.mtp, start=1):
        if index is None:
            logp, _ = logprobs_from_hidden(states, w_out, tokens, pred,
                                           chunk=objective.logprob_chunk, vocab_axis=vocab_axis)
        else:
            logp, _ = scored_logprobs(states, w_out, tokens, pred, index,
                                      chunk=objective.logprob_chunk, vocab_axis=vocab_axis)
        total = total - jnp.sum(jnp.where(pos > d, weight * logp, 0.0))
    return total / len(out.mtp)


def critic_objective(token_values: jax.Array, inputs: DeviceBatch, critic: CriticConfig, *,
                     context_axis: str | None = None) -> tuple[DeviceBatch, jax.Array]:
    """PPO with a critic on one micro-batch: `inputs` with the policy's P/N from the per-path
    GAE advantages, and the clipped value loss (`jtree.objectives.critic`, docs/rl.md). The old values are
    the current ones without gradient: the step's parameters are the policy's before the update,
    as for recomputed old log-probs.

    Under context parallelism (`context_axis`) the pairs are the whole rows' (not split): the
    values and `pred` are gathered over the axis, every device runs the rows' GAE, and each
    keeps the pairs whose token it holds (its P/N and its share of the value loss)."""
    pairs = inputs.pairs
    if pairs is None or pairs.reward is None:
        raise ValueError("inputs: critic 'pairs' missing; objective.critic needs "
                         "jtree.objectives.pairs.with_pairs on the batch")
    s = inputs.tokens.shape[-1]
    pred, local_pairs = inputs.pred, pairs
    if context_axis is not None:
        token_values = gathered_row(token_values, context_axis)
        pred = gathered_row(pred, context_axis)
        index = local_index(pairs.index, s, context_axis)
        local_pairs = dataclasses.replace(pairs, index=index,
                                          coef=jnp.where(index >= 0, pairs.coef, 0.0))
    values = pair_values(token_values, pred, pairs)
    old = jax.lax.stop_gradient(values)
    advantages, returns = gae(old, pairs, critic.gamma, critic.lam)
    ca = local_pairs.coef * advantages
    inputs = inputs.with_coefficients(
        adv_pos=pair_token_sums(jnp.where(ca >= 0, ca, 0.0), local_pairs, s),
        adv_neg=pair_token_sums(jnp.where(ca < 0, ca, 0.0), local_pairs, s))
    return inputs, value_loss(values, old, returns, local_pairs.coef, critic.value_clip)


def loss_from_hidden(w_out: jax.Array, hidden: jax.Array, pred: jax.Array, aux_loss: jax.Array,
                     inputs: DeviceBatch, objective: Objective, *,
                     vocab_axis: str | None = None, context_axis: str | None = None):
    """`objective_loss` from final hidden states: token i is scored by row `pred[i]` of `hidden`
    (a part of a partitioned tree puts the hidden state of the token above it first). With
    `context_axis`, `hidden` is this device's slice of the row and the states of other devices
    that its tokens are scored by come through the halo (`jtree.parallel.context.scoring_view`).
    Log-probs and entropies are at `objective.temperature` (`jtree.objectives.logprobs`); with
    `objective.distill` the loss adds its reverse KL to the teacher (`distill_term`)."""
    want_entropy = objective.kind != "sft" and objective.entropy_coef != 0
    coefficients = inputs.coefficients
    score_index = inputs.score_index
    if context_axis is not None:
        hidden, pred, score_index = scoring_view(hidden, pred, inputs.halo, score_index,
                                                 context_axis)
    if score_index is not None:  # score only the tokens with a loss coefficient
        logp, entropy = scored_logprobs(
            hidden, w_out, inputs.tokens, pred,
            score_index, chunk=objective.logprob_chunk, with_entropy=want_entropy,
            vocab_axis=vocab_axis, temperature=objective.temperature,
        )
        if objective.kind == "gspo":  # path sums run over the layout: the scored values at [.., S]
            logp, entropy = (None if x is None else
                             scatter_scored(x, score_index, inputs.tokens.shape[-1])
                             for x in (logp, entropy))
        else:
            coefficients = gather_scored(coefficients, score_index)
    else:
        logp, entropy = logprobs_from_hidden(
            hidden, w_out, inputs.tokens, pred,
            chunk=objective.logprob_chunk, with_entropy=want_entropy, vocab_axis=vocab_axis,
            temperature=objective.temperature,
        )
    if objective.kind == "sft":
        loss = sft_loss(logp, coefficients)
        metrics = {"nll": loss}
    else:
        rl = dict(clip_low=objective.clip_low, clip_high=objective.clip_high,
                  kl_coef=objective.kl_coef, entropy=entropy, entropy_coef=objective.entropy_coef)
        if objective.kind == "gspo":
            loss, metrics = path_level_loss(logp, coefficients, inputs.mask.end, rl,
                                            context_axis)
            pos, neg = coefficients.seq_pos, coefficients.seq_neg
        else:
            loss, metrics = ppo_loss(logp, coefficients, **rl)
            pos, neg = coefficients.adv_pos, coefficients.adv_neg
        abs_adv = jnp.sum(jnp.abs(pos) + jnp.abs(neg))
        metrics = dict(metrics, abs_adv=abs_adv, clipped_adv=metrics.pop("clip_frac") * abs_adv,
                       **logprob_gap_sums(logp, coefficients.old_logprobs, coefficients.weight))
        if objective.distill is not None:
            metrics["distill_kl"] = distill_term(w_out, hidden, pred, score_index, logp,
                                                 coefficients, inputs, objective, vocab_axis)
            loss = loss + objective.distill.coef * metrics["distill_kl"]
    return loss + aux_loss, dict(metrics, aux_loss=aux_loss)


def distill_term(w_out: jax.Array, hidden: jax.Array, pred: jax.Array,
                 score_index: jax.Array | None, logp: jax.Array,
                 coefficients: LossCoefficients, inputs: DeviceBatch, objective: Objective,
                 vocab_axis: str | None = None) -> jax.Array:
    """`objective.distill`'s reverse KL to the teacher, sum_t W_t KL_t over the trained tokens
    (the per-path sum: KL_t depends on the token's prefix only). `sampled`: the sampled-token
    estimate from the loss's own log-probs `logp` and the coefficients they align with
    (`jtree.objectives.losses.distill_loss`). `full`: each scored token's whole-vocabulary KL
    against the batch's `teacher_dist` (`jtree.objectives.logprobs.full_reverse_kl`; over the
    vocabulary slices of `vocab_axis`), weighted by W read at the scored positions of the
    batch's own [rows, S] coefficients."""
    if objective.distill.estimator == "sampled":
        if coefficients.teacher_logprobs is None:
            raise ValueError("objective.distill: the batch carries no teacher log-probs (the "
                             "trainer's teacher forward sets them)")
        return distill_loss(logp, coefficients)
    if inputs.teacher_dist is None:
        raise ValueError("objective.distill: estimator full, but the batch carries no teacher "
                         "distributions (the trainer's teacher forward sets them)")
    rows, s = pred.shape
    index = (jnp.broadcast_to(jnp.arange(s, dtype=pred.dtype), (rows, s))
             if score_index is None else score_index)
    kl = full_reverse_kl(hidden, w_out, pred, inputs.teacher_dist, index,
                         chunk=objective.logprob_chunk, temperature=objective.temperature,
                         vocab_axis=vocab_axis)
    weight = gather_scored(inputs.coefficients, index).weight
    return jnp.sum(weight * kl)


def logprob_gap_sums(logp: jax.Array, old_logprobs: jax.Array, weight: jax.Array
                     ) -> dict[str, jax.Array]:
    """|trainer - engine| log-prob summed over the trained tokens (weight > 0), and their count
    (`finish_metrics` makes it the mean `engine_logprob_gap`). On on-policy data the old
    log-probs are the engine's, and before the step's update the trainer's are those of the same
    policy: a gap far above numerical noise means the engine scored another distribution (a
    sampling temperature other than `objective.temperature`, or raw instead of processed
    log-probs; docs/rl.md, "Sampling temperature")."""
    trained = weight > 0
    return {"engine_logprob_gap": jnp.sum(jnp.where(trained, jnp.abs(logp - old_logprobs), 0.0)),
            "engine_gap_tokens": jnp.sum(trained.astype(jnp.float32))}


def path_level_loss(logp: jax.Array, coefficients: LossCoefficients, end: jax.Array,
                    rl: dict[str, Any], context_axis: str | None
                    ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`gspo_loss` on [rows, S] per-token values; under context parallelism on the rows
    gathered over `context_axis` (log-probs, entropies, coefficients and `end`: a float or int
    per token), each device summing the terms of the tokens it holds."""
    if context_axis is None:
        return gspo_loss(logp, coefficients, end, **rl)
    length = logp.shape[-1]
    row = functools.partial(gathered_row, axis=context_axis)
    coefficients = jax.tree_util.tree_map(row, coefficients)
    end = row(end)
    rl = dict(rl, entropy=None if rl["entropy"] is None else row(rl["entropy"]))
    return gspo_loss(row(logp), coefficients, end,
                     owned=owned(end.shape[-1], length, context_axis), **rl)


def gather_scored(coefficients: LossCoefficients, index: jax.Array) -> LossCoefficients:
    """The loss coefficients at `score_index` [rows, K] (0 on empty slots), so the losses of
    `jtree.objectives.losses` run on the scored tokens only."""
    at = jnp.where(index >= 0, index, 0)
    return jax.tree_util.tree_map(
        lambda x: jnp.where(index >= 0, jnp.take_along_axis(x, at, axis=1), 0.0), coefficients)


def scatter_scored(values: jax.Array, index: jax.Array, seq_len: int) -> jax.Array:
    """[rows, K] values at `score_index` -> [rows, seq_len], 0 where nothing is scored (the
    inverse of `gather_scored` on the scored positions)."""
    at = jnp.where(index >= 0, index, seq_len)  # empty slots go past the end and are dropped
    return jax.vmap(lambda v, i: jnp.zeros(seq_len, v.dtype).at[i].set(v, mode="drop"))(
        values, at)


def normalize_coefficients(inputs: DeviceBatch, data_axes: Sequence[str] = ()) -> DeviceBatch:
    """Divide raw loss coefficients by the batch normalizer when the batch carries `row_norm`
    (the normalizer's per-row shares; summed over the row shards `data_axes` inside
    shard_map)."""
    if inputs.row_norm is None:
        return inputs
    total = jnp.sum(inputs.row_norm)
    if data_axes:
        total = jax.lax.psum(total, tuple(data_axes))
    scale = jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)
    c = inputs.coefficients
    if inputs.pairs is not None:
        inputs = dataclasses.replace(inputs, pairs=dataclasses.replace(
            inputs.pairs, coef=inputs.pairs.coef * scale))
    return dataclasses.replace(inputs, row_norm=None).with_coefficients(
        **{name: getattr(c, name) * scale for name in COEFFICIENT_FIELDS})


def finish_metrics(metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Turn summed metrics into reported ones (the clip fraction as a ratio of sums, the
    off-policy metrics as means over pairs, the engine log-prob gap as a mean over trained
    tokens)."""
    metrics = finish_off_policy_metrics(metrics)
    if "engine_gap_tokens" in metrics:
        metrics = dict(metrics)
        n = jnp.maximum(metrics.pop("engine_gap_tokens"), 1.0)
        metrics["engine_logprob_gap"] = metrics["engine_logprob_gap"] / n
    if "clipped_adv" not in metrics:
        return metrics
    metrics = dict(metrics)
    clipped, total = metrics.pop("clipped_adv"), metrics.pop("abs_adv")
    return dict(metrics, clip_frac=clipped / jnp.maximum(total, 1e-30))


def zero_sums(loss: Any, metrics: Any, params: Any) -> tuple[jax.Array, Any, Any]:
    """Zero (loss, metrics, grads) to add micro-batch or part results to: `loss` and `metrics` as
    arrays or `jax.ShapeDtypeStruct`s, the gradients shaped like `params`."""
    def zeros(x: Any) -> jax.Array:
        return jnp.zeros(x.shape, x.dtype)

    return (zeros(loss), jax.tree_util.tree_map(zeros, metrics),
            jax.tree_util.tree_map(jnp.zeros_like, params))
