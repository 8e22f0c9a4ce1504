"""Host tables of the Gated DeltaNet layers for rows split over a context-parallel mesh axis
(docs/kernels.md, "Gated DeltaNet under context parallelism"; the layout: CP_CONVENTION, a row of
c L tokens whose device k holds [k L, (k + 1) L), possibly with gaps, every index global).

- `context_chunk_tables`: the chunk tables of such a row. Chunks never span two devices: a node
  segment cut by a slice boundary (or by a gap) continues in a new chunk on the next device,
  entering from the piece before it. Device k's chunks are the global chunks
  [k NCL, (k + 1) NCL) (NCL a static per-device capacity), so the tables are ordinary
  `GdnTables` split over the axis like any per-device array, holding global token positions,
  global buffer slots and global token slots. `context_exports` lists, per device, the chunks
  whose final state a chunk of another device enters from (the boundary maps it sends).
- `conv_halo_positions`: per device, the positions whose conv inputs tokens of other devices read
  as their left context (the k - 1 previous tokens along the pred chain).
- `context_gdn_tables`: both, as the `GdnTables` (`context_exports`, `conv_halo`) the Gated
  DeltaNet layers read under `RuntimeConfig.context_axis`.

Both export lists share one layout (`device_exports`), the one the attention halo of
`jtree.parallel.context` uses: device k's entries fill slots [k E, (k + 1) E), ascending, unused
slots repeating the last real entry before them (-1 before any), so that the whole row is
non-decreasing and an entry's first occurrence is its own slot: a device finds where an entry
lives in the all-gathered list by binary search.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jtree.layout.batch import GdnTables
from jtree.layout.gdn_tables import concat_ranges


def device_slice(seq_len: int, context: int) -> int:
    """L, the tokens each of `context` devices holds of a row of `seq_len`; an error naming
    `mesh.context` when it does not divide the row."""
    if context < 1 or seq_len % context:
        raise ValueError(f"mesh.context={context} does not divide the row length S={seq_len} "
                         "(context parallelism splits every row into equal device slices)")
    return seq_len // context


def device_exports(needed: list[np.ndarray], owner_size: int, context: int,
                   capacity: int | None, what: str) -> np.ndarray:
    """[rows, c E]: for each row, the entries `needed[row]` (global indices: a device owns
    [k owner_size, (k + 1) owner_size)) laid out per owning device as the module docstring says.
    E is `capacity`, or the most any device of any row exports (at least 1) when None; an entry
    count over it is an error naming `what` and the row and device."""
    per = [[np.unique(e[e // owner_size == k]) for k in range(context)] for e in needed]
    most = max([1] + [len(x) for row in per for x in row])
    width = most if capacity is None else capacity
    out = np.full((len(needed), context * width), -1, np.int32)
    for r, row in enumerate(per):
        for k, entries in enumerate(row):
            if len(entries) > width:
                raise ValueError(f"{what}: capacity {width}, but row {r}, device {k} of "
                                 f"mesh.context={context} exports {len(entries)}")
            out[r, k * width:k * width + len(entries)] = entries
        out[r] = np.maximum.accumulate(out[r])
    return out


def conv_halo_positions(pred: np.ndarray, context: int, width: int,
                        capacity: int | None = None) -> np.ndarray:
    """[rows, c H] positions each device exports for the conv of a row split over `context`
    devices: those of its tokens that tokens of later devices reach within `width` (= conv kernel
    - 1) steps of the pred chain. `pred` [rows, S] (global, -1 for a path's first token and on
    padding). H is `capacity` (default: the smallest that holds every row)."""
    pred = np.asarray(pred)
    length = device_slice(pred.shape[1], context)
    owner = np.arange(pred.shape[1]) // length
    needed = []
    for row in pred:
        step, found = row, []
        for _ in range(width):
            cross = (step >= 0) & (step // length != owner)
            found.append(step[cross])
            step = np.where(step >= 0, row[np.maximum(step, 0)], -1)
        needed.append(np.concatenate(found) if found else np.zeros(0, np.int64))
    return device_exports(needed, length, context, capacity, "conv halo")


def context_chunk_tables(node: np.ndarray, pred: np.ndarray, context: int, chunk_size: int,
                         n_chunks: int | None = None, n_exports: int | None = None) -> GdnTables:
    """The GDN chunk tables of rows split over `context` devices, from the rows' `node` and
    `pred` [rows, S] (the `DeviceBatch` fields; global positions; node -1 on padding and gaps).

    A segment (run of tokens that one chunk chain walks) starts at a real token that begins a
    device slice, changes node, or does not continue the token before it (pred[i] != i - 1: a
    node whose parent is not right before it, a new tree, the piece after a gap). It enters from
    the state after token pred[start] (the parent's last token, or the piece before the gap),
    which always ends a segment, or from slot 0 (zeros) when pred[start] = -1.

    `n_chunks` is NCL, the chunks per device (default: the most any device needs), `n_exports`
    E (default: the most any device exports). Returns `GdnTables` with `chunk_tokens`
    [rows, c NCL, C] (global token positions, -1 empty), `chunk_src` [rows, c NCL] (0, or
    1 + the global chunk whose final state the chunk enters from), `token_slot` [rows, S] (global
    chunk * C + j, -1 on padding) and `context_exports` [rows, c E] (`device_exports` of the
    chunks that chunks of other devices enter from).
    """
    node, pred = np.asarray(node), np.asarray(pred)
    if node.shape != pred.shape or node.ndim != 2:
        raise ValueError(f"node and pred must be [rows, S] alike; got {node.shape}, {pred.shape}")
    rows, seq_len = node.shape
    length = device_slice(seq_len, context)
    pos = np.arange(seq_len)
    per_row = []
    for r in range(rows):
        real = node[r] >= 0
        prev_node = np.r_[-1, node[r, :-1]]
        start = real & ((pos % length == 0) | (node[r] != prev_node) | (pred[r] != pos - 1))
        seg_start = pos[start]
        seg_id = np.cumsum(start) - 1
        seg_len = np.bincount(seg_id[real], minlength=len(seg_start))
        n_ch = -(-seg_len // chunk_size)
        seg_dev = seg_start // length
        # Each segment's first chunk among its device's chunks (segments are in token order).
        first = np.cumsum(n_ch) - n_ch
        dev_base = np.array([first[seg_dev == k][0] if np.any(seg_dev == k) else 0
                             for k in range(context)])
        local_first = first - dev_base[seg_dev]
        per_row.append((seg_start, seg_len, n_ch, seg_dev, local_first, seg_id))
    need = max([1] + [int(np.bincount(d, weights=n, minlength=context).max())
                      for _, _, n, d, _, _ in per_row])
    ncl = need if n_chunks is None else n_chunks
    if need > ncl:
        raise ValueError(f"gdn_chunks: {ncl} chunks per device, but a device of a row split over "
                         f"mesh.context={context} needs {need} (chunks of {chunk_size} tokens; "
                         "every node and every device slice starts a new chunk)")

    tokens = np.full((rows, context * ncl, chunk_size), -1, np.int32)
    src = np.zeros((rows, context * ncl), np.int32)
    slot = np.full((rows, seq_len), -1, np.int32)
    crossing = []
    for r, (seg_start, seg_len, n_ch, seg_dev, local_first, seg_id) in enumerate(per_row):
        first_global = seg_dev * ncl + local_first
        last_global = first_global + n_ch - 1
        parent_tok = pred[r, seg_start]
        parent_seg = seg_id[np.maximum(parent_tok, 0)]
        enters = np.where(parent_tok >= 0, last_global[parent_seg] + 1, 0)
        # One entry per chunk.
        c_seg = np.repeat(np.arange(len(seg_start)), n_ch)
        c_j = concat_ranges(n_ch)
        c_global = first_global[c_seg] + c_j
        c_start = seg_start[c_seg] + c_j * chunk_size
        c_len = np.minimum(chunk_size, seg_len[c_seg] - c_j * chunk_size)
        c_src = np.where(c_j > 0, c_global, enters[c_seg])
        src[r, c_global] = c_src
        t_chunk = np.repeat(np.arange(len(c_global)), c_len)
        t_j = concat_ranges(c_len)
        t_tok = c_start[t_chunk] + t_j
        tokens[r, c_global[t_chunk], t_j] = t_tok
        slot[r, t_tok] = c_global[t_chunk] * chunk_size + t_j
        parent_chunk = c_src - 1
        remote = (c_src > 0) & (parent_chunk // ncl != c_global // ncl)
        crossing.append(parent_chunk[remote])
    exports = device_exports(crossing, ncl, context, n_exports, "gdn context exports")
    return GdnTables(tokens, src, slot, context_exports=exports)


def context_gdn_tables(node: np.ndarray, pred: np.ndarray, context: int, chunk_size: int,
                       conv_kernel: int, *, n_chunks: int | None = None,
                       n_exports: int | None = None, n_halo: int | None = None) -> GdnTables:
    """All the GDN layers of rows split over `context` devices read: `context_chunk_tables`
    with `conv_halo` (`conv_halo_positions` for a conv of `conv_kernel` taps). Fix the three
    capacities to give every micro-batch the same shapes."""
    tables = context_chunk_tables(node, pred, context, chunk_size, n_chunks, n_exports)
    return dataclasses.replace(
        tables, conv_halo=conv_halo_positions(pred, context, conv_kernel - 1, n_halo))
