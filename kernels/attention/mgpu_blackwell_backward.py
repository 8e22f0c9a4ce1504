"""Backward Mosaic GPU kernels of tree attention for Blackwell (sm_100): dQ over the kv lists,
dK/dV over the transposed q lists, every product a tcgen05 MMA into tensor memory (TMEM).

The same split as the Hopper backward (`mgpu_backward`): two kernels, each output tile owned by
one CTA and written once (deterministic, no atomics), P recomputed from the forward's base-2
log-sum-exp. Each CTA has two warpgroups, as the Blackwell forward: a TMA producer walking the
block list (`mgpu_pipeline.produce`) and a compute warpgroup that owns 128 accumulator rows, one
per thread and per TMEM lane.
- dQ: CTA per (row, q head, 128-query block); streams K, V (and `end` on PARTIAL blocks) in
  64-key blocks. S = Q K^T and dP = dO V^T into TMEM, dS = P (dP - delta) dlogit/dscore into
  SMEM, dQ += dS K accumulated in TMEM.
- dK/dV: CTA per (row, kv head, 128-key block); the work list is every q head of the GQA group
  times the key block's q list (64-query blocks), so dK and dV are summed over the group in TMEM
  and written once per kv head. S^T = K Q^T, P^T into SMEM, dV += P^T dO, dP^T = V dO^T,
  dS^T into SMEM (P^T's buffer), dK += dS^T Q.
K (dQ) and dO, Q (dK/dV) are read as the transposed B operands through `transpose_ref` views of
their SMEM tiles: no transposed copies in HBM. The 64-wide streamed blocks keep both kernels at
~144 KiB of SMEM at head_dim 128 with a two-stage ring, and S, dP at 64 TMEM columns each.

Head dims: Q, K, dQ, dK have Dk columns, V, dO, dV Dv (MLA: Dk = 192, Dv = 128). Every SMEM tile
and TMEM accumulator is sized by its own dim; at 192 / 128 with a two-stage ring both kernels take
~178 KiB of SMEM, dQ 320 TMEM columns (S, dP, dQ) and dK/dV 448 (S^T, dP^T, dK, dV) of the 512.

As in the forward, each MMA arrives on a tensor-core-ordered barrier that the compute warpgroup
waits on before it reads the result or reuses an operand: one MMA at a time per CTA.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jtree.kernels.attention.mgpu_blackwell_forward import (
    BLOCK_KV,
    BLOCK_Q,
    PRODUCER,
    SOFTMAX,
    kv_list_cta,
)
from jtree.kernels.attention.mgpu_pipeline import (
    Stream,
    consume,
    fetch_table,
    fetch_tiles,
    launch,
    list_buffer,
    list_entry,
    logits_base2,
    logits_grad_factor,
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

DQ_BLOCK_Q = BLOCK_Q  # queries per dQ CTA (one per TMEM lane)
DQ_BLOCK_KV = 64  # keys per streamed block of the dQ kernel
DKV_BLOCK_KV = BLOCK_KV  # keys per dK/dV CTA (one per TMEM lane)
DKV_BLOCK_Q = 64  # queries per streamed block of the dK/dV kernel


def dq_buffers(kv_len: int, head_dim: int, value_head_dim: int, stages: int, dtype: Any,
               window: int | None = None) -> dict[str, Any]:
    """SMEM buffers of the dQ kernel (also what the SMEM budget check adds up)."""
    return {
        "table": list_buffer(kv_len // DQ_BLOCK_KV),
        "q": tiled_smem((DQ_BLOCK_Q, head_dim), dtype),  # reused for the dQ output
        "do": tiled_smem((DQ_BLOCK_Q, value_head_dim), dtype),
        "lse": plgpu.SMEM((DQ_BLOCK_Q,), jnp.float32),
        "delta": plgpu.SMEM((DQ_BLOCK_Q,), jnp.float32),
        "qpos": positions_smem((1,), DQ_BLOCK_Q, window),
        "k": tiled_smem((stages, DQ_BLOCK_KV, head_dim), dtype),
        "v": tiled_smem((stages, DQ_BLOCK_KV, value_head_dim), dtype),
        "end": positions_smem((stages,), DQ_BLOCK_KV, window),
        "ds": tiled_smem((DQ_BLOCK_Q, DQ_BLOCK_KV), dtype),
    }


def dkv_buffers(q_len: int, head_dim: int, value_head_dim: int, stages: int, dtype: Any,
                window: int | None = None) -> dict[str, Any]:
    """SMEM buffers of the dK/dV kernel."""
    return {
        "table": list_buffer(q_len // DKV_BLOCK_Q),
        "k": tiled_smem((DKV_BLOCK_KV, head_dim), dtype),  # reused for the dK output
        "v": tiled_smem((DKV_BLOCK_KV, value_head_dim), dtype),  # reused for the dV output
        "end": positions_smem((1,), DKV_BLOCK_KV, window),
        "q": tiled_smem((stages, DKV_BLOCK_Q, head_dim), dtype),
        "do": tiled_smem((stages, DKV_BLOCK_Q, value_head_dim), dtype),
        "lse": plgpu.SMEM((stages, DKV_BLOCK_Q), jnp.float32),
        "delta": plgpu.SMEM((stages, DKV_BLOCK_Q), jnp.float32),
        "qpos": positions_smem((stages,), DKV_BLOCK_Q, window),
        "pt": tiled_smem((DKV_BLOCK_KV, DKV_BLOCK_Q), dtype),  # P^T, then dS^T
    }


def tmem_columns(head_dim: int, value_head_dim: int) -> dict[str, int]:
    """TMEM columns (float32) each backward kernel allocates: dQ's S, dP and dQ; dK/dV's S^T,
    dP^T, dK and dV."""
    return {"dq": 2 * DQ_BLOCK_KV + head_dim,
            "dkv": 2 * DKV_BLOCK_Q + head_dim + value_head_dim}


def _barriers(streams: tuple[str, ...], stages: int, resident: int) -> dict[str, Any]:
    bars = {name: plgpu.Barrier(num_barriers=stages) for name in streams}
    bars.update(table=plgpu.Barrier(num_barriers=1),
                resident=plgpu.Barrier(num_barriers=resident),
                free=plgpu.Barrier(num_arrivals=1, num_barriers=stages),
                mma=plgpu.Barrier(orders_tensor_core=True))
    return bars


def _mma(acc: Any, a: Any, b: Any, bar: Any, accumulate: bool) -> None:
    """acc (TMEM) = a @ b (+ acc), issued after this warpgroup's register stores to SMEM are
    visible to the tensor core and its TMEM loads are done; returns once the MMA has landed."""
    plgpu.wait_load_tmem()
    plgpu.commit_smem()
    plgpu.tcgen05_mma(acc, a, b, bar, accumulate=accumulate)
    plgpu.barrier_wait(bar)


def _visible(t: jax.Array, kind: jax.Array, ready: Any, positions: Any, slot: jax.Array,
             fixed: tuple[Any, Any], k_start: jax.Array, window: int | None,
             key_axis: int) -> jax.Array:
    """Logits `t` with hidden pairs at -inf on a PARTIAL block: the streamed positions (slot
    `slot` of `positions`, after `ready`) against the CTA's own (`fixed`: values, path)."""
    shape = t.shape

    def masked(t):
        plgpu.barrier_wait(ready)
        streamed = read_positions(positions, slot, window)
        (q_pos, q_path), (ends, k_path) = ((fixed, streamed) if key_axis == 1
                                           else (streamed, fixed))
        mask = tree_mask_tile(q_pos, k_start, ends, shape, key_axis=key_axis)
        mask = window_mask_tile(mask, q_path, k_path, shape, key_axis, window)
        return jnp.where(mask, t, -jnp.inf)

    return lax.cond(kind == PARTIAL, masked, lambda t: t, t)


