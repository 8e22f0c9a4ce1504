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

Host side: `context_batch` checks that c divides the row, adds the halo and lays `score_index`
out per device (each device scores the tokens it holds). The same batch runs unchanged on one
device: the halo is ignored there and `score_index` is still a list of positions.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jtree.batch import DeviceBatch
from jtree.kernels import TreeMask
from jtree.planner import octave_step_length, score_width


def _check_split(seq_len: int, context: int) -> int:
    """L, the tokens of one device; an error naming `mesh.context` when c does not divide S."""
    if context < 1 or seq_len % context:
        raise ValueError(f"mesh.context={context} does not divide the row length S={seq_len} "
                         "(context parallelism splits every row into equal device slices)")
    return seq_len // context


def _exports(pred: np.ndarray, context: int) -> list[list[np.ndarray]]:
    """Per row and device, the ascending positions of that device whose hidden states tokens of
    other devices are scored by."""
    rows, s = pred.shape
    length = _check_split(s, context)
    owner = np.arange(s) // length
    out = []
    for r in range(rows):
        src = pred[r]
        cross = (src >= 0) & (src // length != owner)
        needed = np.unique(src[cross])
        out.append([needed[needed // length == k] for k in range(context)])
    return out


def halo_capacity(pred: np.ndarray, context: int) -> int:
    """H, the halo slots each device needs for rows `pred` [..., rows, S] split over `context`
    devices: the most positions any device of any row must export (at least 1, so the halo's
    shape never vanishes). The planner sizes batches with it (one H for all micro-batches)."""
    pred = np.asarray(pred)
    flat = pred.reshape(-1, pred.shape[-1])
    return max([1] + [len(e) for row in _exports(flat, context) for e in row])


def halo_positions(pred: np.ndarray, context: int, capacity: int) -> np.ndarray:
    """The `halo` field [..., rows, c H] for `pred` [..., rows, S]: device k's exports in slots
    [k H, (k + 1) H), ascending, unused slots repeating the last real position before them (-1
    before any), so the whole row is non-decreasing and a position's first occurrence is its
    slot (`scoring_view` finds it by binary search)."""
    pred = np.asarray(pred)
    flat = pred.reshape(-1, pred.shape[-1])
    out = np.full((flat.shape[0], context * capacity), -1, np.int32)
    for r, per_device in enumerate(_exports(flat, context)):
        for k, positions in enumerate(per_device):
            if len(positions) > capacity:
                raise ValueError(f"halo capacity {capacity}: row {r}, device {k} of mesh.context="
                                 f"{context} exports {len(positions)} hidden states (size it "
                                 "with jtree.context_parallel.halo_capacity)")
            out[r, k * capacity:k * capacity + len(positions)] = positions
        out[r] = np.maximum.accumulate(out[r])
    return out.reshape(*pred.shape[:-1], context * capacity)


def score_layout(score_index: np.ndarray, seq_len: int, context: int,
                 width: int | None = None) -> np.ndarray:
    """`score_index` [..., rows, K] laid out per device: [..., rows, c K'], device k's slots
    holding the scored positions it owns (ascending; -1 fills). K' is `width`, by default the
    most any device of any row scores rounded up on the planner's score-width ladder
    (`jtree.planner.score_width`), so steps compile for few widths. Still a list of row
    positions, valid on one device too."""
    length = _check_split(seq_len, context)
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


def context_batch(batch: DeviceBatch, context: int, halo: int | None = None) -> DeviceBatch:
    """`batch` (host arrays, [..., rows, S]) ready to run with its rows split over `context`
    devices: the halo added (`halo` slots per device; default `halo_capacity` rounded up to a
    power of two, at least 8, so steps compile for few halo sizes) and `score_index` laid out
    per device (`score_layout`). An error names `mesh.context` when it does not divide S, and
    the batch fields context parallelism does not run yet."""
    seq_len = batch.tokens.shape[-1]
    _check_split(seq_len, context)
    unsupported = {"gdn": "gated deltanet chunk tables", "prefix_pred": "a redundancy-free part"}
    for name, what in unsupported.items():
        if getattr(batch, name) is not None:
            raise ValueError(f"mesh.context={context}: the batch has {name!r} ({what}), which "
                             "does not run under context parallelism yet")
    pred = np.asarray(batch.pred)
    capacity = octave_step_length(halo_capacity(pred, context), 1) if halo is None else halo
    score = batch.score_index
    if score is not None:
        score = score_layout(np.asarray(score), seq_len, context)
    return dataclasses.replace(batch, halo=halo_positions(pred, context, capacity),
                               score_index=score)


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
    the queries)."""
    if mask.prefix_end is not None:
        raise ValueError("mesh.context > 1 with a redundancy-free part (a prefix): not supported "
                         "yet; run redundancy-free mode with mesh.context=1")
    local_len = mask.end.shape[-1]
    return TreeMask(gathered_row(mask.end, axis), query_offset=slice_offset(local_len, axis),
                    real=mask.real)


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
