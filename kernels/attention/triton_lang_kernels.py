"""The Triton-language (`@triton.jit`) kernels of `impl="triton_lang"`: tree-masked flash attention,
forward and the two deterministic backward passes, driven by the block lists of
`jtree.kernels.block_tables` (the algorithm of `jtree.kernels.attention.triton`, written against
the official Triton bindings instead of Pallas).

Layouts (all contiguous): q [rows, Sq, Hq, D], k [rows, Skv, Hkv, D], v [rows, Skv, Hkv, DV],
end [rows, Skv], q_pos, q_path [rows, Sq], k_path [rows, Skv], lse and delta [rows, Hq, Sq];
the lists [rows, blocks, width] and their counts [rows, blocks]. Shapes, block sizes, scale,
soft-cap and window are compile-time constants (`tl.constexpr`): one compilation per shape.

Every listed block (FULL or PARTIAL) applies the element test j <= q_pos[i] < end[j] (and the
window's q_path[i] - k_path[j] < W): on a FULL block it is all true, so the kinds are not read;
the test costs a few integer operations per score next to the two matmuls. EMPTY blocks are not
in the lists and are never loaded.

Kernel arguments: inputs first, then outputs (the order `jax_triton.triton_call` passes them in),
then the constants by keyword. Pure Triton: the module imports nothing from jax, so the same
functions run in Triton's CPU interpreter on torch tensors.
"""

from __future__ import annotations

import triton
import triton.language as tl

# The score of a masked pair (`pallas_common.MASKED`): finite, far below any real score.
MASKED = tl.constexpr(-0.7 * 3.4028234663852886e38)


