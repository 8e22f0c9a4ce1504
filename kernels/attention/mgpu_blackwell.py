"""Tree attention on Blackwell (sm_100: B200, GB200, B300) as a Pallas Mosaic GPU kernel
(`impl="mosaic_gpu_blackwell"`): tcgen05 MMAs with their accumulators in tensor memory.

The Hopper kernels (`attention.mgpu`) are built on wgmma, which sm_100 does not have (compiled
for it they stop at `'nvvm.wgmma.fence.aligned' op is not supported on sm_100a`). This is the
forward pass rewritten for tcgen05 (`mgpu_blackwell_forward.py`) around the same pieces: the
block lists of `jtree.kernels.block_tables` (EMPTY blocks never fetched nor computed, FULL blocks
without the mask, PARTIAL blocks with the element test), the TMA producer and element mask of
`mgpu_pipeline`, the `end` / `q_pos` stacking, list tiles and base-2 log-sum-exp layout of
`attention.mgpu`, and the sinks of `flash_vjp`.

The backward (`mgpu_blackwell_backward.py`) is the Hopper backward's two kernels rewritten for
tcgen05: dQ over the 128-query blocks' kv lists, dK/dV over the 128-key blocks' transposed q
lists, P recomputed from the forward's base-2 log-sum-exp, through the same custom VJP
(`flash_vjp`, which also carries the sinks' gradient). `auto` picks this kernel on Blackwell
for what it handles (`tree_attention.gpu_impl`).

Head dims (q/k, v): 64 / 64, 128 / 128 and MLA's 192 / 128 (DeepSeek-V3, Kimi-K2: 128 no-RoPE +
64 RoPE dims for q and k, 128 for v). Each kernel sizes its SMEM tiles and TMEM accumulators by
the dim of the operand they hold; at 192 the forward streams 64-key blocks instead of 128
(`forward_block_kv`) so its rings fit.

Limits (each a ValueError): q, k, v all bf16 or all f16, the head dims above, the SMEM of one CTA
(227 KiB) in each kernel. Prefix calls (`q_pos`), GQA, soft-cap, the sliding window and sinks run
as in the Hopper kernel. Sq and Skv must be multiples of 128 (`tree_attention` pads them).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jtree.kernels.attention.flash_vjp import flash_vjp
from jtree.kernels.attention.mgpu import (
    MMA_DTYPES,
    check_operands,
    list_table,
    lse_rows,
    rows_lse,
    softmax_delta,
    stacked_positions,
    stacked_tables,
)
from jtree.kernels.attention.mgpu_blackwell_backward import (
    DKV_BLOCK_KV,
    DKV_BLOCK_Q,
    DQ_BLOCK_KV,
    DQ_BLOCK_Q,
    dkv_buffers,
    dkv_call,
    dq_buffers,
    dq_call,
)
from jtree.kernels.attention.mgpu_blackwell_forward import (
    BLOCK_Q,
    forward_block_kv,
    forward_buffers,
    forward_call,
)
from jtree.kernels.attention.mgpu_pipeline import SMEM_LIMIT, smem_bytes
from jtree.kernels.block_tables import round_up_to_blocks

NAME = "mosaic_gpu_blackwell"
HEAD_DIMS = ((64, 64), (128, 128), (192, 128))  # (q/k, v) head dims the kernels are sized for
# A multiple of every kernel's blocks: the query and key lengths must be multiples of it.
SEQ_MULTIPLE = BLOCK_Q


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything static about one call (hashable: it is a custom_vjp nondiff argument)."""

    scale: float
    softcap: float | None
    stages: int
    window: int | None


