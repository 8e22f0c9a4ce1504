"""The train step's arguments as abstract, sharded shapes: what `jtree.launch.lower_step` exports
and `jtree.memory_plan` compiles, without materializing a parameter or a batch."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from jtree.batch import padding
from jtree.chunk_tables import default_chunk_count
from jtree.run_data import gdn_chunk_size
from jtree.sharding import batch_specs, row_shards
from jtree.trainer import Trainer


def abstract_step_args(trainer: Trainer, rows: int) -> tuple[Any, Any]:
    """(state, inputs) of `trainer.step_fn` as `jax.ShapeDtypeStruct`s carrying their shardings.

    Inputs are `data.micro_batches` micro-batches of `rows` rows per row shard (data x fsdp) at
    `data.seq_len`: GDN chunk tables at the capacity of a full row of long nodes, the widest
    `score_index` (every token scored), coefficients arriving raw with `row_norm`."""
    cfg, mesh, d = trainer.cfg, trainer.mesh, trainer.cfg.data
    state = jax.eval_shape(trainer.init_fn)
    state = jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, trainer.shardings)
    n_rows = rows * row_shards(mesh)
    chunk = gdn_chunk_size(cfg)
    n_chunks = None if chunk is None else d.gdn_chunks or default_chunk_count(d.seq_len, chunk, 0)
    row = padding(n_rows, d.seq_len, score_len=d.seq_len, gdn_chunk_size=chunk,
                  gdn_chunks=n_chunks)
    row = dataclasses.replace(row, row_norm=np.zeros(n_rows, np.float32))
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct((d.micro_batches, *x.shape), x.dtype), row)
    inputs = jax.tree_util.tree_map(
        lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec)),
        abstract, batch_specs(abstract))
    return state, inputs
