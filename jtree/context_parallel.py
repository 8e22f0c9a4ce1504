"""Context parallelism: one row's tokens split over the `context` mesh axis (docs/context_parallel.md).

A row of S = c L tokens is split over the c devices of the axis, device k holding the contiguous
slice [k L, (k + 1) L) (DFS order; the slices may hold gaps: padding tokens in the middle of the
row). Every index in the batch stays a position in the whole row. Two things cross devices:

- attention: a query sees keys of its own and earlier devices. The keys and values and the keys'
  `end` are all-gathered over the axis (`gathered_keys`, `context_mask`) and each device runs
  its queries at their offset (`jtree.kernels.TreeMask.query_offset`); the gather's transpose
  returns dK / dV to their owners.
- scoring: token i is scored by the hidden state at pred[i], which may live on an earlier device
  (a node's first token whose parent ends on another device). Those hidden states travel through
  a fixed-capacity halo: each device exports the positions other devices' tokens need, H slots
  per device (`halo_capacity`, computed on the host from `pred`), all-gathered as [c H, D]
  (`scoring_view`); never the full hidden.

Sums along paths (GSPO's sequence ratios, the critic's per-path GAE) need whole rows: their
per-token inputs are all-gathered over the axis (a float or int per token), every device computes
them for the whole row, and each sums only the terms of the tokens it owns (`owned`), so the
sum over the axis counts every term once and the gradients reach the owners through the
gathers' transposes.

Host side: `context_batch` checks that c divides the row, adds the halo, lays `score_index`
out per device (each device scores the tokens it holds) and rebuilds the Gated DeltaNet chunk
tables per device (`jtree.context_tables`). The same batch runs unchanged on one device: the halo
is ignored there and `score_index` is still a list of positions (the GDN tables, though, are the
per-device ones: a one-device run reads the batch's own).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jtree.batch import DeviceBatch, GdnTables
from jtree.chunk_tables import default_chunk_count
from jtree.context_tables import context_gdn_tables, device_exports, device_slice
from jtree.kernels import TreeMask
from jtree.planner import octave_step_length, score_width


def _scoring_exports(pred: np.ndarray, context: int) -> list[np.ndarray]:
    """Per row of `pred` [rows, S], the positions whose hidden states score a token of another
    device."""
    length = device_slice(pred.shape[-1], context)
    owner = np.arange(pred.shape[-1]) // length
    return [src[(src >= 0) & (src // length != owner)] for src in pred]


def halo_capacity(pred: np.ndarray, context: int) -> int:
    """H, the halo slots each device needs for rows `pred` [..., rows, S] split over `context`
    devices: the most positions any device of any row must export (at least 1, so the halo's
    shape never vanishes). The planner sizes batches with it (one H for all micro-batches)."""
    return halo_positions(pred, context, None).shape[-1] // context


def halo_positions(pred: np.ndarray, context: int, capacity: int | None) -> np.ndarray:
    """The `halo` field [..., rows, c H] for `pred` [..., rows, S]: device k's exports in slots
    [k H, (k + 1) H), in the layout of `jtree.context_tables.device_exports` (non-decreasing
    along the row, a position's first occurrence its slot: `scoring_view` finds it by binary
    search). H is `capacity` (None: the smallest that holds every row)."""
    pred = np.asarray(pred)
    flat = pred.reshape(-1, pred.shape[-1])
    length = device_slice(pred.shape[-1], context)
    out = device_exports(_scoring_exports(flat, context), length, context, capacity, "halo")
    return out.reshape(*pred.shape[:-1], out.shape[-1])


def score_layout(score_index: np.ndarray, seq_len: int, context: int,
                 width: int | None = None) -> np.ndarray:
    """`score_index` [..., rows, K] laid out per device: [..., rows, c K'], device k's slots
    holding the scored positions it owns (ascending; -1 fills). K' is `width`, by default the
    most any device of any row scores rounded up on the planner's score-width ladder
    (`jtree.planner.score_width`), so steps compile for few widths. Still a list of row
    positions, valid on one device too."""
    length = device_slice(seq_len, context)
    flat = np.asarray(score_index).reshape(-1, score_index.shape[-1])
    per = [[row[(row >= 0) & (row // length == k)] for k in range(context)] for row in flat]
    need = max([0] + [len(x) for row in per for x in row])
    width = score_width(need, length) if width is None else width
    if need > width:
        raise ValueError(f"score width {width}: a device of mesh.context={context} scores {need} "
                         "tokens")
    out = np.full((flat.shape[0], context * width), -1, np.int32)
    for r, row in enumerate(per):
        for k, positions in enumerate(row):
            out[r, k * width:k * width + len(positions)] = np.sort(positions)
    return out.reshape(*score_index.shape[:-1], context * width)


def context_batch(batch: DeviceBatch, context: int, *, conv_kernel: int | None = None,
                  halo: int | None = None) -> DeviceBatch:
    """`batch` (host arrays, [..., rows, S]) ready to run with its rows split over `context`
    devices: the halo added (`halo` slots per device; default `halo_capacity` rounded up to a
    power of two, at least 8, so steps compile for few halo sizes), `score_index` laid out per
    device (`score_layout`) and, for a model with Gated DeltaNet layers (the batch has `gdn`
    tables), the chunk tables rebuilt per device (`context_step_tables`, for a conv of
    `conv_kernel` taps). An error names `mesh.context` when it does not divide S, and a
    redundancy-free part (a prefix), which does not run under context parallelism."""
    seq_len = batch.tokens.shape[-1]
    device_slice(seq_len, context)
    if batch.prefix_pred is not None:
        raise ValueError(f"mesh.context={context}: the batch has 'prefix_pred' (a redundancy-free "
                         "part), which does not run under context parallelism")
    pred = np.asarray(batch.pred)
    capacity = octave_step_length(halo_capacity(pred, context), 1) if halo is None else halo
    score = batch.score_index
    if score is not None:
        score = score_layout(np.asarray(score), seq_len, context)
    gdn = batch.gdn
    if gdn is not None:
        if conv_kernel is None:
            raise ValueError("context_batch: the batch has 'gdn' chunk tables; pass conv_kernel "
                             "(the model's linear_conv_kernel_dim)")
        gdn = context_step_tables(np.asarray(batch.node), pred, context,
                                  gdn.chunk_tokens.shape[-1], conv_kernel)
    return dataclasses.replace(batch, halo=halo_positions(pred, context, capacity),
                               score_index=score, gdn=gdn)


def context_step_tables(node: np.ndarray, pred: np.ndarray, context: int, chunk_size: int,
                        conv_kernel: int) -> GdnTables:
    """`jtree.context_tables.context_gdn_tables` of rows [..., rows, S] (every micro-batch
    alike) at capacities on ladders, so a run compiles its step for few table shapes: the chunks
    per device on `jtree.chunk_tables.default_chunk_count`'s buckets, the exported chunks and
    the conv halo on powers of two (at least 8)."""
    lead, seq_len = node.shape[:-1], node.shape[-1]
    flat_node, flat_pred = node.reshape(-1, seq_len), pred.reshape(-1, seq_len)
    need = context_gdn_tables(flat_node, flat_pred, context, chunk_size, conv_kernel)
    chunks, exports, conv_halo = (x.shape[-1] // context for x in (
        need.chunk_src, need.context_exports, need.conv_halo))
    tables = context_gdn_tables(
        flat_node, flat_pred, context, chunk_size, conv_kernel,
        n_chunks=default_chunk_count(seq_len // context, chunk_size, chunks),
        n_exports=octave_step_length(exports, 1), n_halo=octave_step_length(conv_halo, 1))
    return jax.tree_util.tree_map(lambda x: x.reshape(*lead, *x.shape[1:]), tables)


# ---------------------------------------------------------------------- device side
# Inside shard_map, on one device's slice of the row; `axis` is the context mesh axis
# (`RuntimeConfig.context_axis`).


def slice_offset(local_len: int, axis: str) -> jax.Array:
    """This device's first row position: axis_index * L."""
    return jax.lax.axis_index(axis).astype(jnp.int32) * local_len


def local_index(index: jax.Array, local_len: int, axis: str) -> jax.Array:
    """Row positions -> positions in this device's slice, -1 for those outside it (and for -1)."""
    offset = slice_offset(local_len, axis)
    inside = (index >= offset) & (index < offset + local_len)
    return jnp.where(inside, index - offset, -1)


def owned(seq_len: int, local_len: int, axis: str) -> jax.Array:
    """[S] bool: the row positions this device holds. Terms computed on the whole row (path
    sums gathered over the axis) are summed where their token is owned, so that the sum over
    the axis counts each once."""
    offset = slice_offset(local_len, axis)
    at = jnp.arange(seq_len, dtype=jnp.int32)
    return (at >= offset) & (at < offset + local_len)


def gathered_row(x: jax.Array, axis: str, dim: int = 1) -> jax.Array:
    """The whole row of a per-token array from its device slices (tiled all-gather along `dim`);
    the transpose sums each device's cotangent back onto the slice's owner."""
    return jax.lax.all_gather(x, axis, axis=dim, tiled=True)


def context_mask(mask: TreeMask, axis: str) -> TreeMask:
    """The attention mask of this device's queries: the whole row's key ends (int32 x S, gathered
    once per forward) and the queries at the slice's offset."""
    if mask.prefix_end is not None:
        raise ValueError("mesh.context > 1 with a redundancy-free part (a prefix): not supported "
                         "yet; run redundancy-free mode with mesh.context=1")
    local_len = mask.end.shape[-1]
    return TreeMask(gathered_row(mask.end, axis), query_offset=slice_offset(local_len, axis))


def gathered_keys(k: jax.Array, v: jax.Array, axis: str) -> tuple[jax.Array, jax.Array]:
    """Keys and values [rows, S, Hkv, D] of the whole row, from each device's [rows, L, ...]."""
    return gathered_row(k, axis), gathered_row(v, axis)


def scoring_view(hidden: jax.Array, pred: jax.Array, halo: Any, score_index: Any, axis: str
                 ) -> tuple[jax.Array, jax.Array, Any]:
    """What this device scores its own tokens from: (hidden [rows, L + c H, D], its slice's
    hidden states followed by the gathered halo; `pred` [rows, L] as indices into it, -1 kept;
    `score_index` as positions in the slice, or None).

    Token i's scoring state is local when pred[i] lies in the slice, else the halo slot holding
    it (the gathered halo rows are non-decreasing, a position's first occurrence its slot). The
    export gathers each halo position's state on its owner, so the gradient of a halo row flows
    back to the owner through the all-gather's transpose."""
    if halo is None:
        raise ValueError("inputs: 'halo' missing; mesh.context > 1 needs the batch from "
                         "jtree.context_parallel.context_batch")
    rows, length = pred.shape
    offset = slice_offset(length, axis)
    local = jnp.clip(halo - offset, 0, length - 1)
    exported = jnp.take_along_axis(hidden, local[..., None], axis=1)  # [rows, H, D]
    halo_hidden = gathered_row(exported, axis)  # [rows, c H, D]
    halo_all = gathered_row(halo, axis)  # [rows, c H]
    inside = (pred >= offset) & (pred < offset + length)
    slot = jax.vmap(lambda h, p: jnp.searchsorted(h, p, side="left"))(halo_all, pred)
    view_pred = jnp.where(pred < 0, -1, jnp.where(inside, pred - offset,
                                                  length + slot.astype(jnp.int32)))
    if score_index is not None:
        score_index = local_index(score_index, length, axis)
    return jnp.concatenate([hidden, halo_hidden], axis=1), view_pred, score_index