def attention_blackwell(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    end: jax.Array,
    *,
    scale: float,
    softcap: float | None = None,
    stages: int = 2,
    q_pos: jax.Array | None = None,
    q_real: jax.Array | None = None,
    window: int | None = None,
    key_pos: jax.Array | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Tree attention of q [rows, Sq, Hq, Dk] over k [rows, Skv, Hkv, Dk], v [rows, Skv, Hkv, Dv]
    on Blackwell, (Dk, Dv) one of `HEAD_DIMS` (see `tree_attention`; Sq = Skv unless `q_pos`
    [rows, Sq] gives the key position of every query).

    `q_real` is not used: every query's output is the mask's (as in `attention.mgpu`: the dQ
    and dK/dV kernels tile the queries differently from the forward, so skipping padding
    q-blocks would let a padding query's backward meet keys its forward never saw).
    `stages` is the depth of the TMA ring; `window` with `key_pos` [rows, Skv] the sliding
    window along the path; `sinks` [Hq] attention sinks.
    """
    del q_real  # see above
    sq, skv, head_dim, value_head_dim = q.shape[1], k.shape[1], q.shape[3], v.shape[3]
    check_operands(q, k, v, NAME, "tcgen05")
    if (head_dim, value_head_dim) not in HEAD_DIMS:
        raise ValueError(f"{NAME}: head dims q/k {head_dim}, v {value_head_dim}: (q/k, v) must be "
                         f"one of {HEAD_DIMS} (the SMEM rings and TMEM columns are sized for "
                         "them)")
    if q_pos is None and sq != skv:
        raise ValueError(f"{NAME}: {sq} queries over {skv} keys need q_pos")
    if sq % SEQ_MULTIPLE or skv % SEQ_MULTIPLE:
        raise ValueError(f"{NAME}: Sq={sq} and Skv={skv} must be multiples of {SEQ_MULTIPLE} "
                         "(tree_attention pads them; call it instead)")
    if stages < 1:
        raise ValueError(f"{NAME}: stages={stages}: need at least one pipeline stage")
    dims = (head_dim, value_head_dim, stages, q.dtype, window)
    for kernel, buffers in (("forward", forward_buffers(skv, *dims)),
                            ("dq", dq_buffers(skv, *dims)), ("dkv", dkv_buffers(sq, *dims))):
        total = sum(smem_bytes(b.shape, b.dtype) for b in buffers.values())
        if total > SMEM_LIMIT:
            raise ValueError(f"{NAME}: the {kernel} kernel needs {total // 1024} KiB of shared "
                             f"memory, more than the {SMEM_LIMIT // 1024} KiB of a CTA; use "
                             "fewer stages")
    static = _Static(float(scale), None if softcap is None else float(softcap), stages, window)
    end, q_pos = stacked_positions(end, q_pos, sq, window, key_pos)
    return _attention(q, k, v, end, q_pos, static, sinks=sinks)


def handles(dtype: Any, head_dim: int, value_head_dim: int | None = None) -> bool:
    """Whether the kernel runs operands of `dtype` with q, k of `head_dim` and v of
    `value_head_dim` (default `head_dim`)."""
    dims = (head_dim, head_dim if value_head_dim is None else value_head_dim)
    return jnp.dtype(dtype) in MMA_DTYPES and dims in HEAD_DIMS


def padded_length(s: int, **_options) -> int:
    """The length `tree_attention` pads S to: a multiple of the kernel's blocks."""
    return round_up_to_blocks(s, SEQ_MULTIPLE, SEQ_MULTIPLE)


def padded_lengths(sq: int, skv: int, **_options) -> tuple[int, int]:
    """(Sq', Skv') `tree_attention` pads a call with a prefix to."""
    return padded_length(sq), padded_length(skv)


def _forward(q, k, v, end, q_pos, st: _Static):
    tables = stacked_tables(end, q_pos, BLOCK_Q, forward_block_kv(q.shape[3]), st.window)
    return forward_call(q, k, v, end, q_pos, list_table(tables.kv_blocks, tables.kv_kind),
                        tables.kv_count, stages=st.stages, scale=st.scale, softcap=st.softcap,
                        window=st.window)


def _backward(st: _Static, q, k, v, end, q_pos, out, lse, d_out):
    d_out = d_out.astype(q.dtype)
    delta = softmax_delta(d_out, out)
    options = {"stages": st.stages, "scale": st.scale, "softcap": st.softcap, "window": st.window}
    kv_lists = stacked_tables(end, q_pos, DQ_BLOCK_Q, DQ_BLOCK_KV, st.window)
    d_q = dq_call(q, d_out, lse, delta, k, v, end, q_pos,
                  list_table(kv_lists.kv_blocks, kv_lists.kv_kind), kv_lists.kv_count, **options)
    q_lists = stacked_tables(end, q_pos, DKV_BLOCK_Q, DKV_BLOCK_KV, st.window)
    d_k, d_v = dkv_call(q, d_out, lse, delta, k, v, end, q_pos,
                        list_table(q_lists.q_blocks, q_lists.q_kind), q_lists.q_count, **options)
    return d_q, d_k, d_v


_attention = flash_vjp(_forward, _backward, 5, lse_rows=lse_rows, rows_lse=rows_lse)
