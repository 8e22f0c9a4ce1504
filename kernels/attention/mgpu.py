"""Tree attention as Pallas Mosaic GPU kernels for Hopper (`impl="pallas_mosaic_gpu"`).

FlashAttention-3 structure (warp-specialized CTAs: one TMA producer warpgroup, two wgmma consumer
warpgroups, a multi-stage TMA ring with ready/free barriers) driven by the compacted block lists of
`jtree.kernels.block_tables`: EMPTY blocks are never fetched nor computed, FULL blocks skip the element
mask, PARTIAL blocks apply j <= i < end[j] in-kernel. Forward saves only O and the log-sum-exp;
the backward is a dQ kernel over the kv lists and a dK/dV kernel over the transposed q lists.
See `mgpu_forward.py`, `mgpu_backward.py` and `mgpu_pipeline.py` for the kernels themselves.

Rectangular layouts (a part attending to cached prefix keys): queries at key positions `q_pos`,
read by the element mask and by the block tables, as in `attention.tpu`.

Sliding window (`window` W, `key_pos`): `end` and `q_pos` travel as [rows, 2, S] stacks whose
second row is the path positions (fetched with the same TMA tiles); the element mask adds
q_path[i] - k_path[j] < W and the block tables drop blocks outside every query's window. Sinks:
`flash_vjp`, on the base-2 log-sum-exp converted to natural log.

Inputs must be bf16 or f16 (what wgmma multiplies), head_dim a multiple of 64 (the 128-byte
swizzled SMEM tile) and small enough for the SMEM budget; anything else raises ValueError. The
query and key lengths must be multiples of 128 (`padded_length(s)`: `tree_attention` pads them
with tokens nobody sees).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jtree.kernels.attention.flash_vjp import flash_vjp
from jtree.kernels.attention.mgpu_backward import (
    DKV_BLOCK_KV,
    DKV_BLOCK_Q,
    DQ_BLOCK_KV,
    dkv_buffers,
    dkv_call,
    dq_buffers,
    dq_call,
)
from jtree.kernels.attention.mgpu_forward import forward_buffers, forward_call
from jtree.kernels.attention.mgpu_pipeline import (
    CONSUMERS,
    LIST_CHUNK,
    SMEM_LIMIT,
    WG_ROWS,
    smem_bytes,
)
from jtree.kernels.block_tables import BlockTables, block_tables, round_up_to_blocks

SEQ_MULTIPLE = CONSUMERS * WG_ROWS  # every kernel's block sizes divide this
MMA_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))  # what wgmma / tcgen05 multiply


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything static about one call (hashable: it is a custom_vjp nondiff argument)."""

    scale: float
    softcap: float | None
    block_kv: int
    stages: int
    heads_per_cta: int
    interpret: Any
    window: int | None = None


