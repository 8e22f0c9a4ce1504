"""Running a redundancy-free program: parts in post-order over a stack of prefixes.

Each part runs once forward with the prefix gathered from its parent's outputs (keys/values per
attention layer, conv context and state per GDN layer, the hidden state of the attach token; a
part at the top of a tree reads an all-padding prefix of zeros) and returns, besides its loss, the
same per-token tensors for its own tokens. Its children run next, each subtree to completion, in
the order of `jtree.partitioning.redundancy_free.schedule.child_order`; the cotangents they produce for their prefixes
are mapped back onto this part's outputs and onto its own prefix. Then the part's backward runs
once, fed with the cotangent of its loss (1) and the accumulated cotangents of its outputs, and
hands the cotangent of its prefix up to its parent the same way. Every tree token is computed once
forward and once backward, and the gradients are those of the unpartitioned tree. Live buffers:
those of the parts on one chain from a root part to the running part (`LiveBuffers` records them
at every device call, `RedundancyFreeStep.live`).

`prefix_backward` chooses how a part with children gets its backward:
- `"residuals"`: keep the residuals of its forward (its `jax.vjp`, returned from the jitted
  forward as a pytree) while its children run, then apply it in one jitted backward call. Live
  memory: the residuals of the parts on the stack.
- `"recompute"`: run the forward without residuals first (only the outputs children need), and
  forward again with residuals for the backward once the children are done. Live memory: one
  part's residuals plus the prefixes and outputs on the stack; costs one more forward per part
  with children.
- `"auto"` (default): residuals for a part whose children are all leaf parts (its residuals are
  held only while single leaf calls run), recompute for the parts above. Live memory: at most one
  part's residuals (plus a leaf call's), at one more forward only for parts with grandchildren
  (few: the parts near the roots).
Parts without children always run forward and backward in one jitted call.

Trees that fit in a row (`RfreeProgram.whole`) run as ordinary micro-batches through
`jtree.step.train_step.make_grad_fn`, one call each (so they compile per row shape, not per
micro-batch count). Gradients are summed in place as parts finish.

A MoE router load-balancing loss is pooled over the whole program (as one forward over the
unpartitioned trees would compute it): a forward-only pass collects the routing counts first, and
every part and micro-batch then adds its exact share (`jtree.models.moe.load_balancing_loss`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jtree.config.objective import Objective
from jtree.layout.batch import stack
from jtree.models.prefix import AttentionCache, GdnCache, LayerCache
from jtree.objectives.logprobs import logprobs_from_hidden
from jtree.objectives.objective import finish_metrics, loss_from_hidden, zero_sums
from jtree.partitioning.redundancy_free.layout import Member, PartBatch, RfreeProgram
from jtree.partitioning.redundancy_free.schedule import LiveBuffers, child_order
from jtree.step.train_step import make_grad_fn

PrefixBackward = Literal["residuals", "recompute", "auto"]


class PartPrefix(NamedTuple):
    """What a part reads from above: per-layer caches of its prefix and the attach token's final
    hidden state [R, d] (it scores the part's subtree tops)."""

    layers: tuple[LayerCache, ...]
    hidden: jax.Array


class PartOutput(NamedTuple):
    """What a part hands to its children: per-layer caches of its own tokens and their final
    hidden states [R, S, d]."""

    exports: tuple[LayerCache, ...]
    hidden: jax.Array


def _add(a: Any, b: Any) -> Any:
    return jax.tree_util.tree_map(jnp.add, a, b)


class RedundancyFreeStep:
    """Loss, metrics and gradients of a `RfreeProgram` (see module docstring).

    `on_call`, if given, is called before every device call as `on_call(name, fn, args)` with the
    jitted function and its arguments: memory probes read live buffers there and may lower `fn`
    for its temporary bytes. After a step, `live` holds what the executor held at each call.
    """

    def __init__(self, graphdef: nnx.GraphDef, objective: Objective, *,
                 prefix_backward: PrefixBackward = "auto",
                 on_call: Callable[[str, Any, tuple], None] | None = None):
        if prefix_backward not in ("residuals", "recompute", "auto"):
            raise ValueError(f"prefix_backward: {prefix_backward!r} is not 'residuals', "
                             "'recompute' or 'auto'")
        check_objective(objective)
        self.graphdef, self.objective = graphdef, objective
        self.prefix_backward = prefix_backward
        self.conv_width: int | None = None  # K - 1 of the GDN conv, read from the model config
        self.on_call = on_call or (lambda name, fn, args: None)
        self._forward = jax.jit(self._forward_saving_residuals)
        # The backward calls add their part's loss, metrics and gradients to the running total
        # (donated) and its prefix cotangent to the one its children gave (`d_below`).
        self._backward = jax.jit(self._backward_into, donate_argnums=(5,))
        self._outputs = jax.jit(lambda p, x, c: self._part_forward(p, x, c)[1])
        self._leaf = jax.jit(self._leaf_into, donate_argnums=(3,))
        self._forward_backward = jax.jit(self._forward_backward_into, donate_argnums=(5,))
        self._zeros: Callable | None = None  # params -> zero (loss, metrics, grads)
        self._extend = jax.jit(self._extend_prefix, static_argnums=(4,))
        self._extend_back = jax.jit(self._extend_transpose, static_argnums=(4,))
        self._accumulate = jax.jit(_add, donate_argnums=(0,))
        # Sums, added to the parts' sums and finished once (a clip fraction is a ratio of sums).
        self._whole = jax.jit(make_grad_fn(graphdef, objective, metric_sums=True))
        self._logprobs = jax.jit(self._part_logprobs)
        self._whole_logprobs = jax.jit(self._whole_batch_logprobs)
        self._pools_router: bool | None = None
        self._empty: dict[tuple, PartPrefix] = {}
        self.live = LiveBuffers()

    # ------------------------------------------------------------------ jitted pieces

    def _part_forward(self, params, inputs, prefix):
        return part_forward(nnx.merge(self.graphdef, params), inputs, prefix, self.objective)

    def _part_logprobs(self, params, inputs, prefix):
        """Forward only: log-probs [1, S], what children read, and the router load (or None)."""
        model = nnx.merge(self.graphdef, params)
        out, hidden, pred = part_hidden(model, inputs, prefix)
        logp, _ = logprobs_from_hidden(hidden, model.output_embedding(), inputs.tokens, pred,
                                       chunk=self.objective.logprob_chunk,
                                       temperature=self.objective.temperature)
        return (jax.lax.stop_gradient(logp), PartOutput(out.exports, out.hidden),
                jax.lax.stop_gradient(out.router_load))

    def _whole_batch_logprobs(self, params, inputs):
        model = nnx.merge(self.graphdef, params)
        out = model(inputs)
        logp, _ = logprobs_from_hidden(out.hidden, model.output_embedding(), inputs.tokens,
                                       inputs.pred, chunk=self.objective.logprob_chunk,
                                       temperature=self.objective.temperature)
        return jax.lax.stop_gradient(logp), jax.lax.stop_gradient(out.router_load)

    def _forward_saving_residuals(self, params, inputs, prefix):
        """Forward of a part with children: its loss, outputs and metrics, and its `jax.vjp`
        (a pytree of residuals, returned from the jitted call and fed to `_backward` later)."""
        (loss, out), vjp, metrics = jax.vjp(
            lambda p, c: _split_aux(self._part_forward(p, inputs, c)), params, prefix,
            has_aux=True)
        return loss, out, metrics, vjp

    def _leaf_grad(self, params, inputs, prefix):
        def f(p, c):
            loss, _, metrics = self._part_forward(p, inputs, c)
            return loss, metrics

        (loss, metrics), (d_params, d_prefix) = jax.value_and_grad(
            f, argnums=(0, 1), has_aux=True)(params, prefix)
        return loss, metrics, d_params, d_prefix

    def _leaf_into(self, params, inputs, prefix, total):
        loss, metrics, d_params, d_prefix = self._leaf_grad(params, inputs, prefix)
        return _add(total, (loss, metrics, d_params)), d_prefix

    def _backward_into(self, vjp, loss, metrics, d_out, d_below, total):
        d_params, d_prefix = vjp((jnp.ones_like(loss), d_out))
        return _add(total, (loss, metrics, d_params)), _add(d_prefix, d_below)

    def _forward_backward_into(self, params, inputs, prefix, d_out, d_below, total):
        def f(p, c):
            loss, out, metrics = self._part_forward(p, inputs, c)
            return (loss, out), metrics

        (loss, _), vjp, metrics = jax.vjp(f, params, prefix, has_aux=True)
        d_params, d_prefix = vjp((jnp.ones_like(loss), d_out))
        return _add(total, (loss, metrics, d_params)), _add(d_prefix, d_below)

    def _extend_prefix(self, prefix: PartPrefix, out: PartOutput, index, state_index,
                       p_par: int) -> PartPrefix:
        return extend_prefix(prefix, out, index, state_index, p_par, self.conv_width)

    def _extend_transpose(self, prefix, out, index, state_index, p_par: int, d_child):
        _, vjp = jax.vjp(lambda c, o: self._extend_prefix(c, o, index, state_index, p_par),
                         prefix, out)
        return vjp(d_child)

    # ------------------------------------------------------------------ host-side traversal

    def __call__(self, params: Any, program: RfreeProgram):
        """(loss, metrics, grads) of the whole program, equal to the unpartitioned trees'."""
        self._read_config(params)
        self.live = LiveBuffers()
        pooled = self._router_load(params, program) if self._uses_router_load(params, program) \
            else None
        if program.whole is not None:
            total = None
            # One call per micro-batch: it compiles per row shape, not per micro-batch count.
            for batch in program.whole.batches:
                inputs = stack([batch.inputs])
                if pooled is not None:  # the micro-batch axis of the grad function's scan
                    inputs = dataclasses.replace(inputs, router_load=tuple(
                        v[None] for v in pooled))
                result = self._call("whole", self._whole, params, inputs)
                total = result if total is None else self._accumulate(total, result)
            acc = _Accumulator(total)
        else:
            acc = _Accumulator(self._zero_total(params, program.parts[0], pooled))
        order = child_order(program)
        for root in _roots(program):
            self.live.hold("prefix", root, self._empty_prefix(params, program.parts[root]))
            self._run(params, program, order, root, self.live.held[("prefix", root)], acc, pooled)
            self.live.drop("prefix", root)
        loss, metrics, grads = acc.total
        return loss, finish_metrics(metrics), grads

    def _zero_total(self, params: Any, part: PartBatch,
                    pooled: tuple[jax.Array, jax.Array] | None):
        """Zero (loss, metrics, grads) to add the parts' results to (one call per step; the
        metrics' structure is traced abstractly once)."""
        if self._zeros is None:
            loss, metrics, _, _ = jax.eval_shape(self._leaf_grad, params,
                                                 dataclasses.replace(part.inputs,
                                                                     router_load=pooled),
                                                 self._empty_prefix(params, part))
            self._zeros = jax.jit(lambda p: zero_sums(loss, metrics, p))
        return self._call("zeros", self._zeros, params)

    def _call(self, name: str, fn: Callable, *args, part: int = -1):
        self.live.call(name, part)
        self.on_call(name, fn, args)
        return fn(*args)

    def _empty_prefix(self, params: Any, part: PartBatch) -> PartPrefix:
        """Zeros in the shapes of `part`'s prefix (`zero_prefix`), once per shape."""
        key = (jax.tree_util.tree_structure(part.inputs),
               tuple(x.shape for x in jax.tree_util.tree_leaves(part.inputs)))
        if key not in self._empty:
            out = jax.eval_shape(lambda p, x: nnx.merge(self.graphdef, p)(x), params, part.inputs)
            self._empty[key] = zero_prefix(out.exports, out.hidden, part.inputs.shape[0],
                                           part.prefix_len, self.conv_width)
        return self._empty[key]

    def _read_config(self, params: Any) -> None:
        """What the traversal needs from the model config (its parameters' shapes suffice)."""
        if self.conv_width is None:
            self.conv_width = conv_context(self.graphdef, params)

    def _uses_router_load(self, params: Any, program: RfreeProgram) -> bool:
        """Whether the model has a router load-balancing loss (traced abstractly, once)."""
        if self._pools_router is None:
            first = (program.parts[0].inputs if program.parts
                     else program.whole.batches[0].inputs)
            shape = jax.eval_shape(lambda p, x: nnx.merge(self.graphdef, p)(x).router_load,
                                   params, first)
            self._pools_router = shape is not None
        return self._pools_router

    def _router_load(self, params: Any, program: RfreeProgram
                     ) -> tuple[jax.Array, jax.Array]:
        """The router load (counts [E], total []) of the whole program (a forward-only pass
        first): the load-balancing loss is a product of two batch sums, so each part's share needs
        the routing counts of every part (`jtree.models.moe.load_balancing_loss`)."""
        counts = total = 0.0
        for _, _, load in self._forward_pass(params, program):
            counts, total = counts + load[0], total + load[1]
        return counts, total

    def _run(self, params, program: RfreeProgram, order: list[tuple[int, ...]], k: int,
             prefix: PartPrefix, acc: _Accumulator,
             pooled: tuple[jax.Array, jax.Array] | None) -> PartPrefix:
        """Forward and backward of part k and everything below it (post-order); returns
        d(prefix). The caller holds `prefix` (as ("prefix", k) in `self.live`)."""
        part, live = program.parts[k], self.live
        inputs = dataclasses.replace(part.inputs, router_load=pooled)
        if not part.children:
            acc.total, d_prefix = self._call("leaf", self._leaf, params, inputs, prefix,
                                             acc.total, part=k)
            return d_prefix
        vjp = None
        if self._keeps_residuals(program, k):
            loss, out, metrics, vjp = self._call("forward", self._forward, params, inputs, prefix,
                                                 part=k)
            live.hold("residuals", k, vjp)
        else:
            out = self._call("outputs", self._outputs, params, inputs, prefix, part=k)
        live.hold("outputs", k, out)
        # Accumulators exist from the first child's return on (see jtree.partitioning.redundancy_free.schedule).
        sums = None  # (d_out, d_prefix_below)
        for c in order[k]:
            child = program.parts[c]
            index, state = jnp.asarray(child.gather_index), jnp.asarray(child.gather_state)
            child_prefix = self._call("extend", self._extend, prefix, out, index, state,
                                      part.prefix_len, part=c)
            live.hold("prefix", c, child_prefix)
            d_child = self._run(params, program, order, c, child_prefix, acc, pooled)
            live.drop("prefix", c)
            del child_prefix
            live.hold("d_prefix", c, d_child)
            d_above, d_own = self._call("extend_back", self._extend_back, prefix, out, index,
                                        state, part.prefix_len, d_child, part=c)
            live.drop("d_prefix", c)
            del d_child
            sums = (d_own, d_above) if sums is None else self._accumulate(sums, (d_own, d_above))
            live.hold("accumulators", k, sums)
        d_out, d_below = sums
        if vjp is not None:
            acc.total, d_prefix = self._call("backward", self._backward, vjp, loss, metrics,
                                             d_out, d_below, acc.total, part=k)
        else:
            acc.total, d_prefix = self._call("forward_backward", self._forward_backward, params,
                                             inputs, prefix, d_out, d_below, acc.total, part=k)
        for kind in ("residuals", "outputs", "accumulators"):
            live.drop(kind, k)
        del vjp, out, d_out, d_below, sums
        return d_prefix

    def _keeps_residuals(self, program: RfreeProgram, k: int) -> bool:
        """Whether part k (which has children) keeps its forward's residuals for its backward."""
        if self.prefix_backward == "auto":
            return not any(program.parts[c].children for c in program.parts[k].children)
        return self.prefix_backward == "residuals"

    def logprobs(self, params: Any, program: RfreeProgram) -> list[np.ndarray]:
        """log p(token | its path) for every tree token of every tree (tree-token order; 0 where
        a token has no scoring row), computed forward-only over the program."""
        self._read_config(params)
        out_arrays = [np.zeros(t.n_tree_tokens, np.float32) for t in program.trees]
        for members, logp, _ in self._forward_pass(params, program):
            logp = np.asarray(logp)
            for m in members:
                out_arrays[m.tree][m.tokens] = logp[m.row, m.offset : m.offset + len(m.tokens)]
        return out_arrays

    def _forward_pass(self, params: Any, program: RfreeProgram):
        """Forward only over the program, depth-first with the stack of prefixes: yields
        (members, log-probs [rows, S], router load or None) per whole batch and per part."""
        if program.whole is not None:
            index_of = {id(program.trees[i]): i for i in program.whole_trees}
            for batch in program.whole.batches:
                logp, load = self._call("whole_forward", self._whole_logprobs, params,
                                        batch.inputs)
                members = [Member(index_of[id(tree)], np.arange(tree.n_tree_tokens), off, row)
                           for tree, row, off in zip(batch.layout.trees, batch.layout.rows,
                                                     batch.layout.offsets)]
                yield members, logp, load
        stack: list[tuple[int, Any]] = [
            (r, self._empty_prefix(params, program.parts[r])) for r in reversed(_roots(program))]
        while stack:
            k, prefix = stack.pop()
            part = program.parts[k]
            logp, out, load = self._call("part_forward", self._logprobs, params, part.inputs,
                                         prefix)
            yield part.members, logp, load
            for c in reversed(part.children):
                child = program.parts[c]
                stack.append((c, self._extend(prefix, out, jnp.asarray(child.gather_index),
                                              jnp.asarray(child.gather_state), part.prefix_len)))


def check_objective(objective: Objective) -> None:
    """Refuse the objectives a part cannot compute on its own tokens, naming the setting."""
    if objective.kind == "gspo":  # a part's path sums would miss the prefix it reuses
        raise ValueError("objective.kind=gspo: not available with run.mode=redundancy_free "
                         "(use run.mode=tree)")
    if objective.critic is not None:  # a part's per-path GAE would miss its prefix's pairs
        raise ValueError("objective.critic: not available with run.mode=redundancy_free "
                         "(use run.mode=tree)")


def conv_context(graphdef: nnx.GraphDef, params: Any) -> int:
    """K - 1, the tokens of GDN conv context a prefix carries (0 without GDN layers), from the
    model config (its parameters' shapes suffice)."""
    shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    model = nnx.merge(graphdef, shapes)
    return model.config.linear_conv_kernel_dim - 1 if model.spec.needs_gdn_tables else 0


def zero_prefix(exports: tuple[LayerCache, ...], hidden: Any, rows: int, p: int,
                conv_width: int) -> PartPrefix:
    """Zeros in the shapes of a prefix of `p` slots, from (the shapes of) a forward's `exports`
    and `hidden`: what a part at the top of a tree reads (its prefix slots are all padding:
    masked in attention, no query reads their conv context or state)."""
    layers = []
    for e in exports:
        if e is None:  # a layer without a token mixer (Nemotron-H's MLP layers) caches nothing
            layers.append(None)
        elif isinstance(e, AttentionCache):
            layers.append(AttentionCache(*(jnp.zeros((rows, p) + a.shape[2:], a.dtype)
                                           for a in e)))
        else:
            layers.append(GdnCache(
                jnp.zeros((rows, conv_width) + e.conv.shape[2:], e.conv.dtype),
                jnp.zeros(e.state.shape[:1] + e.state.shape[2:], e.state.dtype)))
    return PartPrefix(tuple(layers), jnp.zeros((rows, hidden.shape[-1]), hidden.dtype))


def part_hidden(model: Any, inputs: Any, prefix: PartPrefix
                ) -> tuple[Any, jax.Array, jax.Array]:
    """A part's forward: the model output, its scoring rows (row 0 the attach token's hidden
    state, then the own tokens') and `pred` into them."""
    out = model(inputs, prefix.layers)
    p = inputs.mask.prefix_len
    hidden = jnp.concatenate([prefix.hidden[:, None].astype(out.hidden.dtype), out.hidden], 1)
    pred = jnp.where(inputs.pred >= 0, inputs.pred - p + 1, -1)
    return out, hidden, pred


def part_forward(model: Any, inputs: Any, prefix: PartPrefix, objective: Objective, *,
                 vocab_axis: str | None = None) -> tuple[jax.Array, PartOutput, dict]:
    """A part's loss, what its children read, and its metrics (`vocab_axis`: the
    tensor-parallel axis of a vocab-parallel head, inside shard_map)."""
    out, hidden, pred = part_hidden(model, inputs, prefix)
    loss, metrics = loss_from_hidden(model.output_embedding(), hidden, pred, out.aux_loss,
                                     inputs, objective, vocab_axis=vocab_axis)
    return loss, PartOutput(out.exports, out.hidden), metrics


def extend_prefix(prefix: PartPrefix, out: PartOutput, index: jax.Array,
                  state_index: jax.Array, p_par: int, conv_width: int) -> PartPrefix:
    """A child's prefix: slot j of its prefix is position index[j] of the parent's combined
    coordinates ([parent prefix of `p_par` slots | parent own tokens]; -1 padding)."""
    safe = jnp.maximum(index, 0)
    layers = []
    for above, own in zip(prefix.layers, out.exports):
        if own is None:
            layers.append(None)
        elif isinstance(own, AttentionCache):
            k = jnp.concatenate([above.k, own.k], 1)
            v = jnp.concatenate([above.v, own.v], 1)
            layers.append(AttentionCache(_take(k, safe), _take(v, safe)))
        else:
            layers.append(_extend_gdn(above, own, index, state_index, p_par, conv_width))
    attach = index[:, -1] - p_par
    hidden = jnp.take_along_axis(out.hidden, attach[:, None, None], axis=1)[:, 0]
    return PartPrefix(tuple(layers), hidden)


def _extend_gdn(above: GdnCache, own: GdnCache, index: jax.Array, state_index: jax.Array,
                p_par: int, w: int) -> GdnCache:
    """The child's conv context (the K - 1 = `w` tokens above its attach token, from the
    parent's [cached K - 1 | own] activations) and the state after its attach token."""
    source = jnp.concatenate([above.conv.astype(own.conv.dtype), own.conv], 1)
    idx = index[:, -w:] if index.shape[1] >= w else jnp.pad(
        index, ((0, 0), (w - index.shape[1], 0)), constant_values=-1)
    idx = jnp.where(idx >= 0, idx - p_par + w, -1)
    conv = jnp.where((idx >= 0)[..., None], _take(source, jnp.maximum(idx, 0)), 0)
    state = jnp.take_along_axis(own.state, state_index[:, None, None, None, None], axis=1)
    return GdnCache(conv, state[:, 0])


class _Accumulator:
    """The running (loss, metrics, grads) of a step; the parts' backward calls add to it on the
    device (donated, so in place)."""

    def __init__(self, total: tuple):
        self.total = total


def _split_aux(result):
    loss, out, metrics = result
    return (loss, out), metrics


def _take(x: jax.Array, index: jax.Array) -> jax.Array:
    """x[r, index[r, j]] for x [R, n, ...] and index [R, m]."""
    return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


def _roots(program: RfreeProgram) -> list[int]:
    return [k for k, p in enumerate(program.parts) if p.parent < 0]
