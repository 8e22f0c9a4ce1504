"""Pallas TPU tree attention: block-sparse flash attention driven by the block tables of `end`.

Splash-attention structure, written for the tree mask:
- the compacted block lists of `jtree.kernels.block_tables` are scalar-prefetched into SMEM; grid step n
  of q-block i works on the n-th listed kv-block, and the BlockSpec index maps read the list, so
  only listed blocks are ever copied into VMEM. List padding repeats the last real block (same
  block index, so the pipeline issues no new DMA) and has kind EMPTY, so its compute is skipped;
- FULL blocks run without a mask; PARTIAL blocks build the element mask j <= i < end[j] from the
  kv-block's slice of `end` and two iotas;
- forward: online softmax with running max and sum in VMEM scratch, writes the output and the
  log-sum-exp (the only residual besides q, k, v and the output, all O(S));
- backward: a dq kernel over the same per-q-block lists, and a dk/dv kernel over the transposed
  per-kv-block lists that also walks the query heads sharing the kv head (GQA), so dk and dv are
  accumulated in VMEM and written once.

Rectangular layouts (`q_pos`, a part attending to cached prefix keys): the queries are a subset
of the key positions, query i at key position q_pos[i]; the kernels read each q-block's slice of
`q_pos` (lane-dense [1, block_q] rows) instead of an iota, so the mask is j <= q_pos[i] < end[j].

Sliding window (`window` W, `key_pos` the keys' path positions): `end` and `q_pos` travel as
[rows, 2, S] stacks with the path positions in their second row, so each kernel gets a block's
path positions with its slice of `end` / `q_pos` (no new BlockSpec), and PARTIAL blocks add
q_path[i] - k_path[j] < W to the element mask; the block tables drop the blocks outside every
query's window. Sinks: `jtree.kernels.attention.flash_vjp` (lse [rows, Hq, 1, Sq]).

Inputs are transposed to head-major [rows, heads, S, head_dim] so every block is a lane-dense
(block, head_dim) tile. MLA: v's head dim Dv may differ from q's and k's Dk; the output, d_out and
dv tiles have Dv, the q, k, dq, dk tiles Dk. Constraints (checked, with the reason, in
`tree_attention_tpu`): float32 or bfloat16, block sizes multiples of 128 that divide S, block
tables that fit in SMEM, and each head dim 64 or a multiple of 64: one that is neither 64 nor a
multiple of 128 (DeepSeek-V3's Dk 192) is zero-padded to the next multiple of 128 around the
kernels, which is exact (zero q/k columns add nothing to a score, zero v columns give output
columns that are dropped) and costs the padded columns' work.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jtree.kernels.attention.flash_vjp import flash_vjp
from jtree.kernels.attention.pallas_common import MASKED, NN, NT, BlockConfig
from jtree.kernels.block_tables import FULL, PARTIAL, block_padding, block_tables
from jtree.kernels.varying_axes import varying_struct

DEFAULT_BLOCK = 128
LANES = 128
SMEM_TABLE_BYTES = 512 * 1024  # half of the 1 MiB SMEM of TPU v4 and later


padded_length, padded_lengths = block_padding(DEFAULT_BLOCK)


def tree_attention_tpu(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    end: jax.Array,
    *,
    scale: float,
    softcap: float | None = None,
    block_q: int | None = None,
    block_kv: int | None = None,
    max_kv_blocks: int | None = None,
    max_q_blocks: int | None = None,
    interpret: Any = False,
    q_pos: jax.Array | None = None,
    q_real: jax.Array | None = None,
    window: int | None = None,
    key_pos: jax.Array | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Tree attention of q [rows, Sq, Hq, Dk] over k [rows, Skv, Hkv, Dk], v [rows, Skv, Hkv, Dv]
    (see `tree_attention`; Dv != Dk is MLA; Sq = Skv unless `q_pos` [rows, Sq] gives the key
    position of every query; q-blocks without a real query in `q_real` run only their own key
    blocks, `classify_blocks`).

    `max_kv_blocks` / `max_q_blocks` shrink the grid's block-list axis from S / block to a budget
    computed on the host (`jtree.kernels.block_tables.required_blocks`); each skipped grid step still
    costs a little, so a tight budget helps. A budget that is too small raises for a host `end`;
    under jit it cannot raise, so the output is set to NaN instead of silently dropping blocks.
    `interpret` runs the kernels in the Pallas TPU interpreter (True or pltpu.InterpretParams).
    `window` with `key_pos` [rows, Skv]: the sliding window along the path; `sinks` [Hq]: the
    attention sinks.
    """
    rows, sq = q.shape[:2]
    skv = k.shape[1]
    block_q, block_kv = block_q or DEFAULT_BLOCK, block_kv or DEFAULT_BLOCK
    _check_supported(q, k, v, block_q, block_kv, rectangular=q_pos is not None)
    nq, nk = sq // block_q, skv // block_kv
    max_kv = nk if max_kv_blocks is None else max_kv_blocks
    max_q = nq if max_q_blocks is None else max_q_blocks
    if not (1 <= max_kv <= nk and 1 <= max_q <= nq):
        raise ValueError(f"pallas_tpu: need 1 <= max_kv_blocks <= {nk} and 1 <= max_q_blocks <= "
                         f"{nq}; got {max_kv}, {max_q}")
    table_bytes = 4 * rows * max(nq * max_kv, nk * max_q)
    if table_bytes > SMEM_TABLE_BYTES:
        raise ValueError(
            f"pallas_tpu: the block table ({table_bytes} bytes for {rows} rows) exceeds the "
            f"{SMEM_TABLE_BYTES}-byte SMEM budget; use larger blocks, fewer rows per call, or a "
            "max_kv_blocks / max_q_blocks budget")
    tables = block_tables(end, block_q, block_kv, max_kv_blocks=max_kv, max_q_blocks=max_q,
                          q_pos=q_pos, q_real=q_real, window=window, key_pos=key_pos)
    kv_table = _pack(tables.kv_blocks, tables.kv_kind)
    q_table = _pack(tables.q_blocks, tables.q_kind)
    cfg = BlockConfig(float(scale), None if softcap is None else float(softcap), block_q, block_kv,
                      interpret, window=window)
    if q_pos is None:
        q_pos = np.broadcast_to(np.arange(sq, dtype=np.int32), (rows, sq))
    end3 = jnp.asarray(end, jnp.int32)[:, None, :]
    qpos3 = jnp.asarray(q_pos, jnp.int32)[:, None, :]
    if window is not None:  # path positions as the second row of `end` and `q_pos`
        k_path = jnp.asarray(key_pos, jnp.int32)
        q_path = jnp.take_along_axis(k_path, qpos3[:, 0], axis=1)
        end3 = jnp.concatenate([end3, k_path[:, None, :]], axis=1)
        qpos3 = jnp.concatenate([qpos3, q_path[:, None, :]], axis=1)
    dk, dv = q.shape[3], v.shape[3]
    q, k = _pad_last(q, _lane_dim(dk)), _pad_last(k, _lane_dim(dk))
    v = _pad_last(v, _lane_dim(dv))
    out = _attention(q, k, v, end3, qpos3, kv_table, q_table, cfg, sinks=sinks)[..., :dv]
    if isinstance(tables.kv_count, np.ndarray) or (max_kv_blocks is None and max_q_blocks is None):
        return out
    overflow = (jnp.max(tables.kv_count) > max_kv) | (jnp.max(tables.q_count) > max_q)
    return jnp.where(overflow, jnp.nan, out).astype(out.dtype)


