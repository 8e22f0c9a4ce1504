"""The train step's arguments as abstract, sharded shapes: what `jtree.launch.lower_step` exports
and `jtree.memory.plan` compiles, without materializing a parameter or a batch."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from jtree.layout.batch import padding
from jtree.layout.gdn_tables import default_chunk_count
from jtree.objectives.pairs import padding_pairs, pair_width
from jtree.parallel.context import ContextCapacities
from jtree.parallel.sharding import batch_specs, context_size, row_shards
from jtree.training.run_data import gdn_chunk_size, replay_shape
from jtree.training.trainer import Trainer

# The halo slots per device the abstract step carries under context parallelism (the attention
# halo, and the Gated DeltaNet exported chunks and conv halo): the hidden states a device exports
# are those of nodes whose children start on later devices, a few per slice in agent trees; the
# real batch's capacities come from `jtree.parallel.context.context_batch`.
HALO_SLOTS = 64


def padding_step_inputs(trainer: Trainer, rows: int) -> Any:
    """A real all-padding batch of the shapes and shardings `abstract_step_args` describes, on the
    devices: a step on it allocates what a step on real data does (the shapes are static), so
    `jtree.launch.device_check` measures the peak memory `jtree.memory.plan` predicts."""
    host = _padding_row(trainer, rows)
    _, inputs = abstract_step_args(trainer, rows)
    return jax.tree_util.tree_map(
        lambda x, spec: jax.device_put(np.broadcast_to(x, spec.shape), spec.sharding),
        host, inputs)


def _padding_row(trainer: Trainer, rows: int) -> Any:
    """One micro-batch of padding rows (`rows` per row shard) laid out as the step takes it."""
    cfg, mesh, d = trainer.cfg, trainer.mesh, trainer.cfg.data
    n_rows = rows * row_shards(mesh)
    chunk = gdn_chunk_size(cfg)
    n_chunks = None if chunk is None else d.gdn_chunks or default_chunk_count(d.seq_len, chunk, 0)
    row = padding(n_rows, d.seq_len, score_len=d.seq_len, gdn_chunk_size=chunk,
                  gdn_chunks=n_chunks)
    row = dataclasses.replace(row, row_norm=np.zeros(n_rows, np.float32))
    objective = cfg.objective
    if objective.critic is not None or objective.off_policy.enabled:
        # One (path, trained token) pair per token of a row; a row whose tokens several paths
        # train holds more, but a pair is a few scalars, next to nothing in the plan.
        row = dataclasses.replace(row, pairs=padding_pairs(
            n_rows, pair_width(d.seq_len), critic=objective.critic is not None,
            off_policy=objective.off_policy.enabled))
    replay = replay_shape(cfg)
    if replay is not None:  # routing replay: the engine's experts per token and MoE layer
        row = dataclasses.replace(row, routed_experts=np.full((n_rows, d.seq_len, *replay), -1,
                                                              np.int32))
    context = context_size(mesh)
    if context > 1:
        length = d.seq_len // context
        everything = np.broadcast_to(np.arange(d.seq_len, dtype=np.int32), (n_rows, d.seq_len))
        capacities = ContextCapacities(
            halo=HALO_SLOTS, score=length, exports=HALO_SLOTS, conv_halo=HALO_SLOTS,
            chunks=None if chunk is None else default_chunk_count(length, chunk, 0))
        row = trainer.laid_out(dataclasses.replace(row, score_index=everything), capacities)
    return row


def abstract_step_args(trainer: Trainer, rows: int) -> tuple[Any, Any]:
    """(state, inputs) of `trainer.step_fn` as `jax.ShapeDtypeStruct`s carrying their shardings.

    Inputs are `data.micro_batches` micro-batches of `rows` rows per row shard (data x fsdp) at
    `data.seq_len`: GDN chunk tables at the capacity of a full row of long nodes, the widest
    `score_index` (every token scored), coefficients arriving raw with `row_norm`; under context
    parallelism a halo of `HALO_SLOTS` per device and the GDN tables laid out per device; with a
    critic or off-policy weights, one (path, trained token) pair per token; with routing replay,
    the routed experts of every token."""
    mesh, d = trainer.mesh, trainer.cfg.data
    state = jax.eval_shape(trainer.init_fn)
    state = jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, trainer.shardings)
    row = _padding_row(trainer, rows)
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct((d.micro_batches, *x.shape), x.dtype), row)
    inputs = jax.tree_util.tree_map(
        lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec)),
        abstract, batch_specs(abstract))
    return state, inputs
