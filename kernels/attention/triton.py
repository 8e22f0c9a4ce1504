"""Tree attention as Pallas kernels on the GPU Triton backend (`impl="pallas_triton"`).

For every NVIDIA GPU Triton targets (Ampere, Ada, Hopper) and every dtype the Hopper-only Mosaic
kernel does not take (float32). FlashAttention-2 structure, driven by the block lists of
`jtree.kernels.block_tables`:

- forward: one program per (q-block, row, q head) walks its list of non-empty kv-blocks with an
  online softmax; EMPTY blocks are not in the list, so they are never loaded; FULL blocks run
  without a mask; PARTIAL blocks load their slice of `end` and apply j <= q_pos[i] < end[j].
  It writes O and the log-sum-exp, the only residuals besides q, k, v (all O(S));
- backward, deterministic: a dQ kernel over the same per-q-block lists, and a dK/dV kernel over
  the transposed per-kv-block lists that also walks the q heads sharing the kv head (GQA). Each
  gradient tile is written once by one program, so there are no atomics and the result does not
  depend on the order programs run in (FA2's fused backward adds dQ with atomics instead).

The kernels read q, k, v in their [rows, S, heads, head_dim] layout (no transposes): a program's
BlockSpec holds its own q-block (or kv-block) and the whole sequence of the other operand, which it
indexes with `pl.ds` at the listed block's offset. The Triton backend has no scalar prefetch, so the
lists are ordinary int32 inputs read one scalar at a time.

Rectangular layouts (`q_pos`, a part attending to cached prefix keys): query i sits at key
position q_pos[i], and the mask is read from the q-block's slice of `q_pos` instead of an iota.

MLA: v's head dim Dv may differ from q's and k's Dk; the out, dO and dV tiles have Dv, the q, k,
dQ and dK tiles Dk.

Limits (each checked, raising ValueError with the reason): q, k, v all float32, bfloat16 or
float16; each head dim a power of two from 16 to 256 (Triton tensors have power-of-two sizes and
`tl.dot` needs K >= 16; 256 is the largest tile the default blocks keep in registers), or a
multiple of 64 below 256 (DeepSeek-V3's Dk 192), which runs zero-padded to the next power of two
around the kernels: exact (zero q/k columns add nothing to a score, zero v columns give output
columns that are dropped), at the cost of the padded columns' work; blocks powers of two of at
least 16 dividing the (padded) lengths. float32 matmuls run in IEEE float32
on the GPU (Pallas Triton picks IEEE, not TF32, for float32 operands at default precision).

`interpret=True` runs the same kernels in the Pallas interpreter (any backend), which is how they
are tested without a GPU.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jtree.kernels.attention.flash_vjp import flash_vjp
from jtree.kernels.attention.pallas_common import MASKED, NN, NT, BlockConfig
from jtree.kernels.block_tables import PARTIAL, block_padding, block_tables
from jtree.kernels.varying_axes import varying_struct

PAD_MULTIPLE = 64  # the dispatch pads S to this by default; every default block divides it
MIN_BLOCK = 16  # tl.dot needs every matmul dimension >= 16
MAX_HEAD_DIM = 256
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def default_blocks(dtype: Any, head_dim: int) -> tuple[int, int]:
    """(block_q, block_kv) when the caller gives none: 64 x 64 for 16-bit operands up to head_dim
    128; narrower tiles for float32 and head_dim 256, whose tiles are twice as many bytes, so that
    the K/V pipeline stays within an Ampere SM's 164 KiB of shared memory. Not tuned on hardware."""
    wide = jnp.dtype(dtype).itemsize > 2 or head_dim > 128
    return (32 if head_dim > 128 else 64), (32 if wide else 64)


padded_length, padded_lengths = block_padding(PAD_MULTIPLE)


