"""Running a redundancy-free program over a ('data', 'fsdp', 'model') mesh.

The row shards (`jtree.parallel.sharding.ROWS`: data x fsdp) run the program's part trees in lockstep
(`jtree.partitioning.redundancy_free.schedule.lockstep`): at every step each shard runs one part row, all rows of one
shape (`build_program(..., uniform=True)`), so the whole program is one `lax.scan` over the steps
inside one `shard_map`, like the micro-batches of the tree step (`jtree.step.train_step.make_grad_fn`):
tensor parallelism (`model`), FSDP gathers and the vocab-parallel loss run inside each step as
they do there, and the gradients are summed per device over the steps and over the row axes once
at the end.

Parts are grouped so that children run where their prefix is: a tree's whole part tree runs on
one shard, and its prefixes and the cotangents flowing back to them never leave the device. The
scan carry holds, per device, the buffers of the chain from a root part to the running part, by
level (a part's depth in its part tree): the prefix and outputs of the part at each level (what
its children read) and the cotangents its children handed back. Each call of a part reads its
parent's buffers one level up, gathers its own prefix from them (`extend_prefix`), runs its
forward and, under one `jax.vjp`, its backward with the cotangents of its level:

- a part with children is called twice: first to leave its prefix and outputs at its level (and
  zero its accumulators), then after its last child to add its loss and gradients and hand the
  cotangents of its parent's buffers up one level. That is `prefix_backward="recompute"` of the
  single-device executor (`jtree.partitioning.redundancy_free.executor`): nothing of a forward is kept across calls;
- a leaf part is called once.

Every call computes forward and backward whatever it is for (a shard cannot branch: FSDP gathers
and the tensor-parallel collectives span devices that run different parts), and masks by the
call's kind what it keeps; idle steps (a shard whose part trees need fewer calls than the
busiest shard's) run a copy of the first part and keep nothing. The shards' calls are balanced by
the balancer (`jtree.layout.balance.assign_to_ranks`) over part trees; a step with fewer part trees than
shards leaves shards idle.

A MoE router load-balancing loss pooled over the whole program needs every part's routing counts
first: a forward-only scan over the same schedule collects them (summed over the row axes), then
every part adds its exact share (`jtree.models.moe.load_balancing_loss`), as on one device.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jtree.config.objective import Objective
from jtree.layout.batch import DeviceBatch
from jtree.layout.planner import octave_step_length
from jtree.models.lora import model_params, trainable, with_trainable
from jtree.objectives.objective import finish_metrics, zero_sums
from jtree.parallel.sharding import MODEL, ROWS, row_shards, vary_over, varying_axes
from jtree.partitioning.redundancy_free.executor import (
    PartOutput,
    PartPrefix,
    check_objective,
    conv_context,
    extend_prefix,
    part_forward,
    part_hidden,
    zero_prefix,
)
from jtree.partitioning.redundancy_free.layout import RfreeProgram
from jtree.partitioning.redundancy_free.schedule import Lockstep, lockstep
from jtree.step.train_step import merged_model

# Steps of a lockstep schedule are padded to this many lengths per octave: programs of nearby
# call counts share one compiled step.
STEPS_PER_OCTAVE = 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LockstepInputs:
    """The stacked calls of a lockstep schedule, each field [T, shards, ...]: the part rows,
    each part's gather from its parent's buffers (`gather_index` [.., P], `gather_state`), and
    what the call does (`active`: not an idle step; `backward`; `depth`: its level;
    `has_parent`; `reads_below`: it has children, whose cotangents it reads)."""

    inputs: DeviceBatch
    gather_index: Any
    gather_state: Any
    active: Any
    backward: Any
    depth: Any
    has_parent: Any
    reads_below: Any


class _Levels(NamedTuple):
    """Per-level buffers of one device's chain (leaves [levels, rows, ...])."""

    prefix: PartPrefix
    out: PartOutput
    d_prefix: PartPrefix
    d_out: PartOutput


