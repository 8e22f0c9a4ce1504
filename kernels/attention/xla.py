"""Block-sparse tree attention in plain XLA: work and memory proportional to the non-empty blocks.

The sequence is cut into q-blocks of `block_q` and kv-blocks of `block_kv` tokens. Each q-block
keeps flash-style running statistics (max, sum, weighted values) while it walks its own list of
non-empty kv-blocks (`jtree.kernels.block_tables`), gathering one kv-block per step; a loop whose trip
count is read from the data, so there is no static block budget and no [q-blocks, max-blocks, ...]
gather. With `group` > 1, q-blocks are sorted by list length and processed `group` at a time (one
bigger matmul per step; a group runs as many steps as its longest list, so work grows a little
beyond the non-empty block count). On CPU group 1 measured fastest and does exactly the non-empty
blocks; live memory is one group's blocks plus O(S) inputs and outputs.

The backward pass (custom VJP, residuals: output and log-sum-exp, both O(S)) walks the same
schedule once: it recomputes the probabilities of each visited block, accumulates dq in the loop
and scatter-adds the block's dk and dv contributions into O(S) accumulators.

Heads are laid out so that the Hq / Hkv query heads sharing a kv head form one matrix of
(Hq / Hkv) * block_q rows: one matmul per kv head and block serves all of its query heads.

Rectangular layouts (`q_pos`): the queries may be a subset of the key positions (a part of a tree
whose keys start with the cached prefix of earlier parts); query i sits at key position q_pos[i]
and sees key j iff j <= q_pos[i] < end[j].

Sliding window (`window` W, `key_pos` the keys' path positions): a pair also needs
key_pos[q_pos[i]] - key_pos[j] < W; the block tables drop the blocks outside every query's window
and the element test of the other blocks includes it. Sinks ([Hq] logits): `flash_vjp`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jtree.kernels.attention.flash_vjp import flash_vjp
from jtree.kernels.block_tables import BlockTables, block_tables, round_up_to_blocks
from jtree.kernels.flat_tokens import last_axis_dot
from jtree.kernels.varying_axes import varying_like

DEFAULT_BLOCK = 64
DEFAULT_GROUP = 1  # fastest on CPU (launch/bench/attention.py sweep); larger suits wide devices
_MASKED = -1e30  # finite, so exp(m_old - m_new) never sees inf - inf


class _Config(NamedTuple):
    """Static parameters of one attention call (hashable: passed as a non-differentiable arg)."""

    scale: float
    softcap: float | None
    block_q: int
    block_kv: int
    group: int
    window: int | None = None


class _Schedule(NamedTuple):
    """Which kv-blocks each q-block visits, and in which groups q-blocks are processed.

    Block ids are global over rows: q-block i of row r is r * nq + i (same for kv-blocks). One
    extra q-block id, rows * nq, stands for "no q-block" (padding of the last group): its list is
    empty.
    """

    kv_index: jax.Array  # [rows * nq + 1, max_kv] int32, global kv-block ids
    count: jax.Array  # [rows * nq + 1] int32, list lengths
    groups: jax.Array  # [n_groups, group] int32, q-block ids sorted by decreasing count


def default_blocks(s: int) -> tuple[int, int]:
    """(block_q, block_kv) used when the caller gives none: 64, or S rounded up to 8 if shorter
    (64 measured fastest on CPU at head_dim 64 and 128: launch/bench/attention.py)."""
    b = min(DEFAULT_BLOCK, -(-s // 8) * 8)
    return b, b


def padded_length(s: int, *, block_q: int | None = None, block_kv: int | None = None,
                  **_options) -> int:
    """The length the dispatch pads S to for these blocks."""
    dq, dk = default_blocks(s)
    return round_up_to_blocks(s, block_q or dq, block_kv or dk)


def padded_lengths(sq: int, skv: int, *, block_q: int | None = None, block_kv: int | None = None,
                   **_options) -> tuple[int, int]:
    """(Sq', Skv') the dispatch pads a rectangular (q_pos) call to."""
    bq, bk = _blocks(sq, skv, block_q, block_kv)
    return -(-sq // bq) * bq, -(-skv // bk) * bk


def _blocks(sq: int, skv: int, block_q: int | None, block_kv: int | None) -> tuple[int, int]:
    return block_q or default_blocks(sq)[0], block_kv or default_blocks(skv)[1]


def tree_attention_xla(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    end: jax.Array,
    *,
    scale: float,
    softcap: float | None = None,
    block_q: int | None = None,
    block_kv: int | None = None,
    group: int = DEFAULT_GROUP,
    q_pos: jax.Array | None = None,
    q_real: jax.Array | None = None,
    window: int | None = None,
    key_pos: jax.Array | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Tree attention of q [rows, Sq, Hq, Dk] over k [rows, Skv, Hkv, Dk], v [rows, Skv, Hkv, Dv]
    (Dv may differ from Dk: MLA), output [rows, Sq, Hq, Dv] (see `tree_attention`).

    Without `q_pos`, Sq = Skv = S and query i sits at key position i; S must be a multiple of
    both block sizes (`tree_attention` pads it). With `q_pos` [rows, Sq] (non-decreasing key
    positions of the queries), Sq must be a multiple of block_q and Skv of block_kv. `group` is
    how many q-blocks are processed together: larger groups make bigger matmuls, smaller ones
    waste less work on lists shorter than the longest of their group. `q_real` [rows, Sq]: the
    real queries; q-blocks without one run only their own key blocks (`classify_blocks`).
    `window` with `key_pos` [rows, Skv]: the sliding window along the path; `sinks` [Hq]: the
    attention sinks (`jtree.kernels.attention.flash_vjp`).
    """
    sq, skv = q.shape[1], k.shape[1]
    if q_pos is None:
        dq, dk = default_blocks(sq)
        block_q, block_kv = block_q or dq, block_kv or dk
        if sq % block_q or sq % block_kv:
            raise ValueError(
                f"xla tree attention: S={sq} must be a multiple of block_q={block_q} and "
                f"block_kv={block_kv} (tree_attention pads S; call it instead)")
    else:
        block_q, block_kv = _blocks(sq, skv, block_q, block_kv)
        if sq % block_q or skv % block_kv:
            raise ValueError(
                f"xla tree attention: Sq={sq} must be a multiple of block_q={block_q} and "
                f"Skv={skv} of block_kv={block_kv} (tree_attention pads them; call it instead)")
    if group < 1:
        raise ValueError(f"xla tree attention: group={group} must be >= 1")
    cfg = _Config(float(scale), None if softcap is None else float(softcap), block_q, block_kv,
                  group, window)
    # Built on the host if `end` (and `q_pos`) are numpy arrays.
    sched = jax.tree.map(jnp.asarray, _schedule(end, cfg, q_pos, q_real, key_pos))
    path = None if window is None else jnp.asarray(key_pos, jnp.int32)
    if q_pos is None:
        q_pos = jnp.broadcast_to(jnp.arange(sq, dtype=jnp.int32), (q.shape[0], sq))
    q_pos = jnp.asarray(q_pos, jnp.int32)
    q_path = None if path is None else jnp.take_along_axis(path, q_pos, axis=1)
    return _attention(q, k, v, jnp.asarray(end, jnp.int32), q_pos, path, q_path, sched, cfg,
                      sinks=sinks)