def tree_attention_triton(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    end: jax.Array,
    *,
    scale: float,
    softcap: float | None = None,
    q_pos: jax.Array | None = None,
    q_real: jax.Array | None = None,
    block_q: int | None = None,
    block_kv: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    interpret: bool = False,
    window: int | None = None,
    key_pos: jax.Array | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Tree attention of q [rows, Sq, Hq, Dk] over k [rows, Skv, Hkv, Dk], v [rows, Skv, Hkv, Dv]
    (see `tree_attention`; Dv != Dk is MLA; Sq = Skv unless `q_pos` [rows, Sq] gives the key
    position of every query; q-blocks without a real query in `q_real` run only their own key
    blocks, `classify_blocks`: one set of tables serves the forward and both backward passes).

    `block_q`, `block_kv` default to `default_blocks` (of the larger head dim as it runs);
    `num_warps` (default 4 up to head_dim 64, else 8) and `num_stages` go to the Triton
    compiler. `interpret` runs the kernels in the Pallas interpreter instead of lowering them for
    a GPU. `window` with `key_pos` [rows, Skv]: the sliding window along the path (PARTIAL blocks
    test q_path[i] - k_path[j] < W; the tables drop blocks outside every window); `sinks` [Hq]:
    attention sinks (`flash_vjp`).
    """
    rows, sq = q.shape[:2]
    dk, dv = q.shape[3], v.shape[3]
    d = max(run_dim(dk), run_dim(dv))
    defaults = default_blocks(q.dtype, d)
    block_q, block_kv = block_q or defaults[0], block_kv or defaults[1]
    check_supported("pallas_triton", q, k, v, block_q, block_kv)
    cfg = BlockConfig(float(scale), None if softcap is None else float(softcap), block_q,
                      block_kv, bool(interpret), num_warps or (4 if d <= 64 else 8), num_stages,
                      window)
    tables = block_tables(end, block_q, block_kv, q_pos=q_pos, q_real=q_real, window=window,
                          key_pos=key_pos)
    if q_pos is None:
        q_pos = np.broadcast_to(np.arange(sq, dtype=np.int32), (rows, sq))
    lists = _Lists(*(jnp.asarray(x, jnp.int32) for x in (
        tables.kv_blocks, tables.kv_kind, tables.kv_count,
        tables.q_blocks, tables.q_kind, tables.q_count)))
    q_pos = jnp.asarray(q_pos, jnp.int32)
    paths = None
    if window is not None:
        k_path = jnp.asarray(key_pos, jnp.int32)
        paths = (jnp.take_along_axis(k_path, q_pos, axis=1), k_path)
    q, k = pad_last(q, run_dim(dk)), pad_last(k, run_dim(dk))
    v = pad_last(v, run_dim(dv))
    out = _attention(q, k, v, jnp.asarray(end, jnp.int32), q_pos, lists, paths, cfg, sinks=sinks)
    return out[..., :dv]


def run_dim(d: int) -> int:
    """The head dim the kernels run for a head dim `d`: `d` when it is a power of two, the next
    power of two for another multiple of 64 (zero-padded around the kernels: exact), else `d`
    (which `check_supported` refuses)."""
    return 1 << (d - 1).bit_length() if d % 64 == 0 else d


def pad_last(x: jax.Array, d: int) -> jax.Array:
    """`x` with zero columns appended to its last axis up to `d` (itself when it has `d`)."""
    if x.shape[-1] == d:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, d - x.shape[-1])])


def check_supported(impl: str, q, k, v, block_q: int, block_kv: int) -> None:
    """Raise ValueError, naming `impl` and the limit, for operands or blocks the Triton kernels
    (Pallas' and the Triton-language ones share these limits) cannot run."""
    dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if len(dtypes) != 1 or not dtypes <= set(_DTYPES):
        raise ValueError(f"{impl}: q, k, v must all be float32, bfloat16 or float16; got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    for name, given in (("head_dim", q.shape[3]), ("value head_dim", v.shape[3])):
        d = run_dim(given)
        if d < MIN_BLOCK or d > MAX_HEAD_DIM or d & (d - 1):
            raise ValueError(f"{impl}: {name}={given} must be a power of two from "
                             f"{MIN_BLOCK} to {MAX_HEAD_DIM} (Triton tiles have power-of-two "
                             f"sizes, tl.dot needs >= {MIN_BLOCK}; larger tiles do not fit the "
                             "registers), or a multiple of 64 that pads to one")
    for name, b, label, s in (("block_q", block_q, "Sq", q.shape[1]),
                              ("block_kv", block_kv, "Skv", k.shape[1])):
        if b < MIN_BLOCK or b & (b - 1):
            raise ValueError(f"{impl}: {name}={b} must be a power of two >= {MIN_BLOCK} "
                             "(a Triton tile dimension and a tl.dot operand dimension)")
        if s % b:
            raise ValueError(f"{impl}: {label}={s} must be a multiple of {name}={b} "
                             "(tree_attention pads S; call it instead)")


class _Lists(NamedTuple):
    """The block lists of `block_tables`, int32: per q-block (forward, dQ) and per kv-block
    (dK/dV); `*_count` is the number of real entries, the loops stop there."""

    kv_blocks: jax.Array
    kv_kind: jax.Array
    kv_count: jax.Array
    q_blocks: jax.Array
    q_kind: jax.Array
    q_count: jax.Array


def _list_specs(table: jax.Array) -> list[pl.BlockSpec]:
    """BlockSpecs of one set of lists (`table` [rows, blocks, width] and its kinds, and the counts
    [rows, blocks]) in a grid (block, row, head): the block's list and kinds, and the row's counts,
    which the kernel reads at its block index."""
    _, blocks, width = table.shape
    entries = pl.BlockSpec((None, None, width), lambda b, r, h: (r, b, 0))
    return [entries, entries, pl.BlockSpec((None, blocks), lambda b, r, h: (r, 0))]


def _call(kernel, name: str, *, grid, cfg: BlockConfig, in_specs, out_specs, out_shape):
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps,
                                                num_stages=cfg.num_stages),
        interpret=cfg.interpret, name=name)


def _cap(s: jax.Array, cfg: BlockConfig) -> tuple[jax.Array, jax.Array | None]:
    """Soft-capped scores and tanh(s / cap) (None without a cap), for the backward's chain rule."""
    if cfg.softcap is None:
        return s, None
    t = jnp.tanh(s / cfg.softcap)
    return cfg.softcap * t, t


def _scores(a: jax.Array, b: jax.Array, cfg: BlockConfig) -> tuple[jax.Array, jax.Array | None]:
    """Soft-capped scale * a @ b.T in float32, and the tanh of the cap."""
    s = lax.dot_general(a, b, NT, preferred_element_type=jnp.float32) * cfg.scale
    return _cap(s, cfg)


def _visible(kpos: jax.Array, qpos: jax.Array, key_end: jax.Array, q_path=None, k_path=None,
             window: int | None = None) -> jax.Array:
    """The element mask of a PARTIAL block, j <= q_pos[i] < end[j], from key positions, query
    positions and key ends broadcast against the score tile; with a window also
    q_path[i] - k_path[j] < W (path positions broadcast likewise)."""
    mask = (kpos <= qpos) & (qpos < key_end)
    if window is not None:
        mask = mask & (q_path - k_path < window)
    return mask


def _path_refs(refs: tuple, cfg: BlockConfig) -> tuple:
    """The (q_path, k_path) refs a kernel gets last among its inputs with a window, else Nones."""
    return refs if cfg.window is not None else (None, None)


def _by_kind(kind: jax.Array, step, *operands):
    """step(masked, *operands): the masked form for PARTIAL blocks, the unmasked one otherwise
    (only FULL and PARTIAL blocks are listed before the count)."""
    return lax.cond(kind == PARTIAL, functools.partial(step, True),
                    functools.partial(step, False), *operands)


# ----------------------------------------------------------------------------- forward


def _fwd_kernel(blocks_ref, kinds_ref, count_ref, qpos_ref, q_ref, k_ref, v_ref, end_ref, *refs,
                cfg: BlockConfig):
    (qpath_ref, kpath_ref), (o_ref, lse_ref) = _path_refs(refs[:-2], cfg), refs[-2:]
    bk = cfg.block_kv
    q = q_ref[...]
    qpos = qpos_ref[...]
    qpath = None if qpath_ref is None else qpath_ref[...][:, None]

    def step(masked: bool, n, carry):
        acc, m_prev, l_prev = carry
        kv = pl.ds(blocks_ref[n] * bk, bk)
        s, _ = _scores(q, k_ref[kv, :], cfg)
        if masked:
            mask = _visible(kv.start + lax.broadcasted_iota(jnp.int32, s.shape, 1),
                            qpos[:, None], end_ref[kv][None, :], qpath,
                            None if kpath_ref is None else kpath_ref[kv][None, :], cfg.window)
            s = jnp.where(mask, s, MASKED)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        p = jnp.exp(s - m_next[:, None])
        if masked:
            p = jnp.where(mask, p, 0.0)
        alpha = jnp.exp(m_prev - m_next)
        v = v_ref[kv, :]
        pv = lax.dot_general(p.astype(v.dtype), v, NN, preferred_element_type=jnp.float32)
        acc = acc * alpha[:, None] + pv
        return acc, m_next, alpha * l_prev + jnp.sum(p, axis=1)

    bq, dv = q.shape[0], v_ref.shape[-1]
    init = (jnp.zeros((bq, dv), jnp.float32), jnp.full((bq,), MASKED, jnp.float32),
            jnp.zeros((bq,), jnp.float32))
    acc, m, l = lax.fori_loop(0, count_ref[pl.program_id(0)],
                              lambda n, c: _by_kind(kinds_ref[n], step, n, c), init)
    l = jnp.where(l == 0.0, 1.0, l)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _forward(q, k, v, end, q_pos, lists: _Lists, paths, cfg: BlockConfig):
    """-> out [rows, Sq, Hq, Dv], lse [rows, Hq, Sq] float32."""
    rows, sq, hq, d = q.shape
    dv = v.shape[3]
    skv, group = k.shape[1], hq // k.shape[2]
    bq, nq = cfg.block_q, sq // cfg.block_q
    path_specs = [pl.BlockSpec((None, bq), lambda i, r, h: (r, i)),
                  pl.BlockSpec((None, skv), lambda i, r, h: (r, 0))]
    return _call(
        functools.partial(_fwd_kernel, cfg=cfg), "tree_attention_triton_fwd",
        grid=(nq, rows, hq), cfg=cfg,
        in_specs=[*_list_specs(lists.kv_blocks),
                  pl.BlockSpec((None, bq), lambda i, r, h: (r, i)),
                  pl.BlockSpec((None, bq, None, d), lambda i, r, h: (r, i, h, 0)),
                  pl.BlockSpec((None, skv, None, d), lambda i, r, h: (r, 0, h // group, 0)),
                  pl.BlockSpec((None, skv, None, dv), lambda i, r, h: (r, 0, h // group, 0)),
                  pl.BlockSpec((None, skv), lambda i, r, h: (r, 0)),
                  *(path_specs if paths else [])],
        out_specs=[pl.BlockSpec((None, bq, None, dv), lambda i, r, h: (r, i, h, 0)),
                   pl.BlockSpec((None, None, bq), lambda i, r, h: (r, h, i))],
        out_shape=[varying_struct((rows, sq, hq, dv), q.dtype, lists, q_pos, q, k, v, end,
                                  paths),
                   varying_struct((rows, hq, sq), jnp.float32, lists, q_pos, q, k, v, end, paths)],
    )(lists.kv_blocks, lists.kv_kind, lists.kv_count, q_pos, q, k, v, end, *(paths or ()))


# ----------------------------------------------------------------------------- backward: dQ


def _dq_kernel(blocks_ref, kinds_ref, count_ref, qpos_ref, q_ref, k_ref, v_ref, end_ref, do_ref,
               lse_ref, delta_ref, *refs, cfg: BlockConfig):
    (qpath_ref, kpath_ref), dq_ref = _path_refs(refs[:-1], cfg), refs[-1]
    bk = cfg.block_kv
    q, do = q_ref[...], do_ref[...]
    qpos, lse, delta = qpos_ref[...], lse_ref[...], delta_ref[...]
    qpath = None if qpath_ref is None else qpath_ref[...][:, None]

    def step(masked: bool, n, dq):
        kv = pl.ds(blocks_ref[n] * bk, bk)
        k = k_ref[kv, :]
        s, t = _scores(q, k, cfg)
        p = jnp.exp(s - lse[:, None])
        if masked:
            mask = _visible(kv.start + lax.broadcasted_iota(jnp.int32, s.shape, 1),
                            qpos[:, None], end_ref[kv][None, :], qpath,
                            None if kpath_ref is None else kpath_ref[kv][None, :], cfg.window)
            p = jnp.where(mask, p, 0.0)
        dp = lax.dot_general(do, v_ref[kv, :], NT, preferred_element_type=jnp.float32)
        ds = p * (dp - delta[:, None])
        if t is not None:
            ds = ds * (1.0 - t * t)
        return dq + lax.dot_general(ds.astype(k.dtype), k, NN,
                                    preferred_element_type=jnp.float32)

    dq = lax.fori_loop(0, count_ref[pl.program_id(0)],
                       lambda n, acc: _by_kind(kinds_ref[n], step, n, acc),
                       jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _backward_dq(q, k, v, end, q_pos, d_out, lse, delta, lists: _Lists, paths,
                 cfg: BlockConfig):
    rows, sq, hq, d = q.shape
    skv, group = k.shape[1], hq // k.shape[2]
    bq, nq = cfg.block_q, sq // cfg.block_q
    dv = v.shape[3]
    q_block = pl.BlockSpec((None, bq, None, d), lambda i, r, h: (r, i, h, 0))
    do_block = pl.BlockSpec((None, bq, None, dv), lambda i, r, h: (r, i, h, 0))
    k_all = pl.BlockSpec((None, skv, None, d), lambda i, r, h: (r, 0, h // group, 0))
    v_all = pl.BlockSpec((None, skv, None, dv), lambda i, r, h: (r, 0, h // group, 0))
    row = pl.BlockSpec((None, None, bq), lambda i, r, h: (r, h, i))
    return _call(
        functools.partial(_dq_kernel, cfg=cfg), "tree_attention_triton_dq",
        grid=(nq, rows, hq), cfg=cfg,
        in_specs=[*_list_specs(lists.kv_blocks),
                  pl.BlockSpec((None, bq), lambda i, r, h: (r, i)),
                  q_block, k_all, v_all,
                  pl.BlockSpec((None, skv), lambda i, r, h: (r, 0)),
                  do_block, row, row,
                  *([pl.BlockSpec((None, bq), lambda i, r, h: (r, i)),
                     pl.BlockSpec((None, skv), lambda i, r, h: (r, 0))] if paths else [])],
        out_specs=q_block,
        out_shape=varying_struct(q.shape, q.dtype, lists, q_pos, q, k, v, end, d_out, lse, delta,
                                 paths),
    )(lists.kv_blocks, lists.kv_kind, lists.kv_count, q_pos, q, k, v, end, d_out, lse, delta,
      *(paths or ()))


# ----------------------------------------------------------------------------- backward: dK, dV


def _dkv_kernel(blocks_ref, kinds_ref, count_ref, qpos_ref, q_ref, k_ref, v_ref, end_ref, do_ref,
                lse_ref, delta_ref, *refs, cfg: BlockConfig, group: int):
    (qpath_ref, kpath_ref), (dk_ref, dv_ref) = _path_refs(refs[:-2], cfg), refs[-2:]
    bq = cfg.block_q
    k, v, key_end = k_ref[...], v_ref[...], end_ref[...]
    kpath = None if kpath_ref is None else kpath_ref[...][:, None]
    kpos = pl.program_id(0) * cfg.block_kv + lax.broadcasted_iota(
        jnp.int32, (cfg.block_kv, bq), 0)

    def step(masked: bool, n, carry):
        qs = pl.ds(blocks_ref[n] * bq, bq)
        qpos = qpos_ref[qs]
        qpath = None if qpath_ref is None else qpath_ref[qs][None, :]

        def head(g, carry):
            dk, dv = carry
            q, do = q_ref[qs, g, :], do_ref[qs, g, :]
            # Keys on rows: [bk, bq] tiles, so the per-query rows (lse, delta) broadcast as rows.
            s, t = _scores(k, q, cfg)
            p = jnp.exp(s - lse_ref[g, qs][None, :])
            if masked:
                mask = _visible(kpos, qpos[None, :], key_end[:, None], qpath, kpath, cfg.window)
                p = jnp.where(mask, p, 0.0)
            dv = dv + lax.dot_general(p.astype(do.dtype), do, NN,
                                      preferred_element_type=jnp.float32)
            dp = lax.dot_general(v, do, NT, preferred_element_type=jnp.float32)
            ds = p * (dp - delta_ref[g, qs][None, :])
            if t is not None:
                ds = ds * (1.0 - t * t)
            dk = dk + lax.dot_general(ds.astype(q.dtype), q, NN,
                                      preferred_element_type=jnp.float32)
            return dk, dv

        return lax.fori_loop(0, group, head, carry)

    zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dk, dv = lax.fori_loop(0, count_ref[pl.program_id(0)],
                           lambda n, c: _by_kind(kinds_ref[n], step, n, c), zeros)
    dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _backward_dkv(q, k, v, end, q_pos, d_out, lse, delta, lists: _Lists, paths,
                  cfg: BlockConfig):
    rows, sq, hq, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    bk, nk = cfg.block_kv, skv // cfg.block_kv
    dv = v.shape[3]
    q_all = pl.BlockSpec((None, sq, group, d), lambda j, r, h: (r, 0, h, 0))
    do_all = pl.BlockSpec((None, sq, group, dv), lambda j, r, h: (r, 0, h, 0))
    k_block = pl.BlockSpec((None, bk, None, d), lambda j, r, h: (r, j, h, 0))
    v_block = pl.BlockSpec((None, bk, None, dv), lambda j, r, h: (r, j, h, 0))
    rows_all = pl.BlockSpec((None, group, sq), lambda j, r, h: (r, h, 0))
    return _call(
        functools.partial(_dkv_kernel, cfg=cfg, group=group), "tree_attention_triton_dkv",
        grid=(nk, rows, hkv), cfg=cfg,
        in_specs=[*_list_specs(lists.q_blocks),
                  pl.BlockSpec((None, sq), lambda j, r, h: (r, 0)),
                  q_all, k_block, v_block,
                  pl.BlockSpec((None, bk), lambda j, r, h: (r, j)),
                  do_all, rows_all, rows_all,
                  *([pl.BlockSpec((None, sq), lambda j, r, h: (r, 0)),
                     pl.BlockSpec((None, bk), lambda j, r, h: (r, j))] if paths else [])],
        out_specs=[k_block, v_block],
        out_shape=[varying_struct(x.shape, x.dtype, lists, q_pos, q, k, v, end, d_out, lse, delta,
                                  paths) for x in (k, v)],
    )(lists.q_blocks, lists.q_kind, lists.q_count, q_pos, q, k, v, end, d_out, lse, delta,
      *(paths or ()))


# ----------------------------------------------------------------------------- custom VJP


def _backward(cfg, q, k, v, end, q_pos, lists, paths, out, lse, d_out):
    d_out = d_out.astype(q.dtype)
    # delta_i = sum_d dO_id O_id = sum_j P_ij dP_ij: the softmax Jacobian's row term, O(S) memory.
    delta = jnp.einsum("rshd,rshd->rhs", d_out.astype(jnp.float32), out.astype(jnp.float32))
    dq = _backward_dq(q, k, v, end, q_pos, d_out, lse, delta, lists, paths, cfg)
    dk, dv = _backward_dkv(q, k, v, end, q_pos, d_out, lse, delta, lists, paths, cfg)
    return dq, dk, dv


def lse_rows(lse, cfg, q):
    """lse [rows, Hq, Sq] as [rows, Sq, Hq] (`flash_vjp`'s sinks; the Triton-language kernels
    keep the same layout)."""
    return lse.transpose(0, 2, 1)


def rows_lse(x, cfg, q, lse):
    return x.transpose(0, 2, 1)


_attention = flash_vjp(_forward, _backward, 7, lse_rows=lse_rows, rows_lse=rows_lse)
