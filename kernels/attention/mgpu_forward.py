"""Forward Mosaic GPU kernel of tree attention: one CTA per (row, head group, q-block).

The CTA's 2 x 64 query rows are either 128 consecutive positions of one q head (`heads_per_cta`
1) or the same 64 positions of two q heads that share a kv head (`heads_per_cta` 2, GQA with an
even group: finer q-blocks for the same K/V reuse). Both consumer warpgroups see the same kv-block
list, so one K/V stream feeds both. Per block: S = Q K^T (wgmma, K^T tile from a transposed copy of
k), element mask from `end` on PARTIAL blocks only, online softmax in base 2, P staged through SMEM,
O += P V (wgmma). Outputs O and the base-2 log-sum-exp (the only residual the backward needs).

Queries may be a subset of the key positions (a part attending to cached prefix keys): query i sits
at key position q_pos[i], which the element mask reads (each consumer loads its 64 queries'
positions with its Q tile), so the same kernel runs rectangular [Sq, Skv] layouts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jtree.kernels.attention.mgpu_pipeline import (
    CONSUMERS,
    NEG,
    PRODUCER,
    WG_ROWS,
    Entry,
    Stream,
    consume,
    fetch_table,
    fetch_tiles,
    launch,
    list_buffer,
    list_entry,
    logits_base2,
    matmul,
    online_softmax_block,
    positions_smem,
    positions_tile,
    produce,
    read_positions,
    store_tiles,
    tiled_smem,
)


def forward_buffers(kv_len: int, head_dim: int, block_kv: int, stages: int,
                    dtype: Any, window: int | None = None) -> dict[str, Any]:
    """SMEM buffers of the forward kernel (also what the SMEM budget check adds up)."""
    return dict(
        table=list_buffer(kv_len // block_kv),
        q=tiled_smem((CONSUMERS, WG_ROWS, head_dim), dtype),  # Q tiles, reused for O
        qpos=positions_smem((CONSUMERS,), WG_ROWS, window),  # their key (and path) positions
        kt=tiled_smem((stages, head_dim, block_kv), dtype),  # K^T ring
        v=tiled_smem((stages, block_kv, head_dim), dtype),  # V ring
        end=positions_smem((stages,), block_kv, window),  # end ring (PARTIAL blocks only)
        p=tiled_smem((CONSUMERS, WG_ROWS, block_kv), dtype),  # P tiles
        lse=plgpu.SMEM((CONSUMERS, WG_ROWS), jnp.float32),
    )


class QBlockCta(NamedTuple):
    """A forward or dQ CTA: its row, kv head and kv-block list; per consumer, its query tile."""

    row: jax.Array
    wg: jax.Array
    kv_head: jax.Array
    n_blocks: jax.Array
    entry: Entry
    head: jax.Array  # q head of consumer `wg`'s 64 query rows
    q_start: jax.Array  # their first row in q (q_pos gives their key positions)


def q_block_cta(table_ref: Any, count_ref: Any, table_smem: Any, table_ready: Any,
                heads_per_cta: int, group: int) -> QBlockCta:
    """Prologue of a CTA over grid ("q", "h", "r"): locate it and load its kv-block list."""
    q_block, head_block, row = lax.axis_index("q"), lax.axis_index("h"), lax.axis_index("r")
    wg = lax.axis_index("wg")
    head0 = head_block * heads_per_cta
    if heads_per_cta == 1:
        head, q_start = head0, (q_block * CONSUMERS + wg) * WG_ROWS
    else:
        head, q_start = head0 + wg, q_block * WG_ROWS
    fetch_table(table_ref.at[row, q_block], table_smem, table_ready, wg)

    def entry(n):
        block, kind = list_entry(table_smem, n)
        return (block,), kind

    return QBlockCta(row, wg, head0 // group, count_ref[row, q_block], entry, head, q_start)


def _forward_kernel(*, group: int, head_dim: int, block_kv: int, stages: int, heads_per_cta: int,
                    scale: float, softcap: float | None,
                    window: int | None = None) -> Callable[..., None]:
    """The body every CTA of `forward_call` runs: one producer warpgroup streams K^T, V and the
    mask's `end` through `stages` SMEM slots while the consumer warpgroups run the online softmax."""
    shape = (WG_ROWS, block_kv)

    def kernel(q_ref, kt_ref, v_ref, end_ref, qpos_ref, table_ref, count_ref, o_ref, lse_ref, buf,
               bar):
        cta = q_block_cta(table_ref, count_ref, buf["table"], bar["table"], heads_per_cta, group)
        r, wg, kv_head, n_blocks, entry, head, q_start = cta

        @pl.when(wg == PRODUCER)
        def _():
            keys = lambda b: pl.ds(b * block_kv, block_kv)
            produce(n_blocks, entry, [
                Stream(lambda b: kt_ref.at[r, kv_head, :, keys(b)], buf["kt"], bar["kt"]),
                Stream(lambda b: v_ref.at[r, keys(b), kv_head], buf["v"], bar["v"]),
                Stream(lambda b: positions_tile(end_ref, r, keys(b), window), buf["end"],
                       bar["end"], partial_only=True),
            ], bar["free"], stages)

        def rendezvous():
            plgpu.barrier_arrive(bar["schedule"])
            plgpu.barrier_wait(bar["schedule"])

        @pl.when(wg < CONSUMERS)
        def _():
            plgpu.set_max_registers(232, action="increase")
            queries = pl.ds(q_start, WG_ROWS)
            q_tile, p_tile = buf["q"].at[wg], buf["p"].at[wg]
            fetch_tiles([(q_ref.at[r, queries, head], q_tile),
                         (positions_tile(qpos_ref, r, queries, window), buf["qpos"].at[wg])],
                        bar["q"], wg * 2)
            q_pos, q_path = read_positions(buf["qpos"], wg, window)
            # FA3 ping-pong: warpgroup 1 starts one rendezvous behind warpgroup 0, so each
            # one's wgmmas run while the other one does its softmax.
            pl.when(wg == 1)(rendezvous)

            def block(slot, coords, kind, carry):
                (kv_block,) = coords
                acc, m, l = carry
                plgpu.barrier_wait(bar["kt"].at[slot])
                t = logits_base2(matmul(q_tile, buf["kt"].at[slot], shape), scale, softcap)
                rendezvous()

                p, alpha, m_new, l = online_softmax_block(
                    t, kind, m, l, end_ready=bar["end"].at[slot], end_smem=buf["end"], slot=slot,
                    q_pos=q_pos, q_path=q_path, k_start=kv_block * block_kv, window=window)
                p_tile[...] = p.astype(p_tile.dtype)
                plgpu.commit_smem()  # make the register -> SMEM store visible to wgmma
                rendezvous()
                plgpu.barrier_wait(bar["v"].at[slot])
                pv = matmul(p_tile, buf["v"].at[slot], (WG_ROWS, head_dim))
                return acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv, m_new, l

            init = (jnp.zeros((WG_ROWS, head_dim), jnp.float32),
                    jnp.full((WG_ROWS,), NEG, jnp.float32),
                    jnp.zeros((WG_ROWS,), jnp.float32))
            acc, m, l = consume(n_blocks, entry, block, init, bar["free"], stages)
            pl.when(wg == 0)(rendezvous)
            q_tile[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(q_tile.dtype)
            buf["lse"].at[wg][...] = m + jnp.log2(l)
            store_tiles([(q_tile, o_ref.at[r, queries, head]),
                         (buf["lse"].at[wg], lse_ref.at[r, head, queries])])

    return kernel


def forward_call(
    q: jax.Array,
    k_t: jax.Array,
    v: jax.Array,
    end: jax.Array,
    q_pos: jax.Array,
    table: jax.Array,
    count: jax.Array,
    *,
    block_kv: int,
    stages: int,
    heads_per_cta: int,
    scale: float,
    softcap: float | None,
    interpret: Any,
    window: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """O [rows, Sq, Hq, D] and base-2 LSE [rows, Hq, Sq] of q over k, v [rows, Skv, Hkv, D] under
    the tree mask, query i at key position q_pos[i] ([rows, Sq]).

    `k_t` is k transposed to [rows, Hkv, D, Skv]; `table` holds each q-block's (kv-block, kind) list
    (layout: `mgpu_pipeline.list_entry`) and `count` [rows, nq] its length.
    """
    rows, seq, q_heads, head_dim = q.shape
    group = q_heads // v.shape[2]
    num_q_blocks = table.shape[1]

    kernel = _forward_kernel(group=group, head_dim=head_dim, block_kv=block_kv, stages=stages,
                             heads_per_cta=heads_per_cta, scale=scale, softcap=softcap,
                             window=window)
    buffers = forward_buffers(v.shape[1], head_dim, block_kv, stages, q.dtype, window)
    barriers = dict(
        table=plgpu.Barrier(num_barriers=1),
        q=plgpu.Barrier(num_barriers=CONSUMERS * 2),
        kt=plgpu.Barrier(num_barriers=stages),
        v=plgpu.Barrier(num_barriers=stages),
        end=plgpu.Barrier(num_barriers=stages),
        free=plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
        schedule=plgpu.Barrier(num_arrivals=CONSUMERS),
    )
    out_type = (jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct((rows, q_heads, seq), jnp.float32))
    return launch(kernel, out_type, [buffers, barriers],
                  (num_q_blocks, q_heads // heads_per_cta, rows), ("q", "h", "r"),
                  interpret)(q, k_t, v, end, q_pos, table, count)