def _lane_dim(d: int) -> int:
    """The head dim the kernels run for a head dim `d` (a multiple of 64): `d` itself when it is
    64 or a multiple of LANES, else the next multiple of LANES (zero-padded around the kernels)."""
    return d if d == 64 else -(-d // LANES) * LANES


def _pad_last(x: jax.Array, d: int) -> jax.Array:
    """`x` with zero columns appended to its last axis up to `d` (itself when it has `d`)."""
    if x.shape[-1] == d:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, d - x.shape[-1])])


def _check_supported(q, k, v, block_q: int, block_kv: int, rectangular: bool) -> None:
    sq, skv = q.shape[1], k.shape[1]
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"pallas_tpu: q, k, v must all be float32 or all bfloat16 (the MXU "
                         f"input types); got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, d in (("head_dim", q.shape[3]), ("value head_dim", v.shape[3])):
        if d % 64:
            raise ValueError(f"pallas_tpu: {name}={d} must be 64 or a multiple of {LANES} (the "
                             "lane width: the kernel's (block, head_dim) tiles are laid out for "
                             "these), or another multiple of 64, zero-padded to one")
    # Without q_pos both blocks tile the one sequence; with it, block_q tiles Sq, block_kv Skv.
    lengths = {"block_q": ("Sq", sq), "block_kv": ("Skv", skv)} if rectangular else {
        "block_q": ("S", sq), "block_kv": ("S", sq)}
    for name, b in (("block_q", block_q), ("block_kv", block_kv)):
        if b % LANES:
            raise ValueError(f"pallas_tpu: {name}={b} must be a multiple of {LANES}: blocks lie "
                             "along the lane axis in the score tiles and the log-sum-exp rows")
        label, s = lengths[name]
        if s % b:
            raise ValueError(f"pallas_tpu: {label}={s} must be a multiple of {name}={b} "
                             "(tree_attention pads S; call it instead)")


