"""Block sparsity of the tree mask, computed from `end` alone.

For a q-block [qa, qb] and a kv-block [ka, kb], the block is
- empty   when no key j of the block with j <= qb has end[j] > qa (no query of the block sees it),
- full    when kb <= qa and min(end[ka..kb]) > qb (every query sees every key),
- partial otherwise (the kernel applies the element test j <= i < end[j]).
This is docs/design.md section 2's rule, made exact for kv-blocks that reach past the q-block's last
query (only possible when the two block sizes differ): there the maximum of `end` is taken over the
keys j <= qb only.

Rectangular layouts (`q_pos`): when the queries are a subset of the key positions (a part whose
keys are cached prefix tokens followed by its own tokens, and whose queries are only its own
tokens), query i sits at key position q_pos[i] (non-decreasing) and the same rules apply with
qa = q_pos of the block's first query and qb = q_pos of its last.

Query blocks with no real query (`q_real`): a gap in a context-parallel row (docs/context_parallel.md)
is padding inside the intervals of the nodes it cuts, so by the rule above its queries see all
those nodes' ancestors and its blocks would be as dear as real ones. Nothing reads a padding
query's output (padding keys are visible only to their own query, padding tokens are never scored,
so their cotangent is zero), so a q-block whose queries are all padding keeps only the kv-blocks
that overlap its own key positions [qa, qb]: every padding query still sees its own key (end[g] =
g + 1), its softmax row is never empty (no NaN anywhere), and every other block is EMPTY. Real
queries' outputs and all gradients are unchanged, provided the forward and backward passes read
the same tables (a padding query's backward must not meet a key its forward did not see).

Sliding window (`window` W, `key_pos` [rows, Skv] the path position of every key; a query's path
position is that of the key position it sits at): a block is also EMPTY when even its
lowest-positioned query is W or more past the highest-positioned key of the block that is not after
the q-block's last query (min pos_q - max pos_k >= W: the window fails for every pair), and FULL
only when the window holds for every pair too (max pos_q - min pos_k < W). Both tests are
conservative: a block they keep as PARTIAL gets the element test j <= q_pos[i] < end[j] and
pos[i] - pos[j] < W. Every query keeps the block of its own key (its own pair passes both rules).

`block_tables` turns the classes into per-q-block lists of non-empty kv-blocks (for the forward
and dq passes) and per-kv-block lists of non-empty q-blocks (for the dkv pass), padded to a static
length. Padding entries repeat the last real entry, so a pipelined kernel that prefetches "the next
block" fetches nothing new, and carry kind EMPTY so they are skipped. Works on numpy arrays (host)
and on jax arrays (under jit) with the same code; the tables are host arrays when every input is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

EMPTY, PARTIAL, FULL = 0, 1, 2


def _xp(x: Any):
    return np if isinstance(x, np.ndarray) else jnp


def classify_blocks(end: Any, block_q: int, block_kv: int, q_pos: Any = None,
                    q_real: Any = None, *, window: int | None = None,
                    key_pos: Any = None) -> Any:
    """[rows, Sq/block_q, Skv/block_kv] int8 block classes (EMPTY, PARTIAL, FULL).

    `end` [rows, Skv]; `q_pos` [rows, Sq] is the key position of every query (default: query i at
    position i, Sq = Skv), non-decreasing along each row; `q_real` [rows, Sq] bool marks the real
    queries (None: all), a q-block without one keeps only the blocks of its own key positions;
    `window` with `key_pos` [rows, Skv] (path positions of the keys) drops the blocks outside
    every query's window (module docstring).
    """
    # Host tables only when every input is a host array.
    xp = jnp if any(x is not None and _xp(x) is jnp
                    for x in (end, q_real, q_pos, key_pos if window is not None else None)) else np
    end = xp.asarray(end)
    rows, s = end.shape
    sq = s if q_pos is None else q_pos.shape[1]
    if sq % block_q or s % block_kv:
        what = f"S={s}" if q_pos is None else f"Sq={sq} (block_q) and Skv={s} (block_kv)"
        raise ValueError(f"{what} must be a multiple of block_q={block_q} and block_kv={block_kv}")
    nq, nk = sq // block_q, s // block_kv
    end_blocks = end.reshape(rows, nk, block_kv)
    if xp is np:
        prefix_max = np.maximum.accumulate(end_blocks, axis=-1)
    else:
        prefix_max = jax.lax.cummax(end_blocks, axis=2)
    end_min = end_blocks.min(axis=-1)  # [rows, nk]
    if q_pos is None:
        qa = xp.arange(nq)[None, :, None] * block_q  # [1, nq, 1]
        qb = qa + block_q - 1
    else:
        q_blocks = q_pos.reshape(rows, nq, block_q)
        qa, qb = q_blocks[:, :, :1], q_blocks[:, :, -1:]  # [rows, nq, 1]
    ka = xp.arange(nk)[None, None, :] * block_kv  # [1, 1, nk]
    kb = ka + block_kv - 1
    # Max of end over the keys of the block that are not after the q-block's last query.
    last = xp.clip(xp.minimum(kb, qb) - ka, 0, block_kv - 1)  # [rows | 1, nq, nk]
    last = xp.broadcast_to(last, (rows, nq, nk))
    row_index = xp.arange(rows)[:, None, None]
    kv_index = xp.arange(nk)[None, None, :]
    reach = prefix_max[row_index, kv_index, last]  # [rows, nq, nk]
    nonempty = (ka <= qb) & (reach > qa)
    if q_real is not None:
        if tuple(q_real.shape) != (rows, sq):
            raise ValueError(f"q_real: shape {tuple(q_real.shape)}, expected [rows, Sq] = "
                             f"{(rows, sq)}")
        live = q_real.reshape(rows, nq, block_q).any(axis=-1)[:, :, None]  # [rows, nq, 1]
        nonempty = nonempty & (live | ((ka <= qb) & (kb >= qa)))
    full = nonempty & (kb <= qa) & (end_min[:, None, :] > qb)
    if window is not None:
        if key_pos is None or tuple(key_pos.shape) != (rows, s):
            raise ValueError(f"key_pos: a window needs the keys' path positions [rows, Skv] = "
                             f"{(rows, s)}")
        key_pos = xp.asarray(key_pos).astype(xp.int32)
        path_q = key_pos if q_pos is None else xp.take_along_axis(
            key_pos, xp.asarray(q_pos).astype(xp.int32), axis=1)
        path_q = path_q.reshape(rows, nq, block_q)
        q_low, q_high = path_q.min(-1)[:, :, None], path_q.max(-1)[:, :, None]  # [rows, nq, 1]
        pos_blocks = key_pos.reshape(rows, nk, block_kv)
        pos_max = (np.maximum.accumulate(pos_blocks, axis=-1) if xp is np
                   else jax.lax.cummax(pos_blocks, axis=2))
        k_high = pos_max[row_index, kv_index, last]  # [rows, nq, nk], keys j <= qb
        k_low = pos_blocks.min(-1)[:, None, :]  # [rows, 1, nk]
        in_window = q_low - k_high < window
        nonempty = nonempty & in_window
        full = full & in_window & (q_high - k_low < window)
    return xp.where(full, FULL, xp.where(nonempty, PARTIAL, EMPTY)).astype(xp.int8)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockTables:
    """Compacted block lists. `kv_*` are per q-block (forward, dq); `q_*` per kv-block (dkv).

    `kv_blocks[r, i, n]` is the n-th non-empty kv-block of q-block i (ascending), `kv_kind` its
    class (EMPTY marks padding past `kv_count`). Likewise for `q_blocks`, `q_kind`, `q_count`.
    """

    kv_blocks: Any
    kv_kind: Any
    kv_count: Any
    q_blocks: Any
    q_kind: Any
    q_count: Any
    block_q: int = dataclasses.field(metadata=dict(static=True))
    block_kv: int = dataclasses.field(metadata=dict(static=True))


def _compact(classes: Any, max_len: int) -> tuple[Any, Any, Any]:
    """Per leading index, the positions of non-EMPTY entries along the last axis, padded."""
    xp = _xp(classes)
    nonempty = classes != EMPTY
    count = nonempty.sum(axis=-1).astype(xp.int32)
    order = xp.argsort(~nonempty, axis=-1, kind="stable") if xp is np else jnp.argsort(
        ~nonempty, axis=-1, stable=True)
    order = order[..., :max_len].astype(xp.int32)
    slot = xp.arange(max_len)
    valid = slot < count[..., None]
    last = xp.take_along_axis(order, xp.clip(count - 1, 0, None)[..., None], axis=-1)
    index = xp.where(valid, order, last).astype(xp.int32)
    kind = xp.where(valid, xp.take_along_axis(classes, index, axis=-1), EMPTY).astype(xp.int32)
    return index, kind, count


def block_tables(
    end: Any,
    block_q: int,
    block_kv: int,
    *,
    max_kv_blocks: int | None = None,
    max_q_blocks: int | None = None,
    q_pos: Any = None,
    q_real: Any = None,
    window: int | None = None,
    key_pos: Any = None,
) -> BlockTables:
    """Block lists of the tree mask given by `end` [rows, S] (and `q_pos`, `q_real`, see
    `classify_blocks`).

    `max_kv_blocks` / `max_q_blocks` fix the padded list lengths (default: all blocks, which always
    suffices). With numpy input a budget smaller than a list raises; under jit the caller sizes the
    budget with `required_blocks` on the host (the batch bucket), since a traced value cannot.
    """
    classes = classify_blocks(end, block_q, block_kv, q_pos, q_real, window=window,
                              key_pos=key_pos)
    nq, nk = classes.shape[1:]
    max_kv = nk if max_kv_blocks is None else max_kv_blocks
    max_q = nq if max_q_blocks is None else max_q_blocks
    if isinstance(classes, np.ndarray):
        need_kv, need_q = _required(classes)
        if need_kv > max_kv or need_q > max_q:
            raise ValueError(
                f"block budget too small: need {need_kv} kv-blocks per q-block and {need_q} "
                f"q-blocks per kv-block, got max_kv_blocks={max_kv}, max_q_blocks={max_q}"
            )
    kv_blocks, kv_kind, kv_count = _compact(classes, max_kv)
    q_blocks, q_kind, q_count = _compact(classes.transpose(0, 2, 1), max_q)
    return BlockTables(kv_blocks, kv_kind, kv_count, q_blocks, q_kind, q_count, block_q, block_kv)


def _required(classes: np.ndarray) -> tuple[int, int]:
    nonempty = classes != EMPTY
    return int(nonempty.sum(-1).max(initial=0)), int(nonempty.sum(-2).max(initial=0))


def round_up_to_blocks(s: int, block_q: int, block_kv: int) -> int:
    """The smallest length >= s that both block sizes divide."""
    m = int(np.lcm(block_q, block_kv))
    return -(-s // m) * m


def block_padding(default: int) -> tuple[Callable[..., int], Callable[..., tuple[int, int]]]:
    """(padded_length, padded_lengths) of a kernel whose block sizes default to `default`: the
    lengths `tree_attention` pads a square call (S) and a rectangular prefix call (Sq, Skv) to,
    given the call's `block_q` / `block_kv` options."""
    def padded_length(s: int, *, block_q: int | None = None, block_kv: int | None = None,
                      **_options) -> int:
        return round_up_to_blocks(s, block_q or default, block_kv or default)

    def padded_lengths(sq: int, skv: int, *, block_q: int | None = None,
                       block_kv: int | None = None, **_options) -> tuple[int, int]:
        bq, bk = block_q or default, block_kv or default
        return -(-sq // bq) * bq, -(-skv // bk) * bk

    return padded_length, padded_lengths


def required_blocks(end: np.ndarray, block_q: int, block_kv: int,
                    q_pos: np.ndarray | None = None, *, window: int | None = None,
                    key_pos: np.ndarray | None = None) -> tuple[int, int]:
    """(max non-empty kv-blocks of any q-block, max non-empty q-blocks of any kv-block); a
    bound also for tables with `q_real`, which only remove blocks."""
    q_pos = None if q_pos is None else np.asarray(q_pos)
    key_pos = None if key_pos is None else np.asarray(key_pos)
    return _required(classify_blocks(np.asarray(end), block_q, block_kv, q_pos, window=window,
                                     key_pos=key_pos))


def nonempty_fraction(end: np.ndarray, block_q: int, block_kv: int,
                      q_pos: np.ndarray | None = None, *, window: int | None = None,
                      key_pos: np.ndarray | None = None) -> float:
    """Fraction of all (q-block, kv-block) pairs that are non-empty: the work a block-sparse
    kernel does relative to dense attention."""
    q_pos = None if q_pos is None else np.asarray(q_pos)
    key_pos = None if key_pos is None else np.asarray(key_pos)
    classes = classify_blocks(np.asarray(end), block_q, block_kv, q_pos, window=window,
                              key_pos=key_pos)
    return float((classes != EMPTY).mean())