def lockstep_inputs(program: RfreeProgram, schedule: Lockstep) -> LockstepInputs:
    """Host arrays [T, shards, ...] of `schedule`'s calls (idle steps: the first part's row)."""
    parts = program.parts
    at = np.maximum(schedule.part, 0)

    def stacked(rows: list[np.ndarray]) -> np.ndarray:
        return np.stack(rows)[at]

    inputs = jax.tree_util.tree_map(lambda *rows: stacked([r[0] for r in rows]),
                                    *[p.inputs for p in parts])
    p_len = parts[0].prefix_len
    index = [np.zeros(p_len, np.int32) if p.gather_index is None else p.gather_index[0]
             for p in parts]
    state = [np.int32(0) if p.gather_state is None else p.gather_state[0] for p in parts]
    active = schedule.part >= 0
    parent = np.array([p.parent >= 0 for p in parts])[at] & active
    below = np.array([bool(p.children) for p in parts])[at] & active
    return LockstepInputs(inputs, stacked(index), stacked(state), active, schedule.backward,
                          schedule.depth, parent, below)


def _check_uniform(program: RfreeProgram) -> None:
    shapes = {tuple(x.shape for x in jax.tree_util.tree_leaves(p.inputs)) for p in program.parts}
    if len(shapes) != 1 or program.whole is not None:
        raise ValueError("program: the mesh executor stacks part rows of one shape; build it "
                         "with jtree.partitioning.redundancy_free.layout.build_program(..., uniform=True)")