def _pack(blocks, kinds):
    """One int32 per table entry: block index * 4 + kind, to halve the SMEM footprint. (Unpacked
    with shifts and masks: integer division lowers to ops that need a TPU generation to lower.)"""
    return (blocks * 4 + kinds).astype(jnp.int32)


def _block(entry):
    return jax.lax.shift_right_logical(entry, 2)


def _kind(entry):
    return jax.lax.bitwise_and(entry, 3)


def _cap(s: jax.Array, cfg: BlockConfig):
    """Soft-capped scores and tanh(s / cap) (None without a cap), for the backward's chain rule."""
    if cfg.softcap is None:
        return s, None
    t = jnp.tanh(s / cfg.softcap)
    return cfg.softcap * t, t


def _mask(shape, qpos, k_start, end, keys_on_lanes: bool, cfg: BlockConfig, q_path=None,
          k_path=None):
    """Element mask j <= q_pos[i] < end[j] of a score tile. `qpos` is the q-block's slice of
    `q_pos` and `end` the kv-block's slice of `end`, each broadcastable against the tile
    (keys on lanes: qpos [bq, 1], end [1, bk]; keys on sublanes: qpos [1, bq], end [bk, 1]);
    with a window also q_path[i] - k_path[j] < W (path positions shaped like qpos, end)."""
    k_axis = 1 if keys_on_lanes else 0
    kpos = k_start + jax.lax.broadcasted_iota(jnp.int32, shape, k_axis)
    mask = (kpos <= qpos) & (qpos < end)
    if cfg.window is not None:
        mask = mask & (q_path - k_path < cfg.window)
    return mask


def _mask_operands(qpos_ref, end_ref, keys_on_lanes: bool, cfg: BlockConfig) -> tuple:
    """(qpos, end, q_path, k_path) of a tile from the q-block's `q_pos` and the kv-block's `end`
    blocks ([1 | 2, block]: values, and path positions with a window), shaped to broadcast
    against it (`_mask`); the path positions are None without a window."""
    window = cfg.window is not None
    if keys_on_lanes:
        qpos = qpos_ref[0][:, None]
        end = end_ref[pl.ds(0, 1), :] if window else end_ref[...]
        if not window:
            return qpos, end, None, None
        return qpos, end, qpos_ref[1][:, None], end_ref[pl.ds(1, 1), :]
    qpos = qpos_ref[pl.ds(0, 1), :] if window else qpos_ref[...]
    end = end_ref[0][:, None]
    if not window:
        return qpos, end, None, None
    return qpos, end, qpos_ref[pl.ds(1, 1), :], end_ref[1][:, None]


def _on_kind(kind, body):
    """Run body(masked) for FULL (no mask) and PARTIAL (masked) blocks; EMPTY does nothing."""
    pl.when(kind == FULL)(lambda: body(False))
    pl.when(kind == PARTIAL)(lambda: body(True))


class _Specs(NamedTuple):
    """BlockSpecs of one grid: q-like tiles (q, dq: head dim Dk), out-like tiles (out, d_out: Dv),
    k tiles (k, dk: Dk), v tiles (v, dv: Dv), the kv-block's slice of `end`, per-query rows (lse,
    delta), and the q-block's slice of `q_pos`."""

    q: pl.BlockSpec
    o: pl.BlockSpec
    k: pl.BlockSpec
    v: pl.BlockSpec
    end: pl.BlockSpec
    row: pl.BlockSpec
    qpos: pl.BlockSpec