def attention_mgpu(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    end: jax.Array,
    *,
    scale: float,
    softcap: float | None = None,
    block_kv: int | None = None,
    stages: int = 2,
    interpret: Any = None,
    q_pos: jax.Array | None = None,
    q_real: jax.Array | None = None,
    window: int | None = None,
    key_pos: jax.Array | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Tree attention of q [rows, Sq, Hq, D] over k, v [rows, Skv, Hkv, D] on Hopper (see
    `tree_attention`; Sq = Skv unless `q_pos` [rows, Sq] gives the key position of every query).

    `q_real` is not used: the forward, dQ and dK/dV passes tile the queries differently, so
    skipping non-real q-blocks would let a padding query's backward meet keys its forward never
    saw (exp(s - lse) unbounded, times its zero cotangent: NaN). Every query's output is the
    mask's, which is what skipping would only have made cheaper.

    `block_kv` is the forward kv tile (default 128 for head_dim <= 128, else 64); `stages` the
    depth of the TMA ring. `interpret` is passed to `plgpu.kernel` (an `InterpretGPUParams` runs
    the kernels in the Mosaic GPU interpreter on CPU). `window` with `key_pos` [rows, Skv]: the
    sliding window along the path; `sinks` [Hq]: attention sinks.
    """
    del q_real  # see above
    sq, head_dim = q.shape[1], q.shape[3]
    skv = k.shape[1]
    check_operands(q, k, v)
    if q_pos is None and sq != skv:
        raise ValueError(f"pallas_mosaic_gpu: {sq} queries over {skv} keys need q_pos")
    if sq % SEQ_MULTIPLE or skv % SEQ_MULTIPLE:
        raise ValueError(f"pallas_mosaic_gpu: Sq={sq} and Skv={skv} must be multiples of "
                         f"{SEQ_MULTIPLE} (tree_attention pads them; call it instead)")
    if block_kv is None:
        block_kv = 128 if head_dim <= 128 else 64
    if block_kv % 64 or SEQ_MULTIPLE % block_kv:
        raise ValueError(f"block_kv={block_kv}: must be 64 or 128 (a multiple of the 64-wide "
                         f"swizzled tile dividing {SEQ_MULTIPLE})")
    if stages < 1:
        raise ValueError(f"stages={stages}: need at least one pipeline stage")
    _check_smem("forward", forward_buffers(skv, head_dim, block_kv, stages, q.dtype, window))
    group = q.shape[2] // k.shape[2]
    static = _Static(float(scale), None if softcap is None else float(softcap), block_kv, stages,
                     2 if group % 2 == 0 else 1, interpret, window)
    end, q_pos = stacked_positions(end, q_pos, sq, window, key_pos)
    return _attention(q, k, v, end, q_pos, static, sinks=sinks)


def stacked_positions(end: jax.Array, q_pos: jax.Array | None, sq: int, window: int | None,
                      key_pos: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """(`end`, `q_pos`) as the kernels' TMA tiles read them: int32 [rows, S] (`q_pos` defaults
    to 0..Sq-1), or with a window [rows, 2, S] stacks of the values and the path positions."""
    rows = end.shape[0]
    if q_pos is None:
        q_pos = jnp.broadcast_to(jnp.arange(sq, dtype=jnp.int32), (rows, sq))
    end, q_pos = jnp.asarray(end, jnp.int32), jnp.asarray(q_pos, jnp.int32)
    if window is not None:  # [rows, 2, S]: values, then path positions
        k_path = jnp.asarray(key_pos, jnp.int32)
        end = jnp.stack([end, k_path], axis=1)
        q_pos = jnp.stack([q_pos, jnp.take_along_axis(k_path, q_pos, axis=1)], axis=1)
    return end, q_pos


def padded_length(s: int, **_options) -> int:
    """The length `tree_attention` pads S to: a multiple of every kernel's blocks."""
    return round_up_to_blocks(s, SEQ_MULTIPLE, SEQ_MULTIPLE)


def padded_lengths(sq: int, skv: int, **_options) -> tuple[int, int]:
    """(Sq', Skv') `tree_attention` pads a call with a prefix to."""
    return padded_length(sq), padded_length(skv)


def handles(dtype: Any, head_dim: int) -> bool:
    """Whether forward and backward both run for these operands (what `auto` asks on a GPU):
    wgmma takes bf16/f16, and the backward's shared memory fits for head_dim 64 and 128."""
    return jnp.dtype(dtype) in set(MMA_DTYPES) and head_dim in (64, 128)


def check_operands(q: jax.Array, k: jax.Array, v: jax.Array, impl: str = "pallas_mosaic_gpu",
                   mma: str = "wgmma") -> None:
    """Raise unless q, k, v are all bf16 or all f16 with a head_dim that is a multiple of 64: what
    the tensor-core instruction `mma` (wgmma on Hopper, tcgen05 on Blackwell) of kernel `impl`
    reads from 128-byte swizzled SMEM tiles."""
    dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if len(dtypes) != 1 or not dtypes <= set(MMA_DTYPES):
        raise ValueError(
            f"{impl}: q, k, v must all be bfloat16 or float16 ({mma} operands), got "
            f"{q.dtype}, {k.dtype}, {v.dtype}; cast them or use impl='xla'")
    head_dim = q.shape[-1]
    if head_dim % 64:
        raise ValueError(f"{impl}: head_dim={head_dim} must be a multiple of 64 (the "
                         f"128-byte swizzled SMEM tile {mma} reads)")


def _check_smem(kernel: str, buffers: dict[str, Any]) -> None:
    """Raise if a kernel's SMEM buffers exceed what one Hopper CTA can allocate."""
    total = sum(smem_bytes(b.shape, b.dtype) for b in buffers.values())
    if total > SMEM_LIMIT:
        sizes = ", ".join(f"{name}={smem_bytes(b.shape, b.dtype) // 1024}K"
                          for name, b in buffers.items())
        raise ValueError(
            f"pallas_mosaic_gpu {kernel} kernel needs {total // 1024} KiB of shared memory "
            f"({sizes}), more than the {SMEM_LIMIT // 1024} KiB of a Hopper CTA; use a smaller "
            "head_dim, block_kv or stages")