class MeshRedundancyFreeStep:
    """Loss, metrics and gradients of a uniform `RfreeProgram` over `mesh` (module docstring),
    equal to the single-device `RedundancyFreeStep`'s. `graphdef` is the model for shard_map
    (`jtree.step.train_step.sharded_graphdef` of the parameters' `specs`); the gradients are those of
    the trainable parameters (`jtree.models.lora.trainable`), sharded like them. After a call,
    `schedule` holds the last program's lockstep schedule."""

    def __init__(self, graphdef: nnx.GraphDef, objective: Objective, mesh: Mesh, specs: Any):
        check_objective(objective)
        axes = ROWS + (MODEL,)
        other = [a for a in mesh.axis_names if a not in axes and mesh.shape[a] > 1]
        if other:  # the context-parallel axis: a part row is never split over devices
            raise ValueError(f"mesh.{other[0]}={mesh.shape[other[0]]}: run.mode=redundancy_free "
                             f"runs on the {', '.join(axes)} axes only (each part row on one "
                             f"row shard); set mesh.{other[0]}=1 or another run.mode")
        self.graphdef, self.objective, self.mesh, self.specs = graphdef, objective, mesh, specs
        self.schedule: Lockstep | None = None
        self._grads = jax.jit(self._sharded, static_argnums=(2, 3))
        self._conv_width: int | None = None

    def __call__(self, params: Any, program: RfreeProgram):
        """(loss, metrics, grads) of the whole program."""
        _check_uniform(program)
        if self._conv_width is None:
            self._conv_width = conv_context(self.graphdef, jax.eval_shape(model_params, params))
        schedule = lockstep(program, row_shards(self.mesh))
        steps = octave_step_length(schedule.steps, STEPS_PER_OCTAVE, min_step=1)
        if steps != schedule.steps:
            schedule = lockstep(program, row_shards(self.mesh), min_steps=steps)
        self.schedule = schedule
        host = lockstep_inputs(program, schedule)
        calls = jax.tree_util.tree_map(self._place, host)
        return self._grads(params, calls, schedule.levels, self._conv_width)

    def _place(self, x: np.ndarray) -> jax.Array:
        """A host array [T, shards, ...] onto the mesh, its shard axis over the row axes (each
        process holds the whole schedule and places what its devices hold)."""
        x = np.asarray(x)
        sharding = NamedSharding(self.mesh, P(None, ROWS))
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    def _sharded(self, params: Any, calls: LockstepInputs, levels: int, conv_width: int):
        def local(params: Any, calls: LockstepInputs):
            return self._local(params, calls, levels, conv_width)

        in_specs = (self.specs, jax.tree_util.tree_map(lambda _: P(None, ROWS), calls))
        out_specs = (P(), P(), trainable(self.specs))
        return jax.shard_map(local, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)(
            params, calls)

    # ------------------------------------------------------------------ inside shard_map

    def _model(self, params: Any, t: Any) -> Any:
        return merged_model(self.graphdef, model_params(with_trainable(params, t)))

    def _local(self, params: Any, calls: LockstepInputs, levels: int, conv_width: int):
        sum_axes = jax.tree_util.tree_map(
            lambda x: tuple(a for a in ROWS if a not in varying_axes(x)), trainable(params))
        params = vary_over(params, ROWS)
        first = jax.tree_util.tree_map(lambda x: x[0], calls)
        p_len = first.inputs.mask.prefix_len
        out = jax.eval_shape(lambda p, x: self._model(p, trainable(p))(x), params, first.inputs)
        rows = first.inputs.shape[0]
        prefix = zero_prefix(out.exports, out.hidden, rows, p_len, conv_width)
        output = PartOutput(
            jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), out.exports),
            jnp.zeros(out.hidden.shape, out.hidden.dtype))
        stack = jax.tree_util.tree_map(lambda x: jnp.zeros((levels,) + x.shape, x.dtype),
                                       _Levels(prefix, output, prefix, output))
        pooled = None
        if out.router_load is not None:
            pooled = self._router_load(params, calls, stack, conv_width, out.router_load)
        grads = trainable(params)

        def body(carry, call: LockstepInputs):
            buffers, total = carry
            parent, below = _at_level(buffers, call.depth[0], levels)
            inputs = dataclasses.replace(call.inputs, router_load=pooled)

            def f(t, parent_prefix, parent_out):
                own = self._own_prefix(call, parent_prefix, parent_out, p_len, conv_width)
                loss, part_out, metrics = part_forward(self._model(params, t), inputs, own,
                                                       self.objective, vocab_axis=MODEL)
                return (loss, part_out, own), metrics

            (loss, part_out, own), vjp, metrics = jax.vjp(
                f, grads, parent.prefix, parent.out, has_aux=True)
            # Only a backward call seeds its backward: the gradient of a parameter sharded
            # over `fsdp` comes back summed over the fsdp peers (the transpose of its gather),
            # which run other calls, so the calls are masked at the seed, not at the result.
            backward = call.active[0] & call.backward[0]
            reads = backward & call.reads_below[0]
            d_t, d_parent_prefix, d_parent_out = vjp((
                jnp.where(backward, 1.0, 0.0).astype(loss.dtype),
                _vary_like(_masked(reads, below.d_out), part_out),
                _vary_like(_masked(reads, below.d_prefix), own)))
            buffers = _update(buffers, call, levels, own, part_out, d_parent_prefix,
                              d_parent_out)
            loss, metrics = _masked(backward, (loss, metrics))
            total = jax.tree_util.tree_map(jnp.add, total, (loss, metrics, d_t))
            return (buffers, total), None

        loss_shape, _, metrics_shape = jax.eval_shape(lambda: part_forward(
            self._model(params, grads), dataclasses.replace(first.inputs, router_load=pooled),
            prefix, self.objective, vocab_axis=MODEL))
        carry = _typed_carry(body, (stack, zero_sums(loss_shape, metrics_shape, grads)), first)
        (_, (loss, metrics, grads)), _ = jax.lax.scan(body, carry, calls)
        loss, metrics = jax.lax.psum((loss, metrics), ROWS)
        grads = jax.tree_util.tree_map(lambda g, axes: jax.lax.psum(g, axes) if axes else g,
                                       grads, sum_axes)
        return loss, finish_metrics(metrics), grads

    def _own_prefix(self, call: LockstepInputs, parent_prefix: PartPrefix,
                    parent_out: PartOutput, p_len: int, conv_width: int) -> PartPrefix:
        """The part's prefix gathered from its parent's buffers (zeros at the top of a tree)."""
        own = extend_prefix(parent_prefix, parent_out, call.gather_index, call.gather_state,
                            p_len, conv_width)
        return _masked(call.has_parent[0], own)

    def _router_load(self, params: Any, calls: LockstepInputs, stack: _Levels, conv_width: int,
                     shapes: tuple[Any, Any]) -> tuple[jax.Array, jax.Array]:
        """The router load (counts [E], total) of the whole program: a forward-only scan over
        the schedule, each part's load added at its last call, summed over the row axes."""
        levels = jax.tree_util.tree_leaves(stack)[0].shape[0]
        p_len = calls.inputs.mask.prefix_len

        def body(carry, call: LockstepInputs):
            buffers, (counts, total) = carry
            parent, _ = _at_level(buffers, call.depth[0], levels)
            own = self._own_prefix(call, parent.prefix, parent.out, p_len, conv_width)
            # The model is merged inside the scan: its layers' FSDP gathers run in the body.
            out, _, _ = part_hidden(self._model(params, trainable(params)), call.inputs, own)
            part_out = PartOutput(out.exports, out.hidden)
            zeros = jax.tree_util.tree_map(jnp.zeros_like, (own, part_out))
            buffers = _update(buffers, call, levels, own, part_out, *zeros)
            last = call.active[0] & call.backward[0]
            load = _masked(last, out.router_load)
            return (buffers, (counts + load[0], total + load[1])), None

        first = jax.tree_util.tree_map(lambda x: x[0], calls)
        zero = tuple(jnp.zeros(x.shape, x.dtype) for x in shapes)
        carry = _typed_carry(body, (stack, zero), first)
        (_, (counts, total)), _ = jax.lax.scan(body, carry, calls)
        return jax.lax.psum((counts, total), ROWS)