@triton.jit
def _scores(q, k, SCALE: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    """scale * q @ k.T in float32, soft-capped when SOFTCAP > 0, and tanh(s / cap) (the chain rule
    of the backward; zeros without a cap)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * SCALE
    if SOFTCAP > 0:
        t = 2.0 * tl.sigmoid(2.0 * s / SOFTCAP) - 1.0  # tanh(s / cap)
        s = SOFTCAP * t
    else:
        t = tl.zeros_like(s)
    return s, t


@triton.jit
def _visible(kj, qp, key_end, qpath, kpath, WINDOW: tl.constexpr):
    """The tree mask of a score tile: j <= q_pos[i] < end[j], and the window when WINDOW > 0."""
    vis = (kj[None, :] <= qp[:, None]) & (qp[:, None] < key_end[None, :])
    if WINDOW > 0:
        vis = vis & (qpath[:, None] - kpath[None, :] < WINDOW)
    return vis


@triton.jit
def _q_block(qb, r, h, q_ptr, q_pos, q_path, SQ: tl.constexpr, HQ: tl.constexpr,
             D: tl.constexpr, BLOCK_Q: tl.constexpr, WINDOW: tl.constexpr):
    """Query block `qb` of row r, head h: its rows' indices, q tile, key positions and (with a
    window) path positions (else the key positions again, unread)."""
    rq = qb * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q = tl.load(q_ptr + ((r * SQ + rq[:, None]) * HQ + h) * D + tl.arange(0, D)[None, :])
    qp = tl.load(q_pos + r * SQ + rq)
    qpath = qp
    if WINDOW > 0:
        qpath = tl.load(q_path + r * SQ + rq)
    return rq, q, qp, qpath


@triton.jit
def _kv_block(kb, r, kvh, k_ptr, v_ptr, end, k_path, SKV: tl.constexpr, HKV: tl.constexpr,
              D: tl.constexpr, DV: tl.constexpr, BLOCK_KV: tl.constexpr, WINDOW: tl.constexpr):
    """Key block `kb` of row r, kv head kvh: key indices, k and v tiles, the keys' ends and (with
    a window) path positions (else the key indices, unread)."""
    kj = kb * BLOCK_KV + tl.arange(0, BLOCK_KV)
    rows = (r * SKV + kj[:, None]) * HKV + kvh
    k = tl.load(k_ptr + rows * D + tl.arange(0, D)[None, :])
    v = tl.load(v_ptr + rows * DV + tl.arange(0, DV)[None, :])
    kpath = kj
    if WINDOW > 0:
        kpath = tl.load(k_path + r * SKV + kj)
    return kj, k, v, tl.load(end + r * SKV + kj), kpath


@triton.jit
def forward_kernel(kv_blocks, kv_count, q_pos, q_ptr, k_ptr, v_ptr, end, q_path, k_path,
                   o_ptr, lse_ptr,
                   SQ: tl.constexpr, SKV: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
                   D: tl.constexpr, DV: tl.constexpr, MAX_KV: tl.constexpr,
                   BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, SCALE: tl.constexpr,
                   SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr):
    """One program per (q-block, row, q head): online softmax over the q-block's listed kv-blocks;
    writes O and the natural-log log-sum-exp."""
    i = tl.program_id(0)
    r = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // (HQ // HKV)
    rq, q, qp, qpath = _q_block(i, r, h, q_ptr, q_pos, q_path, SQ, HQ, D, BLOCK_Q, WINDOW)
    acc = tl.zeros((BLOCK_Q, DV), tl.float32)
    m = tl.full((BLOCK_Q,), MASKED, tl.float32)
    l = tl.zeros((BLOCK_Q,), tl.float32)
    n_qblocks = SQ // BLOCK_Q
    count = tl.load(kv_count + r * n_qblocks + i)
    for n in range(count):
        kb = tl.load(kv_blocks + (r * n_qblocks + i) * MAX_KV + n)
        kj, k, v, key_end, kpath = _kv_block(kb, r, kvh, k_ptr, v_ptr, end, k_path, SKV, HKV, D,
                                             DV, BLOCK_KV, WINDOW)
        vis = _visible(kj, qp, key_end, qpath, kpath, WINDOW)
        s, _ = _scores(q, k, SCALE, SOFTCAP, PRECISION)
        s = tl.where(vis, s, MASKED)
        m_next = tl.maximum(m, tl.max(s, axis=1))
        p = tl.where(vis, tl.exp(s - m_next[:, None]), 0.0)
        alpha = tl.exp(m - m_next)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        l = l * alpha + tl.sum(p, axis=1)
        m = m_next
    l = tl.where(l == 0.0, 1.0, l)
    tl.store(o_ptr + ((r * SQ + rq[:, None]) * HQ + h) * DV + tl.arange(0, DV)[None, :],
             (acc / l[:, None]).to(o_ptr.dtype.element_ty))
    tl.store(lse_ptr + (r * HQ + h) * SQ + rq, m + tl.log(l))


@triton.jit
def _probabilities(q, k, kj, qp, key_end, qpath, kpath, lse, SCALE: tl.constexpr,
                   SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr):
    """P = exp(S - lse) of a tile, zero where masked, and the soft-cap's tanh."""
    vis = _visible(kj, qp, key_end, qpath, kpath, WINDOW)
    s, t = _scores(q, k, SCALE, SOFTCAP, PRECISION)
    return tl.where(vis, tl.exp(s - lse[:, None]), 0.0), t


@triton.jit
def _score_grad(p, dp, delta, t, SOFTCAP: tl.constexpr):
    """dS = P (dP - delta) of the capped scores, through the cap's chain rule (1 - tanh^2)."""
    ds = p * (dp - delta[:, None])
    if SOFTCAP > 0:
        ds = ds * (1.0 - t * t)
    return ds


