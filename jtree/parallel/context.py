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
tables per device (`jtree.layout.context_gdn_tables`). The same batch runs unchanged on one device: the halo
is ignored there and `score_index` is still a list of positions (the GDN tables, though, are the
per-device ones: a one-device run reads the batch's own).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jtree.kernels import TreeMask
from jtree.layout.batch import DeviceBatch
from jtree.layout.context_gdn_tables import context_gdn_tables, device_exports, device_slice
from jtree.layout.gdn_tables import default_chunk_count
from jtree.layout.planner import octave_step_length, score_width
from jtree.parallel.sharding import CONTEXT, MODEL, row_shards


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
    [k H, (k + 1) H), in the layout of `jtree.layout.context_gdn_tables.device_exports` (non-decreasing
    along the row, a position's first occurrence its slot: `scoring_view` finds it by binary
    search). H is `capacity` (None: the smallest that holds every row)."""
    pred = np.asarray(pred)
    flat = pred.reshape(-1, pred.shape[-1])
    length = device_slice(pred.shape[-1], context)
    out = device_exports(_scoring_exports(flat, context), length, context, capacity, "halo")
    return out.reshape(*pred.shape[:-1], out.shape[-1])


def _scored_per_device(score_index: np.ndarray, seq_len: int, context: int
                       ) -> list[list[np.ndarray]]:
    """Per row of `score_index` [..., rows, K] (flattened) and device, the positions it scores."""
    length = device_slice(seq_len, context)
    flat = np.asarray(score_index).reshape(-1, score_index.shape[-1])
    return [[row[(row >= 0) & (row // length == k)] for k in range(context)] for row in flat]


def score_layout(score_index: np.ndarray, seq_len: int, context: int,
                 width: int | None = None) -> np.ndarray:
    """`score_index` [..., rows, K] laid out per device: [..., rows, c K'], device k's slots
    holding the scored positions it owns (ascending; -1 fills). K' is `width`, by default the
    most any device of any row scores rounded up on the planner's score-width ladder
    (`jtree.layout.planner.score_width`), so steps compile for few widths. Still a list of row
    positions, valid on one device too."""
    per = _scored_per_device(score_index, seq_len, context)
    need = max([0] + [len(x) for row in per for x in row])
    width = score_width(need, seq_len // context) if width is None else width
    if need > width:
        raise ValueError(f"score width {width}: a device of mesh.context={context} scores {need} "
                         "tokens")
    out = np.full((len(per), context * width), -1, np.int32)
    for r, row in enumerate(per):
        for k, positions in enumerate(row):
            out[r, k * width:k * width + len(positions)] = np.sort(positions)
    return out.reshape(*score_index.shape[:-1], context * width)


@dataclasses.dataclass(frozen=True)
class ContextCapacities:
    """The per-device sizes a step batch is laid out at for context parallelism: `halo` slots,
    the `score` width of `score_index` (None: the batch has none) and, for a model with Gated
    DeltaNet layers, the `chunks` per device, the `exports` (chunk states other devices enter
    from) and the `conv_halo` slots (`jtree.layout.context_gdn_tables`; None otherwise). Each on a ladder,
    so a run compiles its step for few shapes; the processes of a multi-process run agree on one
    (`agreed`), since the step's arrays have one global shape."""

    halo: int
    score: int | None = None
    chunks: int | None = None
    exports: int | None = None
    conv_halo: int | None = None


def context_capacities(batch: DeviceBatch, context: int, conv_kernel: int | None = None
                       ) -> ContextCapacities:
    """What `batch` (host arrays, [..., rows, S]) needs when its rows are split over `context`
    devices, each rounded up on its ladder: the halo and the exports and conv halo to powers of
    two (at least 8), the score width on the planner's score-width ladder, the chunks per device
    on `jtree.layout.gdn_tables.default_chunk_count`'s buckets. `conv_kernel`: the Gated DeltaNet
    conv's taps, needed when the batch has `gdn` tables."""
    seq_len = batch.tokens.shape[-1]
    length = device_slice(seq_len, context)
    if batch.prefix_pred is not None:
        raise ValueError(f"mesh.context={context}: the batch has 'prefix_pred' (a redundancy-free "
                         "part), which does not run under context parallelism")
    pred = np.asarray(batch.pred)
    caps = ContextCapacities(halo=octave_step_length(halo_capacity(pred, context), 1))
    if batch.score_index is not None:
        per = _scored_per_device(np.asarray(batch.score_index), seq_len, context)
        caps = dataclasses.replace(caps, score=score_width(
            max([0] + [len(x) for row in per for x in row]), length))
    if batch.gdn is not None:
        _check_conv_kernel(batch, conv_kernel)
        chunk_size = batch.gdn.chunk_tokens.shape[-1]
        need = context_gdn_tables(np.asarray(batch.node).reshape(-1, seq_len),
                                  pred.reshape(-1, seq_len), context, chunk_size, conv_kernel)
        chunks, exports, conv_halo = (x.shape[-1] // context for x in (
            need.chunk_src, need.context_exports, need.conv_halo))
        caps = dataclasses.replace(
            caps, chunks=default_chunk_count(length, chunk_size, chunks),
            exports=octave_step_length(exports, 1), conv_halo=octave_step_length(conv_halo, 1))
    return caps


def _check_conv_kernel(batch: DeviceBatch, conv_kernel: int | None) -> None:
    if batch.gdn is not None and conv_kernel is None:
        raise ValueError("context_batch: the batch has 'gdn' chunk tables; pass conv_kernel "
                         "(the model's linear_conv_kernel_dim)")


def agreed(capacities: ContextCapacities) -> ContextCapacities:
    """The capacities every process of the run lays its rows out at: the largest of each over
    the processes (one small all-gather; `capacities` itself in a one-process run). Every
    process must call it at the same point of its step."""
    if jax.process_count() == 1:
        return capacities
    from jax.experimental import multihost_utils

    fields = [f.name for f in dataclasses.fields(capacities)]
    mine = np.array([getattr(capacities, f) or 0 for f in fields], np.int64)
    most = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, len(fields)).max(0)
    return ContextCapacities(**{f: (int(v) if getattr(capacities, f) is not None else None)
                                for f, v in zip(fields, most)})