def _zero(acc: Any, columns: int) -> None:
    plgpu.async_store_tmem(acc, jnp.zeros((acc.shape[0], columns), jnp.float32))
    plgpu.commit_tmem()


def dq_call(q, do, lse, delta, k, v, end, q_pos, table, count, *, stages: int, scale: float,
            softcap: float | None, window: int | None = None) -> jax.Array:
    """dQ [rows, Sq, Hq, Dk] (`do` [rows, Sq, Hq, Dv]); `lse` (base 2), `delta` [rows, Hq, Sq];
    `table`, `count` the kv-block lists of 128-query blocks at kv-block size DQ_BLOCK_KV
    (`mgpu.list_table`)."""
    rows, _, q_heads, head_dim = q.shape
    group, value_head_dim = q_heads // k.shape[2], v.shape[3]

    def kernel(q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, end_ref, qpos_ref, table_ref,
               count_ref, dq_ref, buf, tmem, bar):
        q_block, head, r, wg, entry, n_blocks = kv_list_cta(
            k_ref, v_ref, end_ref, table_ref, count_ref, buf, bar, group=group,
            block_kv=DQ_BLOCK_KV, stages=stages, window=window)

        @pl.when(wg == SOFTMAX)
        def _():
            queries = pl.ds(q_block * DQ_BLOCK_Q, DQ_BLOCK_Q)
            fetch_tiles([(q_ref.at[r, queries, head], buf["q"]),
                         (do_ref.at[r, queries, head], buf["do"]),
                         (lse_ref.at[r, head, queries], buf["lse"]),
                         (delta_ref.at[r, head, queries], buf["delta"]),
                         (positions_tile(qpos_ref, r, queries, window), buf["qpos"].at[0])],
                        bar["resident"], 0)
            own = read_positions(buf["qpos"], 0, window)
            shape = (DQ_BLOCK_Q, DQ_BLOCK_KV)
            _zero(tmem["dq"], head_dim)

            def block(slot, coords, kind, carry):
                (kv_block,) = coords
                plgpu.barrier_wait(bar["k"].at[slot])
                _mma(tmem["s"], buf["q"], plgpu.transpose_ref(buf["k"].at[slot], (1, 0)),
                     bar["mma"], accumulate=False)
                plgpu.barrier_wait(bar["v"].at[slot])
                _mma(tmem["dp"], buf["do"], plgpu.transpose_ref(buf["v"].at[slot], (1, 0)),
                     bar["mma"], accumulate=False)
                t = logits_base2(plgpu.async_load_tmem(tmem["s"]), scale, softcap)
                t_visible = _visible(t, kind, bar["end"].at[slot], buf["end"], slot, own,
                                     kv_block * DQ_BLOCK_KV, window, key_axis=1)
                p = jnp.exp2(t_visible - lax.broadcast_in_dim(buf["lse"][...], shape, [0]))
                dp = plgpu.async_load_tmem(tmem["dp"])
                delta = lax.broadcast_in_dim(buf["delta"][...], shape, [0])
                buf["ds"][...] = (p * (dp - delta) * logits_grad_factor(t, scale, softcap)
                                  ).astype(buf["ds"].dtype)
                _mma(tmem["dq"], buf["ds"], buf["k"].at[slot], bar["mma"], accumulate=True)
                return carry

            consume(n_blocks, entry, block, (), bar["free"], stages)
            buf["q"][...] = plgpu.async_load_tmem(tmem["dq"]).astype(buf["q"].dtype)
            plgpu.wait_load_tmem()
            store_tiles([(buf["q"], dq_ref.at[r, queries, head])])

    tmem = {"s": plgpu.TMEM((DQ_BLOCK_Q, DQ_BLOCK_KV), jnp.float32),
            "dp": plgpu.TMEM((DQ_BLOCK_Q, DQ_BLOCK_KV), jnp.float32),
            "dq": plgpu.TMEM((DQ_BLOCK_Q, head_dim), jnp.float32)}
    scratch = [dq_buffers(k.shape[1], head_dim, value_head_dim, stages, q.dtype, window), tmem,
               _barriers(("k", "v", "end"), stages, resident=5)]
    return launch(kernel, jax.ShapeDtypeStruct(q.shape, q.dtype), scratch,
                  (table.shape[1], q_heads, rows), ("q", "h", "r"), None,
                  warpgroups=2)(q, do, lse, delta, k, v, end, q_pos, table, count)


