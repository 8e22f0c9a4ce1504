"""Tree attention as Triton-language kernels called through jax-triton (`impl="triton_lang"`).

Pallas' Triton backend is deprecated since jax 0.11; this path calls the official Triton bindings
instead: the `@triton.jit` kernels of `jtree.kernels.attention.triton_lang_kernels` (the same
FlashAttention-2 structure and block lists as `pallas_triton`: forward with an online softmax,
deterministic dQ and dK/dV passes recomputing P from the saved log-sum-exp), launched by
`jax_triton.triton_call` inside the custom VJP of `flash_vjp`.

Supported: GQA, Dv != Dk (MLA, DeepSeek-V3's 192/128 included), float32 / bfloat16 / float16
operands with float32 accumulation (float32 matmuls in IEEE float32, not TF32), soft-cap, a
prefix and other rectangular calls (`q_pos`), the sliding window (`window`, `key_pos`) and sinks
(`flash_vjp`), context parallelism (a traced query offset: the same rectangular call, its block
tables built from the traced `q_pos` by `block_tables`, a fixed width per shape).
Inside `shard_map` the kernels' outputs are cast to vary like their inputs (jax-triton types
them as invariant).

Limits (`pallas_triton`'s, checked by the same function, raising ValueError naming
`triton_lang` and the limit): q, k, v one of the three dtypes; each head dim a power of two from
16 to 256, or a multiple of 64 below 256 (DeepSeek-V3's Dk 192) run zero-padded to the next power
of two around the kernels (exact); blocks powers of two >= 16 dividing the lengths; and fewer
than 2^31 elements per operand (the kernels index with int32). Block, warp and stage defaults
are `pallas_triton`'s too (not tuned on hardware).

jax-triton and triton are the optional `gpu` extra: without them the entry point raises naming
the extra. The jax-triton call runs only on a CUDA GPU; on a CPU host it lowers for CUDA (given
`compute_capability`, which otherwise is read from GPU 0: the train step passes
`runtime.gpu_compute_capability`, which `jtree.launch.compile` sets from its target), and the
kernels run in Triton's CPU interpreter (`launch_specs` gives their grids and constants to such a
driver).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jtree.kernels.attention.flash_vjp import flash_vjp
from jtree.kernels.attention.triton import (
    PAD_MULTIPLE,
    check_supported,
    default_blocks,
    lse_rows,
    pad_last,
    rows_lse,
    run_dim,
)
from jtree.kernels.block_tables import block_padding, block_tables
from jtree.kernels.varying_axes import varying_like

padded_length, padded_lengths = block_padding(PAD_MULTIPLE)


class Config(NamedTuple):
    """Everything static about one call (hashable: the custom VJP's nondiff argument)."""

    scale: float
    softcap: float | None
    block_q: int
    block_kv: int
    window: int | None
    num_warps: int
    num_stages: int
    compute_capability: int | None


class LaunchSpec(NamedTuple):
    """One kernel launch: its grid and its `tl.constexpr` arguments."""

    grid: tuple[int, int, int]
    constants: dict[str, Any]


def launch_specs(q_shape: tuple[int, ...], k_shape: tuple[int, ...], dv: int, dtype: Any,
                 cfg: Config, max_kv: int, max_q: int) -> dict[str, LaunchSpec]:
    """The grids and constants of the `forward`, `dq` and `dkv` kernels for q [rows, Sq, Hq, D],
    k [rows, Skv, Hkv, D], v's head dim `dv`, the lists' widths `max_kv` (per q-block) and
    `max_q` (per kv-block)."""
    rows, sq, hq, d = q_shape
    skv, hkv = k_shape[1], k_shape[2]
    common = dict(SQ=sq, SKV=skv, HQ=hq, HKV=hkv, D=d, DV=dv, BLOCK_Q=cfg.block_q,
                  BLOCK_KV=cfg.block_kv, SCALE=cfg.scale, SOFTCAP=cfg.softcap or 0.0,
                  WINDOW=cfg.window or 0,
                  PRECISION="ieee" if jnp.dtype(dtype) == jnp.float32 else "tf32")
    per_q = LaunchSpec((sq // cfg.block_q, rows, hq), {**common, "MAX_KV": max_kv})
    return {"forward": per_q, "dq": per_q,
            "dkv": LaunchSpec((skv // cfg.block_kv, rows, hkv), {**common, "MAX_Q": max_q})}


def _modules():
    """(jax_triton, the kernels module), or ValueError naming the missing extra."""
    try:
        import jax_triton

        from jtree.kernels.attention import triton_lang_kernels
    except ImportError as error:
        raise ValueError("attention impl 'triton_lang' needs jax-triton and triton: pip install "
                         f"'jtree[gpu]' ({error})") from error
    return jax_triton, triton_lang_kernels


def tree_attention_triton_lang(
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
    compute_capability: int | None = None,
    window: int | None = None,
    key_pos: jax.Array | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Tree attention of q [rows, Sq, Hq, Dk] over k [rows, Skv, Hkv, Dk], v [rows, Skv, Hkv, Dv]
    (see `tree_attention`): the `pallas_triton` call's arguments, with `compute_capability`
    (e.g. 80, 90; default: GPU 0's) for lowering from a host without a GPU."""
    rows, sq = q.shape[:2]
    dk, dv = q.shape[3], v.shape[3]
    d = max(run_dim(dk), run_dim(dv))
    defaults = default_blocks(q.dtype, d)
    block_q, block_kv = block_q or defaults[0], block_kv or defaults[1]
    check_supported("triton_lang", q, k, v, block_q, block_kv)
    q, k = pad_last(q, run_dim(dk)), pad_last(k, run_dim(dk))
    v = pad_last(v, run_dim(dv))
    if max(x.size for x in (q, k, v)) >= 2 ** 31:
        raise ValueError("triton_lang: an operand has 2^31 or more elements as the kernels run it "
                         "(they index with int32)")
    _modules()
    cfg = Config(float(scale), None if softcap is None else float(softcap), block_q, block_kv,
                 window, num_warps or (4 if d <= 64 else 8), num_stages, compute_capability)
    tables = block_tables(end, block_q, block_kv, q_pos=q_pos, q_real=q_real, window=window,
                          key_pos=key_pos)
    if q_pos is None:
        q_pos = np.broadcast_to(np.arange(sq, dtype=np.int32), (rows, sq))
    q_pos = jnp.asarray(q_pos, jnp.int32)
    if window is None:  # unread by the kernels (WINDOW = 0), but every launch has the arguments
        paths = (q_pos, jnp.zeros(end.shape, jnp.int32))
    else:
        k_path = jnp.asarray(key_pos, jnp.int32)
        paths = (jnp.take_along_axis(k_path, q_pos, axis=1), k_path)
    lists = tuple(jnp.asarray(x, jnp.int32) for x in (tables.kv_blocks, tables.kv_count,
                                                      tables.q_blocks, tables.q_count))
    out = _attention(q, k, v, jnp.asarray(end, jnp.int32), q_pos, *paths, *lists, cfg,
                     sinks=sinks)
    return out[..., :dv]


def _call(kernel: str, spec: LaunchSpec, cfg: Config, args: tuple, out_shape: list) -> Any:
    """The kernel's outputs, typed (inside `shard_map`) as varying over the axes its inputs vary
    over: jax-triton's outputs carry no such type, and the custom VJP rejects cotangents whose
    type differs from its primal inputs'."""
    jax_triton, kernels = _modules()
    outputs = jax_triton.triton_call(
        *args, kernel=getattr(kernels, f"{kernel}_kernel"), out_shape=out_shape, grid=spec.grid,
        name=f"tree_attention_{kernel}", num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        compute_capability=cfg.compute_capability, **spec.constants)
    return varying_like(outputs, *args)


def _specs(q, k, v, kv_blocks, q_blocks, cfg: Config) -> dict[str, LaunchSpec]:
    return launch_specs(q.shape, k.shape, v.shape[3], q.dtype, cfg, kv_blocks.shape[2],
                        q_blocks.shape[2])


def _forward(q, k, v, end, q_pos, q_path, k_path, kv_blocks, kv_count, q_blocks, q_count,
             cfg: Config):
    """-> out [rows, Sq, Hq, Dv], lse [rows, Hq, Sq] float32."""
    rows, sq, hq, _ = q.shape
    out, lse = _call("forward", _specs(q, k, v, kv_blocks, q_blocks, cfg)["forward"], cfg,
                     (kv_blocks, kv_count, q_pos, q, k, v, end, q_path, k_path),
                     [jax.ShapeDtypeStruct((rows, sq, hq, v.shape[3]), q.dtype),
                      jax.ShapeDtypeStruct((rows, hq, sq), jnp.float32)])
    return out, lse


def _backward(cfg: Config, q, k, v, end, q_pos, q_path, k_path, kv_blocks, kv_count, q_blocks,
              q_count, out, lse, d_out):
    d_out = d_out.astype(q.dtype)
    # delta_i = sum_d dO_id O_id = sum_j P_ij dP_ij: the softmax Jacobian's row term, O(S) memory.
    delta = jnp.einsum("rshd,rshd->rhs", d_out.astype(jnp.float32), out.astype(jnp.float32))
    specs = _specs(q, k, v, kv_blocks, q_blocks, cfg)
    shared = (q_pos, q, k, v, end, q_path, k_path, d_out, lse, delta)
    (dq,) = _call("dq", specs["dq"], cfg, (kv_blocks, kv_count, *shared),
                  [jax.ShapeDtypeStruct(q.shape, q.dtype)])
    dk, dv = _call("dkv", specs["dkv"], cfg, (q_blocks, q_count, *shared),
                   [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)])
    return dq, dk, dv


_attention = flash_vjp(_forward, _backward, 11, lse_rows=lse_rows, rows_lse=rows_lse)

