"""The compiled training step: gradients accumulated over micro-batches, and the optimizer update.

The step is a pure function of (TrainState, inputs) so it can be jitted on one device, or run over
a ('data', 'fsdp', 'context', 'model') mesh (`make_sharded_grad_fn`: data parallel over rows,
parameters and optimizer state fully sharded over `fsdp` and gathered per layer, each row's
tokens split over `context` (`jtree.parallel.context`), Megatron tensor parallel inside
`shard_map`, optax update outside it under the same `jit`). `inputs` is a
`jtree.layout.batch.DeviceBatch` of [micro_batches, rows, S] arrays; the micro-batches are scanned
and their gradients summed, which equals the full-batch gradient because every loss coefficient is
normalized over the global batch (`jtree.objectives.objective.normalize_coefficients`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jtree.config.objective import Objective
from jtree.layout.batch import DeviceBatch
from jtree.models.decoder import CausalLM
from jtree.models.layers import FSDP_GATHER, fsdp_gathered
from jtree.models.lora import model_params, trainable, with_trainable
from jtree.objectives.logprobs import token_distributions, token_logprobs
from jtree.objectives.objective import (
    finish_metrics,
    normalize_coefficients,
    objective_loss,
    zero_sums,
)
from jtree.parallel.sharding import (
    CONTEXT,
    FSDP,
    MODEL,
    ROWS,
    batch_specs,
    context_size,
    param_path,
    token_spec,
    vary_over,
    varying_axes,
)
from jtree.step.optimizer import TrainState, apply_gradients


def make_grad_fn(graphdef: nnx.GraphDef, objective: Objective, *,
                 data_axes: Sequence[str] = (), context_axis: str | None = None,
                 vocab_axis: str | None = None, metric_sums: bool = False) -> Callable:
    """(params, inputs [M, rows, S]) -> (loss, metrics, grads), summed over the M micro-batches.
    With `metric_sums` the metrics stay the sums they are accumulated as (`finish_metrics` turns
    them into ratios and means): for a caller that adds the results of several calls, as the
    redundancy-free executor adds whole-tree micro-batches to its parts.

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
        return loss, metrics if metric_sums else finish_metrics(metrics), grads

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
                                               critic=critic,
                                               mtp_depth=0 if model.mtp is None
                                               else model.mtp.depth))
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


def make_logprob_fn(graphdef: nnx.GraphDef, chunk: int = 1024, temperature: float = 1.0
                    ) -> Callable[[Any, DeviceBatch], jax.Array]:
    """(params, inputs [rows, S]) -> token log-probs [rows, S] at `temperature` (the objective's,
    so they compare with the loss's); no gradient, for old/ref policies."""

    def fn(params: Any, inputs: DeviceBatch) -> jax.Array:
        model = nnx.merge(graphdef, model_params(params))
        return jax.lax.stop_gradient(token_logprobs(model, inputs, chunk=chunk,
                                                    temperature=temperature))

    return fn


def make_sharded_logprob_fn(graphdef: nnx.GraphDef, mesh: jax.sharding.Mesh, specs: Any,
                            chunk: int = 1024, temperature: float = 1.0, *,
                            full_vocabulary: bool = False
                            ) -> Callable[[Any, DeviceBatch], jax.Array]:
    """(params, inputs [M, rows, S]) -> token log-probs [M, rows, S] at `temperature` over the
    mesh, no gradient (old/reference policies, distillation teachers, equivalence checks).
    `full_vocabulary`: each token's whole log-softmax instead, [M, rows, S, vocab]
    (`jtree.objectives.logprobs.token_distributions`). `graphdef` is
    `sharded_graphdef`'s."""

    def local(params: Any, inputs: DeviceBatch) -> jax.Array:
        # The model is merged inside the map's body: an FSDP layer's gather runs under
        # `nnx.remat`, which cannot update variables created outside the trace it runs in.
        def one(x: DeviceBatch) -> jax.Array:
            model = merged_model(graphdef, model_params(params))
            if full_vocabulary:
                return token_distributions(model, x, temperature=temperature,
                                           vocab_axis=MODEL)
            return token_logprobs(model, x, chunk=chunk, vocab_axis=MODEL,
                                  temperature=temperature)

        return jax.lax.map(one, inputs)

    # Each device's slice of the vocabulary, laid over `model`.
    out_specs = (jax.sharding.PartitionSpec(*token_spec(), MODEL) if full_vocabulary
                 else token_spec())

    def fn(params: Any, inputs: DeviceBatch) -> jax.Array:
        in_specs = (specs, batch_specs(inputs))
        out = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(
            params, inputs)
        return jax.lax.stop_gradient(out)

    return fn


