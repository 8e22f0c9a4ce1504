"""Backward Mosaic GPU kernels of tree attention: dQ over the kv lists, dK/dV over the q lists.

Two kernels instead of FlashAttention-3's fused backward (which accumulates dQ with fp32 atomic
adds from every kv-block CTA): each output tile is owned by exactly one CTA and written once, so
the gradients are deterministic run to run, and neither kernel needs TMA reductions, which the
Mosaic GPU interpreter cannot execute. The price is recomputing S and dP in the dQ kernel.

Both kernels recompute P = exp2(t - lse) from the saved base-2 log-sum-exp (no S x S residual):
- dQ: CTA per (row, head group, q-block) as in the forward; streams K^T, V^T, K (and `end` on
  PARTIAL blocks) over the q-block's kv list. dS = P (dP - delta) * dlogit/dscore,
  dQ += dS K.
- dK/dV: CTA per (row, kv head, 128-key block; 64 keys per consumer); the work list is every q
  head of the GQA group times the kv-block's q list, so dK and dV are summed over the group in
  registers and written once per kv head. In the transposed frame: S^T = K Q^T,
  dV += P^T dO, dP^T = V dO^T, dK += dS^T Q; streams Q^T, dO^T, Q, dO, lse, delta (and the
  queries' key positions q_pos on PARTIAL blocks).
Rectangular layouts (queries at key positions q_pos, see `mgpu_forward`) run unchanged: the dQ
kernel loads its queries' positions with its Q tile.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jtree.kernels.attention.mgpu_forward import q_block_cta
from jtree.kernels.attention.mgpu_pipeline import (
    CONSUMERS,
    PRODUCER,
    WG_ROWS,
    Stream,
    consume,
    fetch_table,
    fetch_tiles,
    launch,
    list_buffer,
    list_entry,
    logits_base2,
    logits_grad_factor,
    matmul,
    positions_smem,
    positions_tile,
    produce,
    read_positions,
    store_tiles,
    tiled_smem,
    tree_mask_tile,
    window_mask_tile,
)
from jtree.kernels.block_tables import PARTIAL

DQ_BLOCK_KV = 64  # kv tile of the dQ kernel (three streamed operands per block)
DKV_BLOCK_Q = 64  # q tile of the dK/dV kernel (four streamed operands per block)
DKV_BLOCK_KV = CONSUMERS * WG_ROWS  # keys per dK/dV CTA


def dq_buffers(kv_len: int, head_dim: int, stages: int, dtype: Any,
               window: int | None = None) -> dict[str, Any]:
    """SMEM buffers of the dQ kernel."""
    per_wg = (CONSUMERS, WG_ROWS, head_dim)
    return dict(
        table=list_buffer(kv_len // DQ_BLOCK_KV),
        q=tiled_smem(per_wg, dtype),  # reused for the dQ output
        do=tiled_smem(per_wg, dtype),
        lse=plgpu.SMEM((CONSUMERS, WG_ROWS), jnp.float32),
        delta=plgpu.SMEM((CONSUMERS, WG_ROWS), jnp.float32),
        qpos=positions_smem((CONSUMERS,), WG_ROWS, window),
        kt=tiled_smem((stages, head_dim, DQ_BLOCK_KV), dtype),
        vt=tiled_smem((stages, head_dim, DQ_BLOCK_KV), dtype),
        k=tiled_smem((stages, DQ_BLOCK_KV, head_dim), dtype),
        end=positions_smem((stages,), DQ_BLOCK_KV, window),
        ds=tiled_smem((CONSUMERS, WG_ROWS, DQ_BLOCK_KV), dtype),
    )


def dkv_buffers(q_len: int, head_dim: int, stages: int, dtype: Any,
                window: int | None = None) -> dict[str, Any]:
    """SMEM buffers of the dK/dV kernel."""
    per_wg = (CONSUMERS, WG_ROWS, head_dim)
    return dict(
        table=list_buffer(q_len // DKV_BLOCK_Q),
        k=tiled_smem(per_wg, dtype),  # reused for the dK output
        v=tiled_smem(per_wg, dtype),  # reused for the dV output
        end=positions_smem((CONSUMERS,), WG_ROWS, window),
        qt=tiled_smem((stages, head_dim, DKV_BLOCK_Q), dtype),
        dot=tiled_smem((stages, head_dim, DKV_BLOCK_Q), dtype),
        q=tiled_smem((stages, DKV_BLOCK_Q, head_dim), dtype),
        do=tiled_smem((stages, DKV_BLOCK_Q, head_dim), dtype),
        lse=plgpu.SMEM((stages, DKV_BLOCK_Q), jnp.float32),
        delta=plgpu.SMEM((stages, DKV_BLOCK_Q), jnp.float32),
        qpos=positions_smem((stages,), DKV_BLOCK_Q, window),
        pt=tiled_smem((CONSUMERS, WG_ROWS, DKV_BLOCK_Q), dtype),  # P^T, then dS^T
    )


def _ring_barriers(names: tuple[str, ...], stages: int, resident: int) -> dict[str, Any]:
    bars = {name: plgpu.Barrier(num_barriers=stages) for name in names}
    bars.update(
        table=plgpu.Barrier(num_barriers=1),
        resident=plgpu.Barrier(num_barriers=CONSUMERS * resident),
        free=plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
    )
    return bars


def dq_call(q, do, lse, delta, k_t, v_t, k, end, q_pos, table, count, *, stages: int,
            heads_per_cta: int, scale: float, softcap: float | None, interpret: Any,
            window: int | None = None) -> jax.Array:
    """dQ [rows, Sq, Hq, D]. `k_t`, `v_t` are [rows, Hkv, D, Skv]; `lse`, `delta` [rows, Hq, Sq];
    `table`, `count` the kv-block lists at kv-block size DQ_BLOCK_KV, as in `forward_call`."""
    rows, _, q_heads, head_dim = q.shape
    group = q_heads // k.shape[2]
    shape = (WG_ROWS, DQ_BLOCK_KV)

    def kernel(q_ref, do_ref, lse_ref, delta_ref, kt_ref, vt_ref, k_ref, end_ref, qpos_ref,
               table_ref, count_ref, dq_ref, buf, bar):
        cta = q_block_cta(table_ref, count_ref, buf["table"], bar["table"], heads_per_cta, group)
        r, wg, kv_head, n_blocks, entry, head, q_start = cta

        @pl.when(wg == PRODUCER)
        def _():
            keys = lambda b: pl.ds(b * DQ_BLOCK_KV, DQ_BLOCK_KV)
            produce(n_blocks, entry, [
                Stream(lambda b: kt_ref.at[r, kv_head, :, keys(b)], buf["kt"], bar["kt"]),
                Stream(lambda b: vt_ref.at[r, kv_head, :, keys(b)], buf["vt"], bar["vt"]),
                Stream(lambda b: k_ref.at[r, keys(b), kv_head], buf["k"], bar["k"]),
                Stream(lambda b: positions_tile(end_ref, r, keys(b), window), buf["end"],
                       bar["end"], partial_only=True),
            ], bar["free"], stages)

        @pl.when(wg < CONSUMERS)
        def _():
            plgpu.set_max_registers(232, action="increase")
            queries = pl.ds(q_start, WG_ROWS)
            q_tile, do_tile, ds_tile = buf["q"].at[wg], buf["do"].at[wg], buf["ds"].at[wg]
            fetch_tiles([(q_ref.at[r, queries, head], q_tile),
                         (do_ref.at[r, queries, head], do_tile),
                         (lse_ref.at[r, head, queries], buf["lse"].at[wg]),
                         (delta_ref.at[r, head, queries], buf["delta"].at[wg]),
                         (positions_tile(qpos_ref, r, queries, window), buf["qpos"].at[wg])],
                        bar["resident"], wg * 5)
            q_pos, q_path = read_positions(buf["qpos"], wg, window)
            lse = lax.broadcast_in_dim(buf["lse"][wg], shape, [0])
            delta = lax.broadcast_in_dim(buf["delta"][wg], shape, [0])

            def block(slot, coords, kind, dq):
                (kv_block,) = coords
                plgpu.barrier_wait(bar["kt"].at[slot])
                t = logits_base2(matmul(q_tile, buf["kt"].at[slot], shape), scale, softcap)

                def masked(t):
                    plgpu.barrier_wait(bar["end"].at[slot])
                    ends, k_path = read_positions(buf["end"], slot, window)
                    mask = tree_mask_tile(q_pos, kv_block * DQ_BLOCK_KV, ends, shape, key_axis=1)
                    mask = window_mask_tile(mask, q_path, k_path, shape, 1, window)
                    return jnp.where(mask, t, -jnp.inf)

                p = jnp.exp2(lax.cond(kind == PARTIAL, masked, lambda t: t, t) - lse)
                plgpu.barrier_wait(bar["vt"].at[slot])
                dp = matmul(do_tile, buf["vt"].at[slot], shape)
                ds_tile[...] = (p * (dp - delta) * logits_grad_factor(t, scale, softcap)
                                ).astype(ds_tile.dtype)
                plgpu.commit_smem()
                plgpu.barrier_wait(bar["k"].at[slot])
                return dq + matmul(ds_tile, buf["k"].at[slot], (WG_ROWS, head_dim))

            dq = consume(n_blocks, entry, block, jnp.zeros((WG_ROWS, head_dim), jnp.float32),
                         bar["free"], stages)
            q_tile[...] = dq.astype(q_tile.dtype)
            store_tiles([(q_tile, dq_ref.at[r, queries, head])])

    buffers = dq_buffers(k.shape[1], head_dim, stages, q.dtype, window)
    barriers = _ring_barriers(("kt", "vt", "k", "end"), stages, resident=5)
    return launch(kernel, jax.ShapeDtypeStruct(q.shape, q.dtype), [buffers, barriers],
                  (table.shape[1], q_heads // heads_per_cta, rows), ("q", "h", "r"),
                  interpret)(q, do, lse, delta, k_t, v_t, k, end, q_pos, table, count)


def _dkv_kernel(*, group: int, head_dim: int, stages: int, scale: float,
                softcap: float | None, window: int | None = None) -> Callable[..., None]:
    """The body every CTA of `dkv_call` runs: one producer warpgroup streams the group's query
    blocks (Q, dO, their transposes, LSE, delta, positions) while the consumer warpgroups
    accumulate dK and dV of their 64 keys."""
    shape = (WG_ROWS, DKV_BLOCK_Q)

    def kernel(qt_ref, dot_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, end_ref,
               qpos_ref, table_ref, count_ref, dk_ref, dv_ref, buf, bar):
        kb, kv_head, r = lax.axis_index("k"), lax.axis_index("h"), lax.axis_index("r")
        wg = lax.axis_index("wg")
        n_blocks = count_ref[r, kb]
        fetch_table(table_ref.at[r, kb], buf["table"], bar["table"], wg)

        def entry(n):  # step n: q head (n // n_blocks) of the group x (n % n_blocks)-th q-block
            block, kind = list_entry(buf["table"], lax.rem(n, n_blocks))
            return (kv_head * group + lax.div(n, n_blocks), block), kind

        @pl.when(wg == PRODUCER)
        def _():
            qs = lambda b: pl.ds(b * DKV_BLOCK_Q, DKV_BLOCK_Q)
            produce(n_blocks * group, entry, [
                Stream(lambda h, b: qt_ref.at[r, h, :, qs(b)], buf["qt"], bar["qt"]),
                Stream(lambda h, b: dot_ref.at[r, h, :, qs(b)], buf["dot"], bar["dot"]),
                Stream(lambda h, b: q_ref.at[r, qs(b), h], buf["q"], bar["q"]),
                Stream(lambda h, b: do_ref.at[r, qs(b), h], buf["do"], bar["do"]),
                Stream(lambda h, b: lse_ref.at[r, h, qs(b)], buf["lse"], bar["lse"]),
                Stream(lambda h, b: delta_ref.at[r, h, qs(b)], buf["delta"], bar["delta"]),
                Stream(lambda h, b: positions_tile(qpos_ref, r, qs(b), window), buf["qpos"],
                       bar["qpos"], partial_only=True),
            ], bar["free"], stages)

        @pl.when(wg < CONSUMERS)
        def _():
            plgpu.set_max_registers(232, action="increase")
            k_start = kb * DKV_BLOCK_KV + wg * WG_ROWS
            keys = pl.ds(k_start, WG_ROWS)
            k_tile, v_tile, pt_tile = buf["k"].at[wg], buf["v"].at[wg], buf["pt"].at[wg]
            fetch_tiles([(k_ref.at[r, keys, kv_head], k_tile),
                         (v_ref.at[r, keys, kv_head], v_tile),
                         (positions_tile(end_ref, r, keys, window), buf["end"].at[wg])],
                        bar["resident"], wg * 3)
            ends, k_path = read_positions(buf["end"], wg, window)

            def block(slot, coords, kind, carry):
                dk, dv = carry
                plgpu.barrier_wait(bar["qt"].at[slot])
                t = logits_base2(matmul(k_tile, buf["qt"].at[slot], shape), scale, softcap)
                def masked(t):
                    plgpu.barrier_wait(bar["qpos"].at[slot])
                    q_pos, q_path = read_positions(buf["qpos"], slot, window)
                    mask = tree_mask_tile(q_pos, k_start, ends, shape, key_axis=0)
                    mask = window_mask_tile(mask, q_path, k_path, shape, 0, window)
                    return jnp.where(mask, t, -jnp.inf)

                t_visible = lax.cond(kind == PARTIAL, masked, lambda t: t, t)
                plgpu.barrier_wait(bar["lse"].at[slot])
                pt = jnp.exp2(t_visible - lax.broadcast_in_dim(buf["lse"][slot], shape, [1]))
                pt_tile[...] = pt.astype(pt_tile.dtype)
                plgpu.commit_smem()
                plgpu.barrier_wait(bar["do"].at[slot])
                dv = dv + matmul(pt_tile, buf["do"].at[slot], (WG_ROWS, head_dim))
                plgpu.barrier_wait(bar["dot"].at[slot])
                dpt = matmul(v_tile, buf["dot"].at[slot], shape)
                plgpu.barrier_wait(bar["delta"].at[slot])
                delta = lax.broadcast_in_dim(buf["delta"][slot], shape, [1])
                pt_tile[...] = (pt * (dpt - delta) * logits_grad_factor(t, scale, softcap)
                                ).astype(pt_tile.dtype)
                plgpu.commit_smem()
                plgpu.barrier_wait(bar["q"].at[slot])
                dk = dk + matmul(pt_tile, buf["q"].at[slot], (WG_ROWS, head_dim))
                return dk, dv

            zeros = jnp.zeros((WG_ROWS, head_dim), jnp.float32)
            dk, dv = consume(n_blocks * group, entry, block, (zeros, zeros), bar["free"], stages)
            k_tile[...] = dk.astype(k_tile.dtype)
            v_tile[...] = dv.astype(v_tile.dtype)
            store_tiles([(k_tile, dk_ref.at[r, keys, kv_head]),
                         (v_tile, dv_ref.at[r, keys, kv_head])])

    return kernel


def dkv_call(q_t, do_t, q, do, lse, delta, k, v, end, q_pos, table, count, *, stages: int,
             scale: float, softcap: float | None,
             interpret: Any, window: int | None = None) -> tuple[jax.Array, jax.Array]:
    """dK, dV [rows, Skv, Hkv, D]. `q_t`, `do_t` are [rows, Hq, D, Sq]; `table` holds each 128-key
    block's (q-block, kind) list at q-block size DKV_BLOCK_Q (layout: `mgpu_pipeline.list_entry`)
    and `count` [rows, nk] its length."""
    rows, q_len, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = q_heads // kv_heads

    kernel = _dkv_kernel(group=group, head_dim=head_dim, stages=stages, scale=scale,
                         softcap=softcap, window=window)

    buffers = dkv_buffers(q_len, head_dim, stages, q.dtype, window)
    barriers = _ring_barriers(("qt", "dot", "q", "do", "lse", "delta", "qpos"), stages, resident=3)
    out = jax.ShapeDtypeStruct(k.shape, k.dtype)
    return launch(kernel, (out, out), [buffers, barriers],
                  (table.shape[1], kv_heads, rows), ("k", "h", "r"),
                  interpret)(q_t, do_t, q, do, lse, delta, k, v, end, q_pos, table, count)
