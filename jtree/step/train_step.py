"""Training step: objectives, optimizer, gradient accumulation over micro-batches, mesh sharding.

The step is a pure function of (TrainState, inputs) so it can be jitted on one device, or run over
a ('data', 'fsdp', 'context', 'model') mesh (`make_sharded_grad_fn`: data parallel over rows,
parameters and optimizer state fully sharded over `fsdp` and gathered per layer, each row's
tokens split over `context` (`jtree.parallel.context`), Megatron tensor parallel inside
`shard_map`, optax update outside it under the same `jit`). `inputs` is a
`jtree.layout.batch.DeviceBatch` of [micro_batches, rows, S] arrays; the micro-batches are scanned and
their gradients summed, which equals the full-batch gradient because every loss coefficient is
normalized over the global batch.

Normalization: either the coefficients arrive normalized (host-side `normalizer`, as `linearize`
does by default), or they arrive raw (`normalizer=1`) together with `row_norm` [micro_batches,
rows], each row's share of the batch normalizer; the step then divides by the sum over all rows,
micro-batches and data shards. The second form lets every host linearize its own trees without
knowing the global batch (`jtree.training.pipeline`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jtree.layout.baseline import linearize_baseline
from jtree.layout.batch import DeviceBatch, LossCoefficients, stack
from jtree.parallel.context import gathered_row, local_index, owned, scoring_view
from jtree.config.objective import CriticConfig
from jtree.objectives.critic import critic_update_scale, gae, pair_token_sums, pair_values
from jtree.layout.linearize import TreeBatch, linearize
from jtree.objectives.logprobs import logprobs_from_hidden, scored_logprobs, token_logprobs
from jtree.objectives.losses import COEFFICIENT_FIELDS, gspo_loss, ppo_loss, sft_loss, value_loss
from jtree.config.objective import Normalization
from jtree.models.decoder import CausalLM
from jtree.models.lora import model_params, trainable, with_trainable
from jtree.layout.microbatches import same_score_len
from jtree.models.layers import FSDP_GATHER, fsdp_gathered
from jtree.parallel.sharding import (
    CONTEXT, FSDP, MODEL, ROWS, batch_specs, context_size, param_path, token_spec, varying_axes, vary_over,
)
from jtree.trees.tree import TrajectoryTree
from jtree.config.objective import Objective
from jtree.config.objective import OptimConfig


def make_optimizer(cfg: OptimConfig, critic_learning_rate: float | None = None
                   ) -> optax.GradientTransformation:
    """AdamW after global-norm clipping. With `critic_learning_rate` (`objective.critic.
    learning_rate`) the critic's updates are scaled to that peak rate (`jtree.objectives.critic.
    critic_update_scale`)."""
    steps = [clip_by_global_norm(cfg.clip_norm),
             optax.adamw(make_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                         weight_decay=cfg.weight_decay)]
    if critic_learning_rate is not None:
        steps.append(critic_update_scale(critic_learning_rate, cfg.learning_rate))
    return optax.chain(*steps)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """Scale the updates to global norm at most `max_norm`, by one scalar factor.

    Same rule and (empty) state as `optax.clip_by_global_norm`, which divides every element by the
    norm: XLA keeps that per-element division as its own pass writing a clipped copy of the
    gradients (a fused divide is not duplicated into the two moment updates that read it). A
    multiply by a precomputed scalar fuses into the AdamW moment updates instead: one pass over
    the gradients fewer and no gradient-sized temporary, a per-step cost that does not shrink with
    the tokens (~15% of the update on the bench's 4.5M-parameter model). Unclipped steps are
    bit-identical; clipped ones differ by rounding (t * (max / norm) vs t / norm * max).
    """

    def update_fn(updates: Any, state: Any, params: Any = None):
        del params
        norm = optax.tree.norm(updates)
        scale = jnp.where(norm < max_norm, 1.0, max_norm / norm)
        return jax.tree.map(lambda t: t * scale.astype(t.dtype), updates), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def make_schedule(cfg: OptimConfig) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.learning_rate,
        warmup_steps=cfg.warmup_steps,
        decay_steps=max(cfg.decay_steps, cfg.warmup_steps + 1),
        end_value=cfg.learning_rate * cfg.min_lr_ratio,
    )


class TrainState(NamedTuple):
    params: Any
    opt_state: Any
    step: jax.Array


def init_train_state(model: nnx.Module, optimizer: optax.GradientTransformation):
    """Split an NNX model into its graph definition and a pure TrainState."""
    graphdef, params = nnx.split(model)
    return graphdef, TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32))


def objective_loss(model: Any, inputs: DeviceBatch, objective: Objective, *,
                   vocab_axis: str | None = None):
    """The objective on one micro-batch, plus the model's auxiliary loss: (loss, metrics).

    Metrics are sums (so they add over micro-batches and devices); the PPO clip fraction is
    carried as its numerator `clipped_adv` and denominator `abs_adv` (see `finish_metrics`).
    Under context parallelism (the model's `runtime.context_axis`) `inputs` is this device's
    slice of the rows and the sums are the slice's (`jtree.parallel.context`).
    """
    context_axis = model.runtime.context_axis
    out = model(inputs)
    if objective.critic is None:
        return loss_from_hidden(model.output_embedding(), out.hidden, inputs.pred, out.aux_loss,
                                inputs, objective, vocab_axis=vocab_axis,
                                context_axis=context_axis)
    values, critic_aux = model.values(inputs, out)
    inputs, v_loss = critic_objective(values, inputs, objective.critic,
                                      context_axis=context_axis)
    loss, metrics = loss_from_hidden(model.output_embedding(), out.hidden, inputs.pred,
                                     out.aux_loss + critic_aux, inputs, objective,
                                     vocab_axis=vocab_axis, context_axis=context_axis)
    return loss + objective.critic.value_coef * v_loss, dict(metrics, value_loss=v_loss)


def critic_objective(token_values: jax.Array, inputs: DeviceBatch, critic: CriticConfig, *,
                     context_axis: str | None = None) -> tuple[DeviceBatch, jax.Array]:
    """PPO with a critic on one micro-batch: `inputs` with the policy's P/N from the per-path
    GAE advantages, and the clipped value loss (`jtree.objectives.critic`, docs/rl.md). The old values are
    the current ones without gradient: the step's parameters are the policy's before the update,
    as for recomputed old log-probs.

    Under context parallelism (`context_axis`) the pairs are the whole rows' (not split): the
    values and `pred` are gathered over the axis, every device runs the rows' GAE, and each
    keeps the pairs whose token it holds (its P/N and its share of the value loss)."""
    pairs = inputs.critic
    if pairs is None:
        raise ValueError("inputs: 'critic' pairs missing; objective.critic needs "
                         "jtree.objectives.critic.with_critic_pairs on the batch")
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
    that its tokens are scored by come through the halo (`jtree.parallel.context.scoring_view`)."""
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
            vocab_axis=vocab_axis,
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
        metrics = dict(metrics, abs_adv=abs_adv, clipped_adv=metrics.pop("clip_frac") * abs_adv)
    return loss + aux_loss, dict(metrics, aux_loss=aux_loss)


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


def finish_metrics(metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Turn summed metrics into reported ones (the clip fraction as a ratio of sums)."""
    if "clipped_adv" not in metrics:
        return metrics
    metrics = dict(metrics)
    clipped, total = metrics.pop("clipped_adv"), metrics.pop("abs_adv")
    return dict(metrics, clip_frac=clipped / jnp.maximum(total, 1e-30))


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
    if inputs.critic is not None:
        inputs = dataclasses.replace(inputs, critic=dataclasses.replace(
            inputs.critic, coef=inputs.critic.coef * scale))
    return dataclasses.replace(inputs, row_norm=None).with_coefficients(
        **{name: getattr(c, name) * scale for name in COEFFICIENT_FIELDS})


def make_grad_fn(graphdef: nnx.GraphDef, objective: Objective, *,
                 data_axes: Sequence[str] = (), context_axis: str | None = None,
                 vocab_axis: str | None = None) -> Callable:
    """(params, inputs [M, rows, S]) -> (loss, metrics, grads), summed over the M micro-batches.

    The gradients are those of the trainable parameters (`jtree.models.lora.trainable`: the
    adapters of a LoRA run, else all). Inside shard_map, `data_axes` names the mesh axes the rows
    are split over: gradients are accumulated per device over all micro-batches and summed over
    those axes once at the end, each over the axes its parameter is not sharded over (a parameter
    sharded over `fsdp` has its gradient reduce-scattered over `fsdp` by the transpose of its
    gather, per micro-batch, since its accumulator is sharded too). `vocab_axis` names the
    tensor-parallel axis when the output embedding is vocab-parallel. `context_axis` names the
    axis each row's tokens are split over (context parallelism): loss, metrics and gradients are
    token sums, so they are summed over it too, while the rows' normalizer shares are not (every
    device of the axis holds the whole row's `row_norm`).
    """
    row_axes = tuple(data_axes)
    data_axes = row_axes + (() if context_axis is None else (context_axis,))

    def micro(params: Any, inputs: DeviceBatch):
        def loss_fn(t: Any):
            model = merged_model(graphdef, model_params(with_trainable(params, t)))
            return objective_loss(model, inputs, objective, vocab_axis=vocab_axis)

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable(params))
        return loss, metrics, grads

    def grad_fn(params: Any, inputs: DeviceBatch):
        inputs = normalize_coefficients(inputs, row_axes)
        # The row axes each gradient still has to be summed over: those its parameter is
        # replicated over (not `fsdp` where it is sharded over `fsdp`).
        sum_axes = jax.tree_util.tree_map(
            lambda x: tuple(a for a in data_axes if a not in varying_axes(x)), trainable(params))
        if data_axes:
            params = vary_over(params, data_axes)
        # Every micro-batch goes through the scan from a zero total (0 + x is exact, so the sum
        # is the same as starting from the first one). A scan of one step is removed by XLA, and
        # with the first micro-batch peeled off, two micro-batches used to compile as one flat
        # program holding both micro-batches' activations at once.
        first = jax.tree_util.tree_map(lambda x: x[0], inputs)
        loss_shape, metrics_shape, _ = jax.eval_shape(micro, params, first)
        zero = zero_sums(loss_shape, metrics_shape, trainable(params))
        if data_axes:  # the gradients' zeros already vary like the parameters
            zero = (*vary_over(zero[:2], data_axes), zero[2])

        def body(acc, mb):
            return jax.tree_util.tree_map(jnp.add, acc, micro(params, mb)), None

        (loss, metrics, grads), _ = jax.lax.scan(body, zero, inputs)
        if data_axes:
            loss, metrics = jax.lax.psum((loss, metrics), data_axes)
            grads = jax.tree_util.tree_map(
                lambda g, axes: jax.lax.psum(g, axes) if axes else g, grads, sum_axes)
        return loss, finish_metrics(metrics), grads

    return grad_fn


def merged_model(graphdef: nnx.GraphDef, params: Any) -> CausalLM:
    """The model on (this device's shard of) `params`, its parameters outside the decoder layers
    (embedding, head, final norm) gathered over FSDP for the whole forward and backward: the
    embedding is read at both ends of the forward when tied, and each is one
    [vocab / tensor-parallel, hidden] table. Each decoder layer gathers its own weights where it
    runs (`jtree.models.layers.call_layer`). Without FSDP this is `nnx.merge`.

    The parameters are merged as plain arrays, so every Variable takes its metadata from
    `graphdef` (`sharded_graphdef` marks what FSDP gathers) rather than from `params`."""
    model = nnx.merge(graphdef, nnx.to_pure_dict(params))
    layers = nnx.Any(nnx.PathContains("layers"), nnx.PathContains("blocks"))  # scanned: blocks
    return fsdp_gathered(model, skip=layers)


def zero_sums(loss: Any, metrics: Any, params: Any) -> tuple[jax.Array, Any, Any]:
    """Zero (loss, metrics, grads) to add micro-batch or part results to: `loss` and `metrics` as
    arrays or `jax.ShapeDtypeStruct`s, the gradients shaped like `params`."""
    def zeros(x: Any) -> jax.Array:
        return jnp.zeros(x.shape, x.dtype)

    return (zeros(loss), jax.tree_util.tree_map(zeros, metrics),
            jax.tree_util.tree_map(jnp.zeros_like, params))


def make_sharded_grad_fn(graphdef: nnx.GraphDef, objective: Objective, mesh: jax.sharding.Mesh,
                         specs: Any) -> Callable:
    """`make_grad_fn` over a ('data', 'fsdp', 'context', 'model') mesh: rows split over `data`
    and `fsdp`, their tokens over `context`, parameters laid out by `specs`
    (`jtree.parallel.sharding.param_specs`), `graphdef` the model for shard_map (`sharded_graphdef` of
    the same specs and mesh). Returns global loss, metrics and gradients (sharded like the
    parameters)."""
    # Sums run over `context` on every mesh: the batch is split over it (a no-op of size 1).
    local = make_grad_fn(graphdef, objective, data_axes=ROWS, vocab_axis=MODEL,
                         context_axis=CONTEXT)
    P = jax.sharding.PartitionSpec

    def grad_fn(params: Any, inputs: DeviceBatch):
        in_specs = (specs, batch_specs(inputs))
        out_specs = (P(), P(), trainable(specs))
        return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(
            params, inputs)

    return grad_fn


def sharded_graphdef(model: CausalLM, specs: Any, mesh: jax.sharding.Mesh) -> nnx.GraphDef:
    """The graph of `model` to merge with per-device parameter shards laid out by `specs`
    inside shard_map on `mesh`: its tensor-parallel hook on (`tensor_parallel_axis='model'`),
    on a mesh with `context` > 1 its context-parallel hook (`context_axis='context'`),
    batch-level statistics of the loss (the MoE router loss) pooled over the axes the tokens are
    split over (`data_parallel_axis`: 'data', 'fsdp' and, under context parallelism,
    'context'), and every parameter that `specs` shards over `fsdp` marked with the dimension to
    gather (`jtree.models.layers.FSDP_GATHER`, counted from the end). Built abstractly: no
    weights."""
    context = CONTEXT if context_size(mesh) > 1 else None
    runtime = dataclasses.replace(
        model.runtime, tensor_parallel_axis=MODEL, context_axis=context,
        data_parallel_axis=ROWS + (() if context is None else (context,)))
    critic = None if model.critic is None else model.critic.config
    abstract = nnx.eval_shape(lambda: CausalLM(model.config, runtime, rngs=nnx.Rngs(0),
                                               value_head=model.value_head is not None,
                                               critic=critic))
    by_name = {param_path(path): spec for path, spec in jax.tree_util.tree_leaves_with_path(
        specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))}
    for path, var in nnx.iter_graph(abstract):
        if not isinstance(var, nnx.Param):
            continue
        spec = tuple(by_name["/".join(str(p) for p in path)])
        if FSDP in spec:
            var.set_metadata(FSDP_GATHER, (FSDP, spec.index(FSDP) - var.ndim))
    return nnx.split(abstract)[0]


def make_train_step(
    graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, objective: Objective, *,
    grad_fn: Callable | None = None,
) -> Callable[[TrainState, DeviceBatch], tuple[TrainState, dict[str, jax.Array]]]:
    """The (unjitted) train step; callers jit it. `grad_fn` defaults to the single-device
    `make_grad_fn`; pass `make_sharded_grad_fn(...)` to run over a mesh."""
    grad_fn = grad_fn or make_grad_fn(graphdef, objective)
    apply = apply_gradients(optimizer)

    def step(state: TrainState, inputs: DeviceBatch):
        return apply(state, *grad_fn(state.params, inputs))

    return step


def apply_gradients(optimizer: optax.GradientTransformation) -> Callable[
        [TrainState, jax.Array, dict[str, jax.Array], Any],
        tuple[TrainState, dict[str, jax.Array]]]:
    """(state, loss, metrics, grads) -> (next state, metrics with loss and grad norm): the update
    half of a train step, for steps whose gradients come from elsewhere (`jtree.partitioning.redundancy_free`). Only
    the trainable parameters (`jtree.models.lora.trainable`) have gradients and change."""

    def apply(state: TrainState, loss: jax.Array, metrics: dict[str, jax.Array], grads: Any):
        current = trainable(state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, current)
        params = with_trainable(state.params, optax.apply_updates(current, updates))
        metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
        return TrainState(params, opt_state, state.step + 1), metrics

    return apply


def make_logprob_fn(graphdef: nnx.GraphDef, chunk: int = 1024
                    ) -> Callable[[Any, DeviceBatch], jax.Array]:
    """(params, inputs [rows, S]) -> token log-probs [rows, S]; no gradient, for old/ref policies."""

    def fn(params: Any, inputs: DeviceBatch) -> jax.Array:
        model = nnx.merge(graphdef, model_params(params))
        return jax.lax.stop_gradient(token_logprobs(model, inputs, chunk=chunk))

    return fn


def make_sharded_logprob_fn(graphdef: nnx.GraphDef, mesh: jax.sharding.Mesh, specs: Any,
                            chunk: int = 1024) -> Callable[[Any, DeviceBatch], jax.Array]:
    """(params, inputs [M, rows, S]) -> token log-probs [M, rows, S] over the mesh, no gradient
    (old/reference policies, equivalence checks). `graphdef` is `sharded_graphdef`'s."""

    def local(params: Any, inputs: DeviceBatch) -> jax.Array:
        # The model is merged inside the map's body: an FSDP layer's gather runs under
        # `nnx.remat`, which cannot update variables created outside the trace it runs in.
        def one(x: DeviceBatch) -> jax.Array:
            model = merged_model(graphdef, model_params(params))
            return token_logprobs(model, x, chunk=chunk, vocab_axis=MODEL)

        return jax.lax.map(one, inputs)

    def fn(params: Any, inputs: DeviceBatch) -> jax.Array:
        in_specs = (specs, batch_specs(inputs))
        out = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=token_spec())(
            params, inputs)
        return jax.lax.stop_gradient(out)

    return fn


def state_shardings(optimizer: optax.GradientTransformation, params: Any, param_shardings: Any,
                    mesh: jax.sharding.Mesh) -> TrainState:
    """Shardings of a TrainState: optimizer moments like their (trainable) parameters, scalars
    replicated."""
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    opt_shapes = jax.eval_shape(optimizer.init, trainable(params))
    opt = optax.tree_map_params(optimizer, lambda _, s: s, opt_shapes, trainable(param_shardings),
                                transform_non_params=lambda _: replicated)
    return TrainState(param_shardings, opt, replicated)


def build_batch(
    trees: Sequence[TrajectoryTree],
    seq_len: int,
    *,
    mode: Literal["tree", "baseline"],
    normalization: Normalization,
    normalizer: float | None = None,
    n_rows: int | None = None,
    len_buckets: Sequence[int] | None = None,
    gdn_chunk_size: int | None = None,
    gdn_chunks: int | None = None,
) -> TreeBatch:
    """Linearize `trees` in tree mode or as the per-path baseline.

    Pass `normalizer` (from `jtree.objectives.losses.batch_normalizer` over the whole step) when `trees` is one
    micro-batch of a larger step, so the micro-batch losses sum to the step loss. Models with
    linear-attention layers need `gdn_chunk_size` (chunk tables) and, for micro-batches that must
    stack, one `gdn_chunks` for all of them (see `jtree.layout.gdn_tables.default_chunk_count`).
    """
    fn = {"tree": linearize, "baseline": linearize_baseline}.get(mode)
    if fn is None:
        raise ValueError(f"mode: {mode!r} is not 'tree' or 'baseline'")
    return fn(trees, seq_len, normalization=normalization, normalizer=normalizer, n_rows=n_rows,
              len_buckets=len_buckets, gdn_chunk_size=gdn_chunk_size, gdn_chunks=gdn_chunks)


def stack_microbatches(batches: Sequence[TreeBatch]) -> DeviceBatch:
    """Stack equally shaped batches into [M, rows, S] step inputs (one `score_index` width)."""
    shapes = {b.shape for b in batches}
    if len(shapes) != 1:
        raise ValueError(f"micro-batches must share one shape, got {sorted(shapes)}")
    return stack([b.inputs for b in same_score_len(batches)])


def needs_old_logprobs(batch: TreeBatch, objective: Objective) -> bool:
    """Whether the PPO step must recompute old log-probs on the tree before the update.

    Per-path old log-probs from a rollout engine can disagree on shared tokens; then the clipped
    surrogate is no longer a function of one ratio per tree token, and the documented policy is to
    recompute them with the current (pre-update) parameters on the tree.
    """
    return old_logprobs_stale(batch.has_old_logprobs, batch.old_logprob_disagreement, objective)


def old_logprobs_stale(has_old: bool, disagreement: float, objective: Objective) -> bool:
    """`needs_old_logprobs` from a batch's flags (missing, or disagreeing beyond tolerance)."""
    if objective.kind == "sft":
        return False
    return not has_old or disagreement > objective.old_logprob_tolerance