@triton.jit
def dq_kernel(kv_blocks, kv_count, q_pos, q_ptr, k_ptr, v_ptr, end, q_path, k_path, do_ptr,
              lse_ptr, delta_ptr, dq_ptr,
              SQ: tl.constexpr, SKV: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
              D: tl.constexpr, DV: tl.constexpr, MAX_KV: tl.constexpr,
              BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, SCALE: tl.constexpr,
              SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr):
    """dQ of one (q-block, row, q head) over the same kv-block list as the forward."""
    i = tl.program_id(0)
    r = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // (HQ // HKV)
    rq, q, qp, qpath = _q_block(i, r, h, q_ptr, q_pos, q_path, SQ, HQ, D, BLOCK_Q, WINDOW)
    do = tl.load(do_ptr + ((r * SQ + rq[:, None]) * HQ + h) * DV + tl.arange(0, DV)[None, :])
    lse = tl.load(lse_ptr + (r * HQ + h) * SQ + rq)
    delta = tl.load(delta_ptr + (r * HQ + h) * SQ + rq)
    dq = tl.zeros((BLOCK_Q, D), tl.float32)
    n_qblocks = SQ // BLOCK_Q
    count = tl.load(kv_count + r * n_qblocks + i)
    for n in range(count):
        kb = tl.load(kv_blocks + (r * n_qblocks + i) * MAX_KV + n)
        kj, k, v, key_end, kpath = _kv_block(kb, r, kvh, k_ptr, v_ptr, end, k_path, SKV, HKV, D,
                                             DV, BLOCK_KV, WINDOW)
        p, t = _probabilities(q, k, kj, qp, key_end, qpath, kpath, lse, SCALE, SOFTCAP, WINDOW,
                              PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = _score_grad(p, dp, delta, t, SOFTCAP)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(dq_ptr + ((r * SQ + rq[:, None]) * HQ + h) * D + tl.arange(0, D)[None, :],
             (dq * SCALE).to(dq_ptr.dtype.element_ty))


@triton.jit
def dkv_kernel(q_blocks, q_count, q_pos, q_ptr, k_ptr, v_ptr, end, q_path, k_path, do_ptr,
               lse_ptr, delta_ptr, dk_ptr, dv_ptr,
               SQ: tl.constexpr, SKV: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
               D: tl.constexpr, DV: tl.constexpr, MAX_Q: tl.constexpr,
               BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, SCALE: tl.constexpr,
               SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr):
    """dK, dV of one (kv-block, row, kv head) over its list of q-blocks and every q head sharing
    the kv head (GQA): each tile is written once, by one program, without atomics."""
    j = tl.program_id(0)
    r = tl.program_id(1)
    kvh = tl.program_id(2)
    group = HQ // HKV
    kj, k, v, key_end, kpath = _kv_block(j, r, kvh, k_ptr, v_ptr, end, k_path, SKV, HKV, D, DV,
                                         BLOCK_KV, WINDOW)
    dk = tl.zeros((BLOCK_KV, D), tl.float32)
    dv = tl.zeros((BLOCK_KV, DV), tl.float32)
    n_kvblocks = SKV // BLOCK_KV
    count = tl.load(q_count + r * n_kvblocks + j)
    for n in range(count):
        qb = tl.load(q_blocks + (r * n_kvblocks + j) * MAX_Q + n)
        for g in range(group):
            h = kvh * group + g
            rq, q, qp, qpath = _q_block(qb, r, h, q_ptr, q_pos, q_path, SQ, HQ, D, BLOCK_Q,
                                        WINDOW)
            do = tl.load(do_ptr + ((r * SQ + rq[:, None]) * HQ + h) * DV
                         + tl.arange(0, DV)[None, :])
            lse = tl.load(lse_ptr + (r * HQ + h) * SQ + rq)
            delta = tl.load(delta_ptr + (r * HQ + h) * SQ + rq)
            p, t = _probabilities(q, k, kj, qp, key_end, qpath, kpath, lse, SCALE, SOFTCAP,
                                  WINDOW, PRECISION)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = _score_grad(p, dp, delta, t, SOFTCAP)
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    rows = (r * SKV + kj[:, None]) * HKV + kvh
    tl.store(dk_ptr + rows * D + tl.arange(0, D)[None, :], (dk * SCALE).to(dk_ptr.dtype.element_ty))
    tl.store(dv_ptr + rows * DV + tl.arange(0, DV)[None, :], dv.to(dv_ptr.dtype.element_ty))