def _specs(q_map, kv_map, end_map, row_map, d: int, dv: int, cfg: BlockConfig) -> _Specs:
    bq, bk = cfg.block_q, cfg.block_kv
    depth = 1 if cfg.window is None else 2  # `end` / `q_pos` rows: values (and path positions)

    def qpos_map(*idx):
        r, _, _, i = row_map(*idx)
        return r, 0, i

    return _Specs(pl.BlockSpec((None, None, bq, d), q_map),
                  pl.BlockSpec((None, None, bq, dv), q_map),
                  pl.BlockSpec((None, None, bk, d), kv_map),
                  pl.BlockSpec((None, None, bk, dv), kv_map),
                  pl.BlockSpec((None, depth, bk), end_map),
                  pl.BlockSpec((None, None, 1, bq), row_map),
                  pl.BlockSpec((None, depth, bq), qpos_map))


def _per_q_block_specs(group: int, d: int, dv: int, cfg: BlockConfig) -> _Specs:
    """Grid (rows, Hq, nq, steps): step n of q-block i reads the n-th kv-block of its list."""

    def q_map(r, h, i, n, tab):
        return r, h, i, 0

    def kv_map(r, h, i, n, tab):
        return r, jax.lax.div(h, group), _block(tab[r, i, n]), 0

    def end_map(r, h, i, n, tab):
        return r, 0, _block(tab[r, i, n])

    def row_map(r, h, i, n, tab):
        return r, h, 0, i

    return _specs(q_map, kv_map, end_map, row_map, d, dv, cfg)


def _per_kv_block_specs(group: int, d: int, dv: int, cfg: BlockConfig) -> _Specs:
    """Grid (rows, Hkv, nk, group, steps): query head hk * group + gi, step n of kv-block j reads
    the n-th q-block of its list."""

    def q_map(r, hk, j, gi, n, tab):
        return r, hk * group + gi, _block(tab[r, j, n]), 0

    def kv_map(r, hk, j, gi, n, tab):
        return r, hk, j, 0

    def end_map(r, hk, j, gi, n, tab):
        return r, 0, j

    def row_map(r, hk, j, gi, n, tab):
        return r, hk * group + gi, 0, _block(tab[r, j, n])

    return _specs(q_map, kv_map, end_map, row_map, d, dv, cfg)


def _call(kernel, name: str, *, grid, cfg: BlockConfig, in_specs, out_specs, out_shape, scratch,
          accumulating: int = 1):
    """A pallas_call with one scalar-prefetched block table; every grid axis is parallel except
    the last `accumulating` ones, whose steps accumulate into scratch in order."""
    semantics = ("parallel",) * (len(grid) - accumulating) + ("arbitrary",) * accumulating
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=grid,
                                               in_specs=in_specs, out_specs=out_specs,
                                               scratch_shapes=scratch),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
        interpret=cfg.interpret,
        name=name,
    )


# ----------------------------------------------------------------------------- forward