def list_table(blocks: jax.Array, kinds: jax.Array) -> jax.Array:
    """[rows, n, 2, chunks, LIST_CHUNK] (block, kind) lists, one TMA tile per list (see
    `mgpu_pipeline.list_entry`). Padding repeats the last entry; the kernels stop at the count."""
    table = jnp.stack([blocks, kinds], axis=2)
    pad = -table.shape[-1] % LIST_CHUNK
    table = jnp.pad(table, ((0, 0), (0, 0), (0, 0), (0, pad)), mode="edge")
    return table.reshape(*table.shape[:3], -1, LIST_CHUNK)


def _transposed(x: jax.Array) -> jax.Array:
    """[rows, S, H, D] -> [rows, H, D, S]: the K^T-style operand tiles wgmma reads untransposed."""
    return jnp.transpose(x, (0, 2, 3, 1))


def stacked_tables(end: jax.Array, q_pos: jax.Array, block_q: int, block_kv: int,
                   window: int | None) -> BlockTables:
    """`block_tables` of the (possibly path-stacked, `stacked_positions`) `end` and `q_pos`."""
    if window is None:
        return block_tables(end, block_q, block_kv, q_pos=q_pos)
    return block_tables(end[:, 0], block_q, block_kv, q_pos=q_pos[:, 0], window=window,
                        key_pos=end[:, 1])


def _forward(q, k, v, end, q_pos, st: _Static):
    block_q = SEQ_MULTIPLE // st.heads_per_cta
    tables = stacked_tables(end, q_pos, block_q, st.block_kv, st.window)
    return forward_call(
        q, _transposed(k), v, end, q_pos, list_table(tables.kv_blocks, tables.kv_kind),
        tables.kv_count, block_kv=st.block_kv, stages=st.stages, heads_per_cta=st.heads_per_cta,
        scale=st.scale, softcap=st.softcap, interpret=st.interpret, window=st.window)


def _backward(st: _Static, q, k, v, end, q_pos, out, lse, d_out):
    sq, skv, head_dim = q.shape[1], k.shape[1], q.shape[3]
    _check_smem("dq", dq_buffers(skv, head_dim, st.stages, q.dtype, st.window))
    _check_smem("dkv", dkv_buffers(sq, head_dim, st.stages, q.dtype, st.window))
    d_out = d_out.astype(q.dtype)
    delta = softmax_delta(d_out, out)
    block_q = SEQ_MULTIPLE // st.heads_per_cta
    kv_lists = stacked_tables(end, q_pos, block_q, DQ_BLOCK_KV, st.window)
    d_q = dq_call(
        q, d_out, lse, delta, _transposed(k), _transposed(v), k, end, q_pos,
        list_table(kv_lists.kv_blocks, kv_lists.kv_kind), kv_lists.kv_count,
        stages=st.stages, heads_per_cta=st.heads_per_cta, scale=st.scale, softcap=st.softcap,
        interpret=st.interpret, window=st.window)
    q_lists = stacked_tables(end, q_pos, DKV_BLOCK_Q, DKV_BLOCK_KV, st.window)
    d_k, d_v = dkv_call(
        _transposed(q), _transposed(d_out), q, d_out, lse, delta, k, v, end, q_pos,
        list_table(q_lists.q_blocks, q_lists.q_kind), q_lists.q_count,
        stages=st.stages, scale=st.scale, softcap=st.softcap, interpret=st.interpret,
        window=st.window)
    return d_q, d_k, d_v


def softmax_delta(d_out: jax.Array, out: jax.Array) -> jax.Array:
    """delta [rows, Hq, Sq], delta_i = sum_d dO_id O_id = sum_j P_ij dP_ij: the softmax
    Jacobian's row term every backward kernel subtracts from dP, in O(S) memory."""
    return jnp.einsum("rshd,rshd->rhs", d_out.astype(jnp.float32), out.astype(jnp.float32))


_LN2 = 0.6931471805599453


def lse_rows(lse: jax.Array, st: Any, q: jax.Array) -> jax.Array:
    """The kernels' base-2 lse [rows, Hq, Sq] as a natural-log [rows, Sq, Hq] (`flash_vjp`)."""
    return lse.transpose(0, 2, 1) * _LN2


def rows_lse(x: jax.Array, st: Any, q: jax.Array, lse: jax.Array) -> jax.Array:
    """The inverse of `lse_rows`."""
    return x.transpose(0, 2, 1) * (1.0 / _LN2)


_attention = flash_vjp(_forward, _backward, 5, lse_rows=lse_rows, rows_lse=rows_lse)