def check_rows_within_processes(mesh: Mesh) -> None:
    """An error naming `mesh.context` when a row's devices (a row shard's context x model group)
    span processes: each process feeds whole rows of its own row shards."""
    groups = mesh.devices.reshape(row_shards(mesh), -1)
    for shard, group in enumerate(groups):
        owners = sorted({d.process_index for d in group.flat})
        if len(owners) > 1:
            raise ValueError(
                f"mesh.context={mesh.shape[CONTEXT]} x mesh.model={mesh.shape[MODEL]}: the "
                f"devices of row shard {shard} span processes {owners}; make context x model "
                f"divide the {jax.local_device_count()} devices of one process (each process "
                "feeds whole rows)")


def context_batch(batch: DeviceBatch, context: int, *, conv_kernel: int | None = None,
                  capacities: ContextCapacities | None = None) -> DeviceBatch:
    """`batch` (host arrays, [..., rows, S]) ready to run with its rows split over `context`
    devices, at `capacities` (default: what it needs, `context_capacities`): the halo added,
    `score_index` laid out per device (`score_layout`) and, for a model with Gated DeltaNet
    layers (the batch has `gdn` tables), the chunk tables rebuilt per device
    (`jtree.layout.context_gdn_tables.context_gdn_tables`, for a conv of `conv_kernel` taps). An error
    names `mesh.context` when it does not divide S, and a redundancy-free part (a prefix), which
    does not run under context parallelism."""
    _check_conv_kernel(batch, conv_kernel)
    caps = capacities or context_capacities(batch, context, conv_kernel)
    seq_len = batch.tokens.shape[-1]
    pred = np.asarray(batch.pred)
    score = batch.score_index
    if score is not None:
        score = score_layout(np.asarray(score), seq_len, context, width=caps.score)
    gdn = batch.gdn
    if gdn is not None:
        lead = pred.shape[:-1]
        tables = context_gdn_tables(
            np.asarray(batch.node).reshape(-1, seq_len), pred.reshape(-1, seq_len), context,
            gdn.chunk_tokens.shape[-1], conv_kernel, n_chunks=caps.chunks,
            n_exports=caps.exports, n_halo=caps.conv_halo)
        gdn = jax.tree_util.tree_map(lambda x: x.reshape(*lead, *x.shape[1:]), tables)
    return dataclasses.replace(batch, halo=halo_positions(pred, context, caps.halo),
                               score_index=score, gdn=gdn)


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
    once per forward), the queries at the slice's offset and which of them are real (local, like
    the queries); a sliding window's path positions are gathered like the ends."""
    if mask.prefix_end is not None:
        raise ValueError("mesh.context > 1 with a redundancy-free part (a prefix): not supported "
                         "yet; run redundancy-free mode with mesh.context=1")
    local_len = mask.end.shape[-1]
    positions = None if mask.positions is None else gathered_row(mask.positions, axis)
    return TreeMask(gathered_row(mask.end, axis), query_offset=slice_offset(local_len, axis),
                    real=mask.real, positions=positions, window=mask.window)


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
                         "jtree.parallel.context.context_batch")
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
