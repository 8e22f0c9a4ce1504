"""Forward Mosaic GPU kernel of tree attention for Blackwell (sm_100): tcgen05 MMAs into tensor
memory (TMEM) instead of Hopper's wgmma into registers.

One CTA per (row, q head, block of 128 queries), two warpgroups:
- warpgroup 1 (the producer) streams K, V and, for PARTIAL blocks only, the keys' `end` tile
  through a `stages`-deep TMA ring, walking the CTA's compacted kv-block list
  (`mgpu_pipeline.produce`, shared with the Hopper kernels);
- warpgroup 0 (softmax) owns the 128 query rows, one per thread, which is how tcgen05 lays a
  128-row accumulator over TMEM's 128 lanes. Per listed kv-block it issues S = Q K^T into TMEM
  (K read through a transposed SMEM view: no transposed copy of k in HBM), loads S into
  registers, applies the tree mask on PARTIAL blocks (`tree_mask_tile`, the same element test as
  every kernel), runs the base-2 online softmax, rescales the output accumulator O (held in
  TMEM) by the change of the running max, writes P to SMEM and issues O += P V into TMEM.
At the end O / l and the base-2 log-sum-exp are written out, the residuals a backward needs.

Each tcgen05 MMA arrives on a tensor-core-ordered barrier that the softmax warpgroup waits on
before it reads the MMA's result, so the MMAs of a CTA run one at a time (overlap comes from the
TMA ring and from other CTAs on the SM). That is the simple, safe schedule; FlashAttention-4's
(two softmax warpgroups ping-ponging over two S tiles, a correction warpgroup that rescales O
only when the max grows by more than a threshold, a dedicated MMA warp) is the tuning left.

Head dims: q and k have `head_dim` (Dk), v and O `value_head_dim` (Dv); Dv < Dk is MLA
(DeepSeek-V3's Dk = 192, Dv = 128). SMEM holds Q (and O, in Q's tile when Dv = Dk, else its own),
the K and V rings and P. At Dk = 192 the kv-blocks are 64 keys (`forward_block_kv`): 128-key
rings with a two-stage ring and a 192-wide Q would need 240 KiB, more than a CTA's 227.
TMEM: S takes the kv-block's columns and O Dv columns of the 512 (256 at 128 / 128, 192 at
192 / 128).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jtree.kernels.attention.mgpu_pipeline import (
    NEG,
    Stream,
    consume,
    fetch_table,
    fetch_tiles,
    launch,
    list_buffer,
    list_entry,
    logits_base2,
    online_softmax_block,
    positions_smem,
    positions_tile,
    produce,
    read_positions,
    store_tiles,
    tiled_smem,
)

BLOCK_Q = 128  # query rows per CTA: one per TMEM lane, one per thread of the softmax warpgroup
BLOCK_KV = 128  # keys per kv-block: the N of S = Q K^T and the K of O += P V
SOFTMAX, PRODUCER = 0, 1  # warpgroup indices
RESCALE_COLUMNS = 32  # columns of O rescaled per TMEM load / store
WIDE_BLOCK_KV = 64  # keys per kv-block at a head_dim over 128 (`forward_block_kv`)


def forward_block_kv(head_dim: int) -> int:
    """Keys per kv-block of the forward for q/k `head_dim`: `BLOCK_KV`, or `WIDE_BLOCK_KV` over
    128 (MLA's 192), where 128-key K and V rings do not fit a CTA's SMEM next to Q."""
    return BLOCK_KV if head_dim <= 128 else WIDE_BLOCK_KV


def forward_buffers(kv_len: int, head_dim: int, value_head_dim: int, stages: int, dtype: Any,
                    window: int | None = None) -> dict[str, Any]:
    """SMEM buffers of the forward kernel (also what the SMEM budget check adds up)."""
    block_kv = forward_block_kv(head_dim)
    buffers = {
        "table": list_buffer(kv_len // block_kv),
        "q": tiled_smem((BLOCK_Q, head_dim), dtype),  # the Q tile, reused for O when Dv = Dk
        "qpos": positions_smem((1,), BLOCK_Q, window),  # its key (and path) positions
        "k": tiled_smem((stages, block_kv, head_dim), dtype),  # K ring (read as K^T by the MMA)
        "v": tiled_smem((stages, block_kv, value_head_dim), dtype),  # V ring
        "end": positions_smem((stages,), block_kv, window),  # end ring (PARTIAL blocks only)
        "p": tiled_smem((BLOCK_Q, block_kv), dtype),  # P, the LHS of O += P V
        "lse": plgpu.SMEM((BLOCK_Q,), jnp.float32),
    }
    if value_head_dim != head_dim:  # MLA: O has its own tile
        buffers["o"] = tiled_smem((BLOCK_Q, value_head_dim), dtype)
    return buffers


def tmem_buffers(head_dim: int, value_head_dim: int) -> dict[str, Any]:
    """TMEM accumulators: the scores S and the output O, float32 (`tmem_columns` counts them)."""
    return {"s": plgpu.TMEM((BLOCK_Q, forward_block_kv(head_dim)), jnp.float32),
            "o": plgpu.TMEM((BLOCK_Q, value_head_dim), jnp.float32)}


def tmem_columns(head_dim: int, value_head_dim: int) -> int:
    """TMEM columns the forward allocates (S and O, float32: one column per element of a row)."""
    return forward_block_kv(head_dim) + value_head_dim


def kv_list_cta(k_ref: Any, v_ref: Any, end_ref: Any, table_ref: Any, count_ref: Any, buf: Any,
                bar: Any, *, group: int, block_kv: int, stages: int, window: int | None
                ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, Any, jax.Array]:
    """The part of a query-block CTA (forward, dQ) that walks its kv list: every warpgroup
    waits for the list; the producer streams K, V (and `end` on PARTIAL blocks) of `block_kv`
    keys into `buf`'s "k", "v", "end" rings. (q_block, head, r, wg, entry, n_blocks) for the
    compute warpgroup's `consume`."""
    q_block, head, r = lax.axis_index("q"), lax.axis_index("h"), lax.axis_index("r")
    wg = lax.axis_index("wg")
    kv_head = head // group
    fetch_table(table_ref.at[r, q_block], buf["table"], bar["table"], wg, producer=PRODUCER)
    n_blocks = count_ref[r, q_block]

    def entry(n):
        block, kind = list_entry(buf["table"], n)
        return (block,), kind

    @pl.when(wg == PRODUCER)
    def _():
        keys = lambda b: pl.ds(b * block_kv, block_kv)
        produce(n_blocks, entry, [
            Stream(lambda b: k_ref.at[r, keys(b), kv_head], buf["k"], bar["k"]),
            Stream(lambda b: v_ref.at[r, keys(b), kv_head], buf["v"], bar["v"]),
            Stream(lambda b: positions_tile(end_ref, r, keys(b), window), buf["end"],
                   bar["end"], partial_only=True),
        ], bar["free"], stages, max_registers=None)

    return q_block, head, r, wg, entry, n_blocks


def _forward_kernel(*, group: int, head_dim: int, value_head_dim: int, stages: int,
                    scale: float, softcap: float | None, window: int | None
                    ) -> Callable[..., None]:
    """The body every CTA of `forward_call` runs (see the module docstring)."""
    block_kv = forward_block_kv(head_dim)

    def kernel(q_ref, k_ref, v_ref, end_ref, qpos_ref, table_ref, count_ref, o_ref, lse_ref, buf,
               tmem, bar):
        q_block, head, r, wg, entry, n_blocks = kv_list_cta(
            k_ref, v_ref, end_ref, table_ref, count_ref, buf, bar, group=group,
            block_kv=block_kv, stages=stages, window=window)

        @pl.when(wg == SOFTMAX)
        def _():
            queries = pl.ds(q_block * BLOCK_Q, BLOCK_Q)
            fetch_tiles([(q_ref.at[r, queries, head], buf["q"]),
                         (positions_tile(qpos_ref, r, queries, window), buf["qpos"].at[0])],
                        bar["q"], 0)
            q_pos, q_path = read_positions(buf["qpos"], 0, window)
            # O starts at zero, so every block can rescale and accumulate alike.
            plgpu.async_store_tmem(tmem["o"], jnp.zeros((BLOCK_Q, value_head_dim), jnp.float32))
            plgpu.commit_tmem()

            def block(slot, coords, kind, carry):
                (kv_block,) = coords
                m, l = carry
                plgpu.barrier_wait(bar["k"].at[slot])
                plgpu.tcgen05_mma(tmem["s"], buf["q"], plgpu.transpose_ref(buf["k"].at[slot],
                                                                           (1, 0)),
                                  bar["mma"], accumulate=False)
                plgpu.barrier_wait(bar["mma"])
                t = logits_base2(plgpu.async_load_tmem(tmem["s"]), scale, softcap)

                p, alpha, m_new, l = online_softmax_block(
                    t, kind, m, l, end_ready=bar["end"].at[slot], end_smem=buf["end"], slot=slot,
                    q_pos=q_pos, q_path=q_path, k_start=kv_block * block_kv, window=window)
                buf["p"][...] = p.astype(buf["p"].dtype)
                # O *= alpha in TMEM, a slice of columns at a time (a whole row of O next to S
                # and P is more than a thread's 255 registers).
                for c in range(0, value_head_dim, RESCALE_COLUMNS):
                    o_slice = tmem["o"].at[:, pl.ds(c, RESCALE_COLUMNS)]
                    o = plgpu.async_load_tmem(o_slice)
                    plgpu.async_store_tmem(o_slice,
                                           o * lax.broadcast_in_dim(alpha, o.shape, [0]))
                plgpu.commit_tmem()  # the rescaled O is what the next MMA accumulates onto
                plgpu.wait_load_tmem()  # S and O were read before an MMA overwrites them
                # P's register stores made visible to the tensor core, then a warpgroup barrier:
                # every thread's TMEM and SMEM traffic is done before the MMA is issued.
                plgpu.commit_smem()
                plgpu.barrier_wait(bar["v"].at[slot])
                plgpu.tcgen05_mma(tmem["o"], buf["p"], buf["v"].at[slot], bar["mma"],
                                  accumulate=True)
                plgpu.barrier_wait(bar["mma"])  # P and this slot's K, V are free again
                return m_new, l

            init = (jnp.full((BLOCK_Q,), NEG, jnp.float32), jnp.zeros((BLOCK_Q,), jnp.float32))
            m, l = consume(n_blocks, entry, block, init, bar["free"], stages)
            o = plgpu.async_load_tmem(tmem["o"])
            o_tile = buf["o"] if "o" in buf else buf["q"]
            o_tile[...] = (o / lax.broadcast_in_dim(l, o.shape, [0])).astype(o_tile.dtype)
            buf["lse"][...] = m + jnp.log2(l)
            plgpu.wait_load_tmem()
            store_tiles([(o_tile, o_ref.at[r, queries, head]),
                         (buf["lse"], lse_ref.at[r, head, queries])])

    return kernel


def forward_call(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    end: jax.Array,
    q_pos: jax.Array,
    table: jax.Array,
    count: jax.Array,
    *,
    stages: int,
    scale: float,
    softcap: float | None,
    window: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """O [rows, Sq, Hq, Dv] and base-2 LSE [rows, Hq, Sq] of q [rows, Sq, Hq, Dk] over k
    [rows, Skv, Hkv, Dk], v [rows, Skv, Hkv, Dv] under the tree mask, query i at key position
    q_pos[i] (`end`, `q_pos` as `mgpu.stacked_positions` makes them).

    `table` holds each 128-query block's (kv-block, kind) list at kv-blocks of
    `forward_block_kv(Dk)` keys (layout: `mgpu_pipeline.list_entry`) and `count` [rows, nq] its
    length.
    """
    rows, seq, q_heads, head_dim = q.shape
    group, value_head_dim = q_heads // v.shape[2], v.shape[3]
    kernel = _forward_kernel(group=group, head_dim=head_dim, value_head_dim=value_head_dim,
                             stages=stages, scale=scale, softcap=softcap, window=window)
    barriers = {
        "table": plgpu.Barrier(num_barriers=1),
        "q": plgpu.Barrier(num_barriers=2),
        "k": plgpu.Barrier(num_barriers=stages),
        "v": plgpu.Barrier(num_barriers=stages),
        "end": plgpu.Barrier(num_barriers=stages),
        "free": plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        "mma": plgpu.Barrier(orders_tensor_core=True),
    }
    out_type = (jax.ShapeDtypeStruct((rows, seq, q_heads, value_head_dim), q.dtype),
                jax.ShapeDtypeStruct((rows, q_heads, seq), jnp.float32))
    scratch = [forward_buffers(v.shape[1], head_dim, value_head_dim, stages, q.dtype, window),
               tmem_buffers(head_dim, value_head_dim), barriers]
    return launch(kernel, out_type, scratch, (table.shape[1], q_heads, rows), ("q", "h", "r"),
                  None, warpgroups=2)(q, k, v, end, q_pos, table, count)
