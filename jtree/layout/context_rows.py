"""Context-parallel rows: where one row's tokens go on the c devices of the `context` mesh axis.

A CP row of c devices is an ordinary linearized row of c * L positions (docs/design.md section 3)
whose device k holds the contiguous slice [k L, (k + 1) L). The row's tokens, in DFS order, are cut
into c contiguous pieces; piece k is placed at the start of slice k and the rest of the slice is a
*gap* of padding tokens. Pieces hold different numbers of tokens so that every device gets about
the same attention work: a token deep in a path sees many more keys than a prompt token, so an
even token split leaves the device holding the end of the longest paths with the most work.

Attention work is counted as the kernels do, in (query block, key block) pairs of the block tables
(`jtree.kernels.block_tables`) at the kernel block size B: device k's work is the number of
non-empty pairs whose query block lies in slice k and holds a real token. A gap's query blocks hold
none, so the kernels skip them (the mask's real queries, `jtree.kernels.TreeMask.real`): of
such a block they run only its own (diagonal) key block, one pair, which `slice_work` counts
apart; a gap's keys are seen by gap queries only. Cuts fall on multiples of B in the gapless
(packed) row, so every block of the gapped row is a block of the packed row moved by a multiple
of B: a device's work is exactly the sum of the packed row's per-query-block counts over its blocks
(`block_work`), and the split is a contiguous partition of those counts.

`split_row` picks the cuts: among the splits whose largest work per device is within `slack` of the
least possible, the one with the fewest tokens on its fullest device (which sets L, hence each
device's memory and the bytes of every K/V gather). Exact balance can cost many tokens: the device
holding a long prompt, whose tokens see few keys, takes far more tokens than the others (on
~128k-token agent trees over 8 devices, L is 1.5x the even split's at slack 0 and 1.2x at 0.05;
`jtree.launch.bench.context`). `ContextSplit.place` maps packed positions to
gapped ones; `jtree.layout.linearize` writes every token and every index (`end`, `pred`, chunk tables,
critic pairs, `score_index`) through it, so all tables are built in final coordinates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from jtree.kernels.block_tables import EMPTY, classify_blocks


def check_context(context: int) -> int:
    """`context` as an int, or a ValueError naming the setting (a CP size is a device count)."""
    if isinstance(context, bool) or not isinstance(context, (int, np.integer)) or context < 1:
        raise ValueError(f"context: the context-parallel size must be an int >= 1, "
                         f"got {context!r}")
    return int(context)


def block_work(end: np.ndarray, block: int) -> np.ndarray:
    """Non-empty key blocks of every query block of a packed row, `end` [n] (row positions
    0 .. n, the tokens of the row's trees back to back): [ceil(n / block)] ints, the counts of
    `jtree.kernels.block_tables.classify_blocks` with square blocks, in O(n) instead of the
    (n / block)^2 block matrix (a 1M-token row has 15k blocks of 64).

    Query block a sees its own block (the diagonal: end[j] > j) and an earlier key block b iff
    some key of b is still visible at a's first query, max(end over b) > a * block: for each b,
    the query blocks b + 1 .. ceil(max end / block) - 1, one range."""
    end = np.asarray(end, np.int64)
    nb = -(-len(end) // block)
    padded = np.concatenate([end, np.arange(len(end) + 1, nb * block + 1)])
    reach = -(-padded.reshape(nb, block).max(axis=1) // block)  # one past the last seeing block
    count = np.zeros(nb + 1, np.int64)
    np.add.at(count, np.arange(1, nb + 1), 1)
    np.add.at(count, np.minimum(reach, nb), -1)
    return 1 + np.cumsum(count)[:nb]


@dataclasses.dataclass(frozen=True)
class ContextSplit:
    """One row's split over c devices: piece k holds the packed positions
    [bounds[k], bounds[k + 1]) and sits at the start of slice k of a row of c * L positions."""

    bounds: tuple[int, ...]

    @property
    def context(self) -> int:
        return len(self.bounds) - 1

    @property
    def piece_tokens(self) -> np.ndarray:
        """Tokens of each piece [c]."""
        return np.diff(np.asarray(self.bounds, np.int64))

    def place(self, packed: np.ndarray, slice_len: int) -> np.ndarray:
        """The gapped positions of packed positions `packed` (any shape, each in
        [0, bounds[-1])) in a row of slices of `slice_len` positions."""
        packed = np.asarray(packed, np.int64)
        return place_in_rows([self], np.zeros(packed.shape, np.int64), packed, slice_len)


def place_in_rows(splits: Sequence[ContextSplit], rows: np.ndarray, packed: np.ndarray,
                  slice_len: int) -> np.ndarray:
    """Gapped positions of the packed positions `packed` of rows `rows` (same shape), row r
    split by `splits[r]` into slices of `slice_len` positions: piece k's token p goes to
    k * slice_len + p - bounds[k]. Vectorized over all tokens of a batch."""
    bounds = np.asarray([s.bounds for s in splits], np.int64)  # [rows, c + 1]
    most = int(np.diff(bounds, axis=1).max(initial=0))
    if most > slice_len:
        raise ValueError(f"slice_len={slice_len}: a piece of the split has {most} tokens")
    rows, packed = np.asarray(rows, np.int64), np.asarray(packed, np.int64)
    # Row r's bounds shifted past every earlier row's, so one sorted search finds each piece.
    stride = int(bounds.max(initial=0)) + 1
    flat = (bounds + stride * np.arange(len(bounds))[:, None]).reshape(-1)
    at = np.searchsorted(flat, rows * stride + packed, side="right") - 1
    k = at % bounds.shape[1]
    return k * slice_len + packed - flat[at] + rows * stride


def _greedy_cuts(work: np.ndarray, context: int, max_work: int, max_blocks: int
                 ) -> list[int] | None:
    """Block bounds of the split that fills each piece as far as `max_work` and `max_blocks`
    allow, or None when c pieces cannot hold every block. Taking as much as possible is optimal
    for any limit that holds for every sub-range of an allowed range, so None means no split
    within these limits exists."""
    cum = np.concatenate([[0], np.cumsum(work)])
    n = len(work)
    cuts, at = [0], 0
    for _ in range(context):
        by_work = int(np.searchsorted(cum, cum[at] + max_work, side="right")) - 1
        at = min(by_work, at + max_blocks, n)
        cuts.append(at)
    return cuts if at == n else None


def _least(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """The least value in [lo, hi] for which the monotone `ok` holds (`ok(hi)` must)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def split_row(end: np.ndarray, context: int, *, block: int, max_slice: int,
              slack: float = 0.0) -> ContextSplit:
    """The balanced split of a packed row (`end` [n], see `block_work`) over `context` devices of
    at most `max_slice` tokens each (a multiple of `block`, the kernels' block size): the fewest
    tokens on the fullest device among the splits whose largest attention work is at most
    (1 + `slack`) times the least possible."""
    context = check_context(context)
    if not slack >= 0:
        raise ValueError(f"slack: must be >= 0, got {slack}")
    if max_slice < block or max_slice % block:
        raise ValueError(f"max_slice={max_slice}: must be a positive multiple of the block "
                         f"size {block}")
    n = len(end)
    if n == 0:
        return ContextSplit((0,) * (context + 1))
    work = block_work(end, block)
    cap = max_slice // block
    if len(work) > context * cap:
        raise ValueError(f"context={context}: a row of {n} tokens does not fit {context} devices "
                         f"of {max_slice} tokens (raise data.seq_len or the CP size)")
    most = _least(int(work.max()), int(work.sum()),
                  lambda w: _greedy_cuts(work, context, w, cap) is not None)
    most = int(most * (1 + slack))
    blocks = _least(-(-len(work) // context), cap,
                    lambda b: _greedy_cuts(work, context, most, b) is not None)
    cuts = _greedy_cuts(work, context, most, blocks)
    return ContextSplit(tuple(min(c * block, n) for c in cuts))


def even_split(n: int, context: int, *, block: int) -> ContextSplit:
    """The ordinary row split by token count: slices of L = ceil(n / c) rounded up to `block`,
    no gaps (the layout a CP step gets without a balanced split)."""
    context = check_context(context)
    slice_len = max(block, -(-n // (context * block)) * block)
    return ContextSplit(tuple(min(k * slice_len, n) for k in range(context + 1)))


def slice_length(splits: list[ContextSplit], block: int) -> int:
    """The slice length L of rows split by `splits`: their largest piece, rounded up to
    `block` (at least one block)."""
    most = max((int(s.piece_tokens.max(initial=0)) for s in splits), default=0)
    return max(block, -(-most // block) * block)


@dataclasses.dataclass(frozen=True)
class SliceWork:
    """Per device of a laid-out CP row: `blocks` the non-empty (query block, key block) pairs of
    its query blocks that hold a real token, `tokens` its real tokens, and `gap_blocks` the
    pairs the kernels run on its query blocks that hold none (their own key blocks)."""

    blocks: np.ndarray
    tokens: np.ndarray
    gap_blocks: np.ndarray

    @property
    def kernel_blocks(self) -> np.ndarray:
        """[c] the pairs the kernels' block tables hold for each device's query blocks."""
        return self.blocks + self.gap_blocks


def slice_work(end: np.ndarray, valid: np.ndarray, context: int, *, block: int) -> SliceWork:
    """The attention work and tokens of each device on a laid-out row (`end`, `valid` [S] with
    S = context * L, gapped or not), counted from the kernels' block tables of its `end` with
    the real queries `valid`."""
    context = check_context(context)
    s = len(end)
    if s % (context * block):
        raise ValueError(f"context={context}: a row of {s} positions is not {context} slices of "
                         f"a multiple of the block size {block}")
    valid = np.asarray(valid, bool)
    pairs = (classify_blocks(np.asarray(end, np.int32)[None], block, block,
                             q_real=valid[None])[0] != EMPTY).sum(-1)
    live = valid.reshape(-1, block).any(-1)
    per = s // block // context
    return SliceWork(np.where(live, pairs, 0).reshape(context, per).sum(-1),
                     valid.reshape(context, -1).sum(-1),
                     np.where(live, 0, pairs).reshape(context, per).sum(-1))


def split_nodes(lengths: np.ndarray, node_start: np.ndarray, node_row: np.ndarray,
                parent: np.ndarray, splits: Sequence[ContextSplit], slice_len: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The node arrays of `jtree.layout.gdn_tables.tree_nodes` (packed positions) cut at the rows'
    piece boundaries, in gapped positions. A node that a boundary cuts becomes a chain of
    pieces, each the parent of the next, with the node's children below its last piece: the
    gated delta rule's state runs through the chain exactly as through the one node (a chunk
    is a unit of the scan, not of the math), and no chunk spans two devices."""
    lengths, starts, rows, parent = ([int(v) for v in np.asarray(x)]
                                     for x in (lengths, node_start, node_row, parent))
    order = np.lexsort((np.asarray(starts), np.asarray(rows)))
    keys = np.asarray(rows, np.int64)[order] * (1 << 40) + np.asarray(starts, np.int64)[order]
    last = list(range(len(lengths)))  # each node's last piece
    continues: dict[int, int] = {}  # piece -> the piece it continues
    for r, split in enumerate(splits):
        for b in sorted(set(split.bounds[1:-1])):
            at = int(np.searchsorted(keys, r * (1 << 40) + b, side="right")) - 1
            if at < 0 or rows[order[at]] != r:
                continue
            piece = last[order[at]]
            if not starts[piece] < b < starts[piece] + lengths[piece]:
                continue  # the boundary falls between nodes
            lengths.append(starts[piece] + lengths[piece] - b)
            starts.append(b)
            rows.append(r)
            lengths[piece] = b - starts[piece]
            continues[len(lengths) - 1] = piece
            last[order[at]] = len(lengths) - 1
    new_parent = [last[p] if p >= 0 else -1 for p in parent]
    new_parent += [continues[i] for i in range(len(parent), len(lengths))]
    rows_arr = np.asarray(rows, np.int64)
    return (np.asarray(lengths, np.int64),
            place_in_rows(splits, rows_arr, np.asarray(starts, np.int64), slice_len),
            rows_arr, np.asarray(new_parent, np.int64))