def _vary_like(tree: Any, like: Any) -> Any:
    """`tree` cast to vary over the mesh axes `like` varies over (a cotangent read from a buffer
    typed before the carry's types settled, `_typed_carry`)."""
    def one(x: jax.Array, y: jax.Array) -> jax.Array:
        missing = tuple(sorted(varying_axes(y) - varying_axes(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree_util.tree_map(one, tree, like)


def _masked(keep: jax.Array, tree: Any) -> Any:
    """`tree` where `keep`, else zeros (a select: no NaN of a masked value leaks through)."""
    return jax.tree_util.tree_map(lambda x: jnp.where(keep, x, jnp.zeros_like(x)), tree)


def _at_level(buffers: _Levels, depth: jax.Array, levels: int) -> tuple[_Levels, _Levels]:
    """(the buffers one level above `depth`: the parent's, those at `depth`: the part's own
    accumulators), levels clamped into the stack (a part at depth 0 reads level 0 and masks
    it; a leaf deeper than any part with children reads the last level and masks it)."""
    up = jnp.clip(depth - 1, 0, levels - 1)
    here = jnp.clip(depth, 0, levels - 1)
    take = lambda i: jax.tree_util.tree_map(  # noqa: E731
        lambda x: jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False), buffers)
    return take(up), take(here)


def _update(buffers: _Levels, call: LockstepInputs, levels: int, own: PartPrefix,
            part_out: PartOutput, d_parent_prefix: PartPrefix, d_parent_out: PartOutput
            ) -> _Levels:
    """A forward call leaves its prefix and outputs at its level and zeros the accumulators
    there; a backward call of a part with a parent adds the cotangents of the parent's buffers
    to the level above."""
    active, back, depth = call.active[0], call.backward[0], call.depth[0]
    forward = active & ~back
    up = active & back & call.has_parent[0]
    here, above = jnp.clip(depth, 0, levels - 1), jnp.clip(depth - 1, 0, levels - 1)

    def write(x, new, i, fn):
        cur = jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(x, fn(cur, new).astype(x.dtype), i, 0)

    tm = jax.tree_util.tree_map
    keep = lambda flag: (lambda cur, new: jnp.where(flag, new, cur))  # noqa: E731
    prefix = tm(lambda x, n: write(x, n, here, keep(forward)), buffers.prefix, own)
    out = tm(lambda x, n: write(x, n, here, keep(forward)), buffers.out, part_out)
    d_prefix = tm(lambda x: write(x, jnp.zeros(x.shape[1:], x.dtype), here, keep(forward)),
                  buffers.d_prefix)
    d_out = tm(lambda x: write(x, jnp.zeros(x.shape[1:], x.dtype), here, keep(forward)),
               buffers.d_out)
    add = lambda cur, new: cur + jnp.where(up, new, jnp.zeros_like(new))  # noqa: E731
    d_prefix = tm(lambda x, n: write(x, n, above, add), d_prefix, d_parent_prefix)
    d_out = tm(lambda x, n: write(x, n, above, add), d_out, d_parent_out)
    return _Levels(prefix, out, d_prefix, d_out)


def _typed_carry(body, carry: Any, first: Any) -> Any:
    """`carry` cast to vary over the mesh axes the scan body's outputs vary over (a scan's
    carry keeps its type; the buffers vary like what the parts write into them: the row axes,
    and `model` for tensor-parallel heads)."""
    for _ in range(4):
        leaves, treedef = jax.tree_util.tree_flatten(carry)
        out = jax.tree_util.tree_leaves(jax.eval_shape(body, carry, first)[0])
        missing = [tuple(sorted(frozenset(o.manual_axis_type.varying) - varying_axes(c)))
                   for c, o in zip(leaves, out)]
        if not any(missing):
            return carry
        carry = jax.tree_util.tree_unflatten(treedef, [
            jax.lax.pcast(c, m, to="varying") if m else c for c, m in zip(leaves, missing)])
    raise AssertionError("the scan carry's mesh axes did not settle")