def schedule_work(end: np.ndarray, *, block_q: int | None = None, block_kv: int | None = None,
                  group: int = DEFAULT_GROUP, q_pos: np.ndarray | None = None,
                  window: int | None = None, key_pos: np.ndarray | None = None
                  ) -> tuple[int, int]:
    """(block pairs the schedule computes, non-empty block pairs) for a host `end` (and `q_pos`,
    and a window with the keys' path positions `key_pos`) whose lengths the blocks divide. Their
    ratio is the schedule's overhead (1.0 with group=1)."""
    sq = end.shape[1] if q_pos is None else q_pos.shape[1]
    cfg = _Config(1.0, None, *_blocks(sq, end.shape[1], block_q, block_kv), group, window)
    sched = _schedule(np.asarray(end, np.int32), cfg,
                      None if q_pos is None else np.asarray(q_pos, np.int32),
                      key_pos=None if key_pos is None else np.asarray(key_pos, np.int32))
    computed = int(sched.count[sched.groups].max(axis=1).sum()) * group
    return computed, int(sched.count.sum())


def flat_kv_lists(tables: BlockTables, nk: int) -> tuple:
    """The per-q-block kv-block lists of every row as one list over all rows' q-blocks:
    ([rows * nq, L] global kv-block ids, row r's blocks being r * nk .. r * nk + nk - 1; their
    [rows * nq, L] kinds; [rows * nq] counts), numpy for host tables."""
    xp = np if isinstance(tables.kv_blocks, np.ndarray) else jnp
    rows, nq, max_kv = tables.kv_blocks.shape
    row_base = (xp.arange(rows, dtype=xp.int32) * nk)[:, None, None]
    return ((tables.kv_blocks + row_base).reshape(rows * nq, max_kv),
            tables.kv_kind.reshape(rows * nq, max_kv), tables.kv_count.reshape(rows * nq))