def _fwd_kernel(kv_table, q_ref, k_ref, v_ref, end_ref, qpos_ref, o_ref, lse_ref, m_scr, l_scr,
                acc_scr, *, cfg: BlockConfig, steps: int):
    r, i, n = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    entry = kv_table[r, i, n]
    bq, bk = cfg.block_q, cfg.block_kv

    @pl.when(n == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, MASKED, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    def accumulate(masked: bool):
        v = v_ref[...]
        s = jax.lax.dot_general(q_ref[...], k_ref[...], NT,
                                preferred_element_type=jnp.float32) * cfg.scale
        s, _ = _cap(s, cfg)
        if masked:
            qpos, end, q_path, k_path = _mask_operands(qpos_ref, end_ref, True, cfg)
            mask = _mask((bq, bk), qpos, _block(entry) * bk, end, True, cfg, q_path, k_path)
            s = jnp.where(mask, s, MASKED)
        m_prev, l_prev = m_scr[...], l_scr[...]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [bq, LANES]
        p = jnp.exp(s - m_next[:, :1])
        if masked:
            p = jnp.where(mask, p, 0.0)
        alpha = jnp.exp(m_prev - m_next)
        l_scr[...] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
        m_scr[...] = m_next
        pv = jax.lax.dot_general(p.astype(v.dtype), v, NN, preferred_element_type=jnp.float32)
        acc_scr[...] = acc_scr[...] * alpha[:, :1] + pv

    _on_kind(_kind(entry), accumulate)

    @pl.when(n == steps - 1)
    def _finish():
        l = l_scr[...]
        l = jnp.where(l == 0.0, 1.0, l)
        o_ref[...] = (acc_scr[...] / l[:, :1]).astype(o_ref.dtype)
        lse_ref[...] = (m_scr[...] + jnp.log(l)).T[:1, :]  # [1, bq]: lane-dense row


def _forward(q, k, v, end, q_pos, kv_table, cfg: BlockConfig):
    """q [rows, Hq, Sq, Dk], k [rows, Hkv, Skv, Dk], v [rows, Hkv, Skv, Dv], end [rows, 1, Skv],
    q_pos [rows, 1, Sq] -> out [rows, Hq, Sq, Dv], lse [rows, Hq, 1, Sq]."""
    rows, hq, s, d = q.shape
    dv = v.shape[3]
    specs = _per_q_block_specs(hq // k.shape[1], d, dv, cfg)
    bq = cfg.block_q
    return _call(
        functools.partial(_fwd_kernel, cfg=cfg, steps=kv_table.shape[2]), "tree_attention_fwd",
        grid=(rows, hq, s // bq, kv_table.shape[2]), cfg=cfg,
        in_specs=[specs.q, specs.k, specs.v, specs.end, specs.qpos],
        out_specs=[specs.o, specs.row],
        out_shape=[varying_struct((rows, hq, s, dv), q.dtype, kv_table, q, k, v, end, q_pos),
                   varying_struct((rows, hq, 1, s), jnp.float32, kv_table, q, k, v, end, q_pos)],
        scratch=[pltpu.VMEM((bq, LANES), jnp.float32), pltpu.VMEM((bq, LANES), jnp.float32),
                 pltpu.VMEM((bq, dv), jnp.float32)],
    )(kv_table, q, k, v, end, q_pos)


# ----------------------------------------------------------------------------- backward: dq


def _dq_kernel(kv_table, q_ref, k_ref, v_ref, end_ref, qpos_ref, do_ref, lse_ref, delta_ref,
               dq_ref, dq_scr, *, cfg: BlockConfig, steps: int):
    r, i, n = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    entry = kv_table[r, i, n]
    bq, bk = cfg.block_q, cfg.block_kv

    @pl.when(n == 0)
    def _init():
        dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

    def accumulate(masked: bool):
        k = k_ref[...]
        s = jax.lax.dot_general(q_ref[...], k, NT, preferred_element_type=jnp.float32) * cfg.scale
        s, t = _cap(s, cfg)
        p = jnp.exp(s - lse_ref[0][:, None])
        if masked:
            qpos, end, q_path, k_path = _mask_operands(qpos_ref, end_ref, True, cfg)
            mask = _mask((bq, bk), qpos, _block(entry) * bk, end, True, cfg, q_path, k_path)
            p = jnp.where(mask, p, 0.0)
        dp = jax.lax.dot_general(do_ref[...], v_ref[...], NT, preferred_element_type=jnp.float32)
        ds = p * (dp - delta_ref[0][:, None])
        if t is not None:
            ds = ds * (1.0 - t * t)
        dq_scr[...] += cfg.scale * jax.lax.dot_general(
            ds.astype(k.dtype), k, NN, preferred_element_type=jnp.float32)

    _on_kind(_kind(entry), accumulate)

    @pl.when(n == steps - 1)
    def _finish():
        dq_ref[...] = dq_scr[...].astype(dq_ref.dtype)


def _backward_dq(q, k, v, end, q_pos, d_out, lse, delta, kv_table, cfg: BlockConfig):
    rows, hq, s, d = q.shape
    specs = _per_q_block_specs(hq // k.shape[1], d, v.shape[3], cfg)
    return _call(
        functools.partial(_dq_kernel, cfg=cfg, steps=kv_table.shape[2]), "tree_attention_dq",
        grid=(rows, hq, s // cfg.block_q, kv_table.shape[2]), cfg=cfg,
        in_specs=[specs.q, specs.k, specs.v, specs.end, specs.qpos, specs.o, specs.row,
                  specs.row],
        out_specs=specs.q,
        out_shape=varying_struct(q.shape, q.dtype, kv_table, q, k, v, end, q_pos, d_out, lse,
                                 delta),
        scratch=[pltpu.VMEM((cfg.block_q, d), jnp.float32)],
    )(kv_table, q, k, v, end, q_pos, d_out, lse, delta)


# ----------------------------------------------------------------------------- backward: dk, dv


def _dkv_kernel(q_table, q_ref, k_ref, v_ref, end_ref, qpos_ref, do_ref, lse_ref, delta_ref,
                dk_ref, dv_ref, dk_scr, dv_scr, *, cfg: BlockConfig, steps: int, group: int):
    r, j, gi, n = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
    entry = q_table[r, j, n]
    bq, bk = cfg.block_q, cfg.block_kv

    @pl.when((gi == 0) & (n == 0))
    def _init():
        dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

    def accumulate(masked: bool):
        q, do = q_ref[...], do_ref[...]
        # Keys on sublanes: [bk, bq] tiles, so the per-query rows (lse, delta) broadcast as rows.
        s = jax.lax.dot_general(k_ref[...], q, NT, preferred_element_type=jnp.float32) * cfg.scale
        s, t = _cap(s, cfg)
        p = jnp.exp(s - lse_ref[...])
        if masked:
            qpos, end, q_path, k_path = _mask_operands(qpos_ref, end_ref, False, cfg)
            mask = _mask((bk, bq), qpos, j * bk, end, False, cfg, q_path, k_path)
            p = jnp.where(mask, p, 0.0)
        dv_scr[...] += jax.lax.dot_general(p.astype(do.dtype), do, NN,
                                           preferred_element_type=jnp.float32)
        dp = jax.lax.dot_general(v_ref[...], do, NT, preferred_element_type=jnp.float32)
        ds = p * (dp - delta_ref[...])
        if t is not None:
            ds = ds * (1.0 - t * t)
        dk_scr[...] += cfg.scale * jax.lax.dot_general(ds.astype(q.dtype), q, NN,
                                                       preferred_element_type=jnp.float32)

    _on_kind(_kind(entry), accumulate)

    @pl.when((gi == group - 1) & (n == steps - 1))
    def _finish():
        dk_ref[...] = dk_scr[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def _backward_dkv(q, k, v, end, q_pos, d_out, lse, delta, q_table, cfg: BlockConfig):
    rows, hq, _, d = q.shape
    hkv, s, dv = k.shape[1], k.shape[2], v.shape[3]
    specs = _per_kv_block_specs(hq // hkv, d, dv, cfg)
    bk = cfg.block_kv
    return _call(
        functools.partial(_dkv_kernel, cfg=cfg, steps=q_table.shape[2], group=hq // hkv),
        "tree_attention_dkv", grid=(rows, hkv, s // bk, hq // hkv, q_table.shape[2]), cfg=cfg,
        in_specs=[specs.q, specs.k, specs.v, specs.end, specs.qpos, specs.o, specs.row,
                  specs.row],
        out_specs=[specs.k, specs.v],
        out_shape=[varying_struct(x.shape, x.dtype, q_table, q, k, v, end, q_pos, d_out, lse, delta)
                   for x in (k, v)],
        scratch=[pltpu.VMEM((bk, d), jnp.float32), pltpu.VMEM((bk, dv), jnp.float32)],
        accumulating=2,  # the query heads of the group and the q-block list
    )(q_table, q, k, v, end, q_pos, d_out, lse, delta)


# ----------------------------------------------------------------------------- custom VJP


def _head_major(x):
    return x.transpose(0, 2, 1, 3)


def _attention_forward(q, k, v, end3, qpos3, kv_table, q_table, cfg):
    """end3 [rows, 1 | 2, Skv], qpos3 [rows, 1 | 2, Sq] (values, and path positions with a
    window) -> out [rows, Sq, Hq, Dv], lse [rows, Hq, 1, Sq]."""
    del q_table
    out, lse = _forward(_head_major(q), _head_major(k), _head_major(v), end3, qpos3, kv_table,
                        cfg)
    return _head_major(out), lse


def _attention_backward(cfg, q, k, v, end3, qpos3, kv_table, q_table, out, lse, d_out):
    qh, kh, vh, doh = _head_major(q), _head_major(k), _head_major(v), _head_major(d_out)
    delta = jnp.sum(doh.astype(jnp.float32) * _head_major(out).astype(jnp.float32),
                    axis=-1)[:, :, None, :]
    dq = _backward_dq(qh, kh, vh, end3, qpos3, doh, lse, delta, kv_table, cfg)
    dk, dv = _backward_dkv(qh, kh, vh, end3, qpos3, doh, lse, delta, q_table, cfg)
    return _head_major(dq), _head_major(dk), _head_major(dv)


def _lse_rows(lse, cfg, q):
    """lse [rows, Hq, 1, Sq] as [rows, Sq, Hq]."""
    return lse[:, :, 0, :].transpose(0, 2, 1)


def _rows_lse(x, cfg, q, lse):
    return x.transpose(0, 2, 1)[:, :, None, :]


_attention = flash_vjp(_attention_forward, _attention_backward, 7, lse_rows=_lse_rows,
                       rows_lse=_rows_lse)