def dkv_call(q, do, lse, delta, k, v, end, q_pos, table, count, *, stages: int, scale: float,
             softcap: float | None, window: int | None = None) -> tuple[jax.Array, jax.Array]:
    """dK [rows, Skv, Hkv, Dk], dV [rows, Skv, Hkv, Dv]; `table`, `count` the q-block lists of
    128-key blocks at q-block size DKV_BLOCK_Q (the block tables' transposed lists)."""
    rows, q_len, q_heads, head_dim = q.shape
    kv_heads, value_head_dim = k.shape[2], v.shape[3]
    group = q_heads // kv_heads

    def kernel(q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, end_ref, qpos_ref, table_ref,
               count_ref, dk_ref, dv_ref, buf, tmem, bar):
        kb, kv_head, r = lax.axis_index("k"), lax.axis_index("h"), lax.axis_index("r")
        wg = lax.axis_index("wg")
        n_blocks = count_ref[r, kb]
        fetch_table(table_ref.at[r, kb], buf["table"], bar["table"], wg, producer=PRODUCER)

        def entry(n):  # step n: q head (n // n_blocks) of the group x (n % n_blocks)-th q-block
            block, kind = list_entry(buf["table"], lax.rem(n, n_blocks))
            return (kv_head * group + lax.div(n, n_blocks), block), kind

        @pl.when(wg == PRODUCER)
        def _():
            qs = lambda b: pl.ds(b * DKV_BLOCK_Q, DKV_BLOCK_Q)
            produce(n_blocks * group, entry, [
                Stream(lambda h, b: q_ref.at[r, qs(b), h], buf["q"], bar["q"]),
                Stream(lambda h, b: do_ref.at[r, qs(b), h], buf["do"], bar["do"]),
                Stream(lambda h, b: lse_ref.at[r, h, qs(b)], buf["lse"], bar["lse"]),
                Stream(lambda h, b: delta_ref.at[r, h, qs(b)], buf["delta"], bar["delta"]),
                Stream(lambda h, b: positions_tile(qpos_ref, r, qs(b), window), buf["qpos"],
                       bar["qpos"], partial_only=True),
            ], bar["free"], stages, max_registers=None)

        @pl.when(wg == SOFTMAX)
        def _():
            k_start = kb * DKV_BLOCK_KV
            keys = pl.ds(k_start, DKV_BLOCK_KV)
            fetch_tiles([(k_ref.at[r, keys, kv_head], buf["k"]),
                         (v_ref.at[r, keys, kv_head], buf["v"]),
                         (positions_tile(end_ref, r, keys, window), buf["end"].at[0])],
                        bar["resident"], 0)
            own = read_positions(buf["end"], 0, window)
            shape = (DKV_BLOCK_KV, DKV_BLOCK_Q)
            _zero(tmem["dk"], head_dim)
            _zero(tmem["dv"], value_head_dim)

            def block(slot, coords, kind, carry):
                plgpu.barrier_wait(bar["q"].at[slot])
                _mma(tmem["st"], buf["k"], plgpu.transpose_ref(buf["q"].at[slot], (1, 0)),
                     bar["mma"], accumulate=False)
                t = logits_base2(plgpu.async_load_tmem(tmem["st"]), scale, softcap)
                t_visible = _visible(t, kind, bar["qpos"].at[slot], buf["qpos"], slot, own,
                                     k_start, window, key_axis=0)
                plgpu.barrier_wait(bar["lse"].at[slot])
                pt = jnp.exp2(t_visible - lax.broadcast_in_dim(buf["lse"][slot], shape, [1]))
                buf["pt"][...] = pt.astype(buf["pt"].dtype)
                plgpu.barrier_wait(bar["do"].at[slot])
                _mma(tmem["dv"], buf["pt"], buf["do"].at[slot], bar["mma"], accumulate=True)
                _mma(tmem["dpt"], buf["v"], plgpu.transpose_ref(buf["do"].at[slot], (1, 0)),
                     bar["mma"], accumulate=False)
                dpt = plgpu.async_load_tmem(tmem["dpt"])
                plgpu.barrier_wait(bar["delta"].at[slot])
                delta = lax.broadcast_in_dim(buf["delta"][slot], shape, [1])
                buf["pt"][...] = (pt * (dpt - delta) * logits_grad_factor(t, scale, softcap)
                                  ).astype(buf["pt"].dtype)
                _mma(tmem["dk"], buf["pt"], buf["q"].at[slot], bar["mma"], accumulate=True)
                return carry

            consume(n_blocks * group, entry, block, (), bar["free"], stages)
            buf["k"][...] = plgpu.async_load_tmem(tmem["dk"]).astype(buf["k"].dtype)
            buf["v"][...] = plgpu.async_load_tmem(tmem["dv"]).astype(buf["v"].dtype)
            plgpu.wait_load_tmem()
            store_tiles([(buf["k"], dk_ref.at[r, keys, kv_head]),
                         (buf["v"], dv_ref.at[r, keys, kv_head])])

    tmem = {"st": plgpu.TMEM((DKV_BLOCK_KV, DKV_BLOCK_Q), jnp.float32),
            "dpt": plgpu.TMEM((DKV_BLOCK_KV, DKV_BLOCK_Q), jnp.float32),
            "dk": plgpu.TMEM((DKV_BLOCK_KV, head_dim), jnp.float32),
            "dv": plgpu.TMEM((DKV_BLOCK_KV, value_head_dim), jnp.float32)}
    scratch = [dkv_buffers(q_len, head_dim, value_head_dim, stages, q.dtype, window), tmem,
               _barriers(("q", "do", "lse", "delta", "qpos"), stages, resident=3)]
    out = (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype))
    return launch(kernel, out, scratch, (table.shape[1], kv_heads, rows), ("k", "h", "r"),
                  None, warpgroups=2)(q, do, lse, delta, k, v, end, q_pos, table, count)