def _schedule(end, cfg: _Config, q_pos=None, q_real=None, key_pos=None) -> _Schedule:
    tables = block_tables(end, cfg.block_q, cfg.block_kv, q_pos=q_pos, q_real=q_real,
                          window=cfg.window, key_pos=key_pos)
    xp = np if isinstance(tables.kv_blocks, np.ndarray) else jnp
    rows, nq, max_kv = tables.kv_blocks.shape
    kv_index, _, count = flat_kv_lists(tables, end.shape[1] // cfg.block_kv)
    order = (np.argsort(-count, kind="stable") if xp is np else
             jnp.argsort(-count, stable=True)).astype(xp.int32)
    n_groups = -(-(rows * nq) // cfg.group)
    pad = n_groups * cfg.group - rows * nq
    groups = xp.concatenate([order, xp.full((pad,), rows * nq, xp.int32)])
    kv_index = xp.concatenate([kv_index, xp.zeros((1, max_kv), xp.int32)])
    count = xp.concatenate([count, xp.zeros((1,), xp.int32)])
    return _Schedule(xp.asarray(kv_index, xp.int32), xp.asarray(count, xp.int32),
                     groups.reshape(n_groups, cfg.group))


# Layout helpers. "Block layout" of q-like arrays: [rows * nq, Hkv, (Hq / Hkv) * block_q, D]
# (row m of a block is query head kv_head * g + m // block_q at position m % block_q); of k-like
# arrays: [rows * nk, Hkv, block_kv, D]; of per-query scalars: [rows * nq, Hkv, g * block_q].


def _q_to_blocks(x: jax.Array, hkv: int, block: int) -> jax.Array:
    rows, s, hq = x.shape[:3]
    g = hq // hkv
    x = x.reshape(rows, s // block, block, hkv, g, *x.shape[3:])
    perm = (0, 1, 3, 4, 2) + tuple(range(5, x.ndim))
    return x.transpose(perm).reshape(rows * (s // block), hkv, g * block, *x.shape[5:])


def _q_from_blocks(x: jax.Array, rows: int, hq: int, block: int) -> jax.Array:
    n, hkv = x.shape[:2]
    g = hq // hkv
    x = x.reshape(rows, n // rows, hkv, g, block, *x.shape[3:])
    perm = (0, 1, 4, 2, 3) + tuple(range(5, x.ndim))
    return x.transpose(perm).reshape(rows, (n // rows) * block, hq, *x.shape[5:])


def _kv_to_blocks(x: jax.Array, block: int) -> jax.Array:
    rows, s, hkv, d = x.shape
    x = x.reshape(rows, s // block, block, hkv, d).transpose(0, 1, 3, 2, 4)
    return x.reshape(rows * (s // block), hkv, block, d)


def _kv_from_blocks(x: jax.Array, rows: int) -> jax.Array:
    n, hkv, block, d = x.shape
    x = x.reshape(rows, n // rows, hkv, block, d).transpose(0, 1, 3, 2, 4)
    return x.reshape(rows, (n // rows) * block, hkv, d)


class _Blocks(NamedTuple):
    """Everything the per-block step needs, in block layout."""

    q: jax.Array  # [rows * nq, Hkv, M, Dk]
    k: jax.Array  # [rows * nk, Hkv, bk, Dk]
    v: jax.Array  # [rows * nk, Hkv, bk, Dv]
    end: jax.Array  # [rows * nk, bk]
    path: jax.Array | None  # [rows * nk, bk] the keys' path positions (window only)


def _to_blocks(q, k, v, end, path, cfg: _Config) -> _Blocks:
    hkv = k.shape[2]
    return _Blocks(_q_to_blocks(q, hkv, cfg.block_q), _kv_to_blocks(k, cfg.block_kv),
                   _kv_to_blocks(v, cfg.block_kv), end.reshape(-1, cfg.block_kv),
                   None if path is None else path.reshape(-1, cfg.block_kv))


def _visible(qpos: jax.Array, kid: jax.Array, live: jax.Array, end_k: jax.Array, nk: int,
             cfg: _Config, qpath: jax.Array | None = None,
             kpath: jax.Array | None = None) -> jax.Array:
    """[G, 1, 1, bq, bk] element mask j <= q_pos[i] < end[j] of the q-blocks of a group (their
    query positions `qpos` [G, bq]) against kv-blocks `kid`, and with a window
    qpath[i] - kpath[j] < W (path positions [G, bq], [G, bk]); all False where `live` is False
    (list exhausted, or a padding group member)."""
    kpos = (kid % nk)[:, None] * cfg.block_kv + jnp.arange(cfg.block_kv)  # [G, bk]
    qpos, kpos, end_k = qpos[:, :, None], kpos[:, None, :], end_k[:, None, :]
    mask = (kpos <= qpos) & (qpos < end_k) & live[:, None, None]
    if cfg.window is not None:
        mask = mask & (qpath[:, :, None] - kpath[:, None, :] < cfg.window)
    return mask[:, None, None]


def _scores(qg: jax.Array, kk: jax.Array, cfg: _Config) -> tuple[jax.Array, jax.Array]:
    """Scaled (and soft-capped) scores [G, Hkv, g, bq, bk] in float32, plus the cap's tanh (or
    None) for the backward."""
    s = jnp.einsum("nhmd,nhkd->nhmk", qg, kk, preferred_element_type=jnp.float32) * cfg.scale
    n, h, m, bk = s.shape
    s = s.reshape(n, h, m // cfg.block_q, cfg.block_q, bk)
    if cfg.softcap is None:
        return s, None
    t = jnp.tanh(s / cfg.softcap)
    return cfg.softcap * t, t


def _group_step_inputs(blocks: _Blocks, sched: _Schedule, gid: jax.Array, qpos: jax.Array,
                       n: jax.Array, nk: int, cfg: _Config, qpath: jax.Array | None = None):
    """kv-block ids, k, v and mask for step `n` of every q-block of a group."""
    kid = sched.kv_index[gid, n]
    live = n < sched.count[gid]
    kpath = None if blocks.path is None else blocks.path[kid]
    mask = _visible(qpos, kid, live, blocks.end[kid], nk, cfg, qpath, kpath)
    return kid, blocks.k[kid], blocks.v[kid], mask


def _path_blocks(q_path, rows, nq, cfg: _Config):
    return None if q_path is None else q_path.reshape(rows * nq, cfg.block_q)


def _forward(q, k, v, end, q_pos, path, q_path, sched: _Schedule, cfg: _Config):
    rows, sq, hq, d = q.shape
    nq, nk = sq // cfg.block_q, k.shape[1] // cfg.block_kv
    blocks = _to_blocks(q, k, v, end, path, cfg)
    qpos_blocks = q_pos.reshape(rows * nq, cfg.block_q)
    qpath_blocks = _path_blocks(q_path, rows, nq, cfg)
    hkv, m_rows = blocks.q.shape[1:3]
    stat_shape = (cfg.group, hkv, m_rows // cfg.block_q, cfg.block_q)  # per query row

    def group_body(_, gid):
        qg = jnp.take(blocks.q, gid, axis=0, mode="clip")
        qpos = jnp.take(qpos_blocks, gid, axis=0, mode="clip")
        qpath = (None if qpath_blocks is None else
                 jnp.take(qpath_blocks, gid, axis=0, mode="clip"))

        def step(n, carry):
            m, l, acc = carry
            _, kk, vv, mask = _group_step_inputs(blocks, sched, gid, qpos, n, nk, cfg, qpath)
            s_blk, _ = _scores(qg, kk, cfg)
            m_new = jnp.maximum(m, jnp.where(mask, s_blk, _MASKED).max(axis=-1))
            p = jnp.where(mask, jnp.exp(s_blk - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            pv = jnp.einsum("nhmk,nhkd->nhmd", p.reshape(*qg.shape[:3], -1).astype(v.dtype), vv,
                            preferred_element_type=jnp.float32)
            acc = alpha.reshape(qg.shape[:3])[..., None] * acc + pv
            return m_new, alpha * l + p.sum(axis=-1), acc

        acc_shape = (*qg.shape[:3], v.shape[3])  # the value head dim (MLA: not q's)
        init = varying_like((jnp.full(stat_shape, _MASKED, jnp.float32),
                             jnp.zeros(stat_shape, jnp.float32), jnp.zeros(acc_shape, jnp.float32)),
                            qg, blocks, sched)
        m, l, acc = jax.lax.fori_loop(0, sched.count[gid].max(), step, init)
        l = jnp.where(l > 0, l, 1.0).reshape(qg.shape[:3])
        return None, ((acc / l[..., None]).astype(q.dtype), m.reshape(qg.shape[:3]) + jnp.log(l))

    _, (out, lse) = jax.lax.scan(group_body, None, sched.groups)
    inverse = jnp.argsort(sched.groups.reshape(-1), stable=True)[: rows * nq]
    out = out.reshape(-1, *out.shape[2:])[inverse]
    lse = lse.reshape(-1, *lse.shape[2:])[inverse]
    return _q_from_blocks(out, rows, hq, cfg.block_q), lse


def _backward(cfg, q, k, v, end, q_pos, path, q_path, sched, out, lse, d_out):
    rows, sq, hq, d = q.shape
    nq, nk = sq // cfg.block_q, k.shape[1] // cfg.block_kv
    hkv = k.shape[2]
    blocks = _to_blocks(q, k, v, end, path, cfg)
    qpos_blocks = q_pos.reshape(rows * nq, cfg.block_q)
    qpath_blocks = _path_blocks(q_path, rows, nq, cfg)
    do_blocks = _q_to_blocks(d_out, hkv, cfg.block_q)
    delta = last_axis_dot(d_out, out)
    delta_blocks = _q_to_blocks(delta, hkv, cfg.block_q)
    g = hq // hkv

    def group_body(carry, gid):
        dk_acc, dv_acc = carry
        take = functools.partial(jnp.take, indices=gid, axis=0, mode="clip")
        qg, dog, qpos = take(blocks.q), take(do_blocks), take(qpos_blocks)
        qpath = None if qpath_blocks is None else take(qpath_blocks)
        lse_g = take(lse).reshape(cfg.group, hkv, g, cfg.block_q, 1)
        delta_g = take(delta_blocks).reshape(cfg.group, hkv, g, cfg.block_q, 1)

        def step(n, carry):
            dq, dk_acc, dv_acc = carry
            kid, kk, vv, mask = _group_step_inputs(blocks, sched, gid, qpos, n, nk, cfg, qpath)
            s_blk, t = _scores(qg, kk, cfg)
            p = jnp.where(mask, jnp.exp(s_blk - lse_g), 0.0)
            dp = jnp.einsum("nhmd,nhkd->nhmk", dog, vv, preferred_element_type=jnp.float32)
            ds = p * (dp.reshape(p.shape) - delta_g)
            if t is not None:
                ds = ds * (1.0 - t * t)
            ds = (ds * cfg.scale).reshape(cfg.group, hkv, g * cfg.block_q, cfg.block_kv)
            p = p.reshape(ds.shape)
            dq = dq + jnp.einsum("nhmk,nhkd->nhmd", ds.astype(k.dtype), kk,
                                 preferred_element_type=jnp.float32)
            dk = jnp.einsum("nhmk,nhmd->nhkd", ds.astype(q.dtype), qg,
                            preferred_element_type=jnp.float32)
            dv = jnp.einsum("nhmk,nhmd->nhkd", p.astype(d_out.dtype), dog,
                            preferred_element_type=jnp.float32)
            return dq, dk_acc.at[kid].add(dk), dv_acc.at[kid].add(dv)

        dq0 = varying_like(jnp.zeros(qg.shape, jnp.float32), qg, dog, blocks, sched)
        dq, dk_acc, dv_acc = jax.lax.fori_loop(0, sched.count[gid].max(), step,
                                               (dq0, dk_acc, dv_acc))
        return (dk_acc, dv_acc), dq.astype(q.dtype)

    acc0 = varying_like((jnp.zeros(blocks.k.shape, jnp.float32),
                         jnp.zeros(blocks.v.shape, jnp.float32)), blocks, do_blocks, sched)
    (dk, dv), dq = jax.lax.scan(group_body, acc0, sched.groups)
    inverse = jnp.argsort(sched.groups.reshape(-1), stable=True)[: rows * nq]
    dq = dq.reshape(-1, *dq.shape[2:])[inverse]
    return (_q_from_blocks(dq, rows, hq, cfg.block_q),
            _kv_from_blocks(dk, rows).astype(k.dtype), _kv_from_blocks(dv, rows).astype(v.dtype))


def lse_rows(lse, cfg, q):
    """The kernel's block-layout log-sum-exp [rows * nq, Hkv, g * bq] as [rows, Sq, Hq]."""
    return _q_from_blocks(lse, q.shape[0], q.shape[2], cfg.block_q)


def rows_lse(x, cfg, q, lse):
    """Inverse of `lse_rows` (`lse` gives the layout)."""
    del q
    return _q_to_blocks(x, lse.shape[1], cfg.block_q)


_attention = flash_vjp(_forward, _backward, 8, lse_rows=lse_rows, rows_lse=rows_lse)
