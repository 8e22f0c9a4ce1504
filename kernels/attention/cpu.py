"""Block-sparse tree attention for the CPU backend: a multi-threaded C++ kernel (XLA FFI).

Same mask, blocks, schedule and layouts as the `xla` kernel (`jtree.kernels.attention.xla`), but the
per-block work runs in `kernels/cpu/tree_attention.cc` over all cores. XLA:CPU executes a `while`
loop on one thread, so the `xla` kernel's block loop leaves the other cores idle unless XLA finds
independent work to overlap (it does in the backward, never in the forward); this kernel splits
the (q-block, kv-head) items over threads instead. FULL blocks skip the element mask.

The library (`jtree.kernels.cpu.library`) is compiled on first use for this machine and
cached; `build_error` and `build_key` are its. Float32 compute (other dtypes are cast in and
out); no soft-cap. Bitwise repeatable for a given thread count (the backward's dk/dv sums run in
an order fixed by it).

Sliding window: the block tables skip the blocks outside every query's window and PARTIAL blocks
test q_path[i] - k_path[j] < W in the element mask; sinks: `flash_vjp` (the `xla` lse layout).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jtree.kernels.attention.flash_vjp import flash_vjp
from jtree.kernels.attention.xla import (
    _blocks,
    _kv_from_blocks,
    _kv_to_blocks,
    _q_from_blocks,
    _q_to_blocks,
    default_blocks,
    flat_kv_lists,
    lse_rows,
    rows_lse,
)
from jtree.kernels.block_tables import block_tables
from jtree.kernels.cpu import library as cpu_library

# build_error and build_key are this kernel's: tree_attention asks them through this module
from jtree.kernels.cpu.library import build_error, build_key, default_threads  # noqa: F401
from jtree.kernels.flat_tokens import last_axis_dot
from jtree.kernels.varying_axes import varying_like

_FORWARD, _BACKWARD = "jtree_tree_attention_fwd", "jtree_tree_attention_bwd"


@functools.cache
def _register() -> None:
    """Compile (or find) the library and register its two handlers with XLA, once per process."""
    lib = cpu_library.library()
    jax.ffi.register_ffi_target(_FORWARD, jax.ffi.pycapsule(lib.JtreeTreeAttentionForward),
                                platform="cpu")
    jax.ffi.register_ffi_target(_BACKWARD, jax.ffi.pycapsule(lib.JtreeTreeAttentionBackward),
                                platform="cpu")


class _Config(NamedTuple):
    """Static parameters of one call (hashable: a non-differentiable argument)."""

    scale: float
    block_q: int
    block_kv: int
    threads: int
    window: int | None = None


class _Schedule(NamedTuple):
    kv_index: jax.Array  # [rows * nq, L] int32 global kv-block ids
    kv_kind: jax.Array  # [rows * nq, L] int32 (FULL skips the element mask)
    count: jax.Array  # [rows * nq] int32


def tree_attention_cpu(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    end: jax.Array,
    *,
    scale: float,
    softcap: float | None = None,
    block_q: int | None = None,
    block_kv: int | None = None,
    q_pos: jax.Array | None = None,
    q_real: jax.Array | None = None,
    threads: int | None = None,
    window: int | None = None,
    key_pos: jax.Array | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Tree attention of q [rows, Sq, Hq, Dk] over k [rows, Skv, Hkv, Dk], v [rows, Skv, Hkv, Dv]
    (Dv may differ from Dk: MLA); the contract of
    `jtree.kernels.attention.xla.tree_attention_xla` (S a multiple of the blocks, optional
    `q_pos`, `q_real`, `window` with `key_pos`, `sinks`).
    `threads` defaults to the CPUs this process may use."""
    if softcap is not None:
        raise ValueError("attention impl 'cpu': softcap is not supported (use 'xla')")
    sq, skv = q.shape[1], k.shape[1]
    if q_pos is None:
        dq, dk = default_blocks(sq)
        block_q, block_kv = block_q or dq, block_kv or dk
    else:
        block_q, block_kv = _blocks(sq, skv, block_q, block_kv)
    if sq % block_q or skv % block_kv:
        raise ValueError(f"cpu tree attention: Sq={sq} must be a multiple of block_q={block_q} "
                         f"and Skv={skv} of block_kv={block_kv} (tree_attention pads them)")
    _register()
    rows = q.shape[0]
    if q_pos is None:
        q_pos = (np.broadcast_to(np.arange(sq, dtype=np.int32), (rows, sq))
                 if isinstance(end, np.ndarray) else
                 jnp.broadcast_to(jnp.arange(sq, dtype=jnp.int32), (rows, sq)))
    tables = block_tables(end, block_q, block_kv, q_pos=q_pos, q_real=q_real, window=window,
                          key_pos=key_pos)
    lists = flat_kv_lists(tables, skv // block_kv)
    sched = _Schedule(*(jnp.asarray(x, jnp.int32) for x in lists))
    cfg = _Config(float(scale), block_q, block_kv, threads or default_threads(), window)
    q_pos = jnp.asarray(q_pos, jnp.int32)
    if window is None:  # unused by the kernel (window attribute 0)
        k_path, q_path = jnp.zeros((rows, skv), jnp.int32), jnp.zeros((rows, sq), jnp.int32)
    else:
        k_path = jnp.asarray(key_pos, jnp.int32)
        q_path = jnp.take_along_axis(k_path, q_pos, axis=1)
    out = _attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                     jnp.asarray(end, jnp.int32), q_pos, k_path, q_path, sched, cfg,
                     sinks=sinks)
    return out.astype(q.dtype)


def _attrs(cfg: _Config, nk: int) -> dict:
    return {"scale": np.float32(cfg.scale), "nk_row": np.int64(nk),
            "threads": np.int64(cfg.threads), "window": np.int64(cfg.window or 0)}


def _block_inputs(q, k, v, end, q_pos, k_path, q_path, sched: _Schedule, cfg: _Config):
    hkv = k.shape[2]
    return (_q_to_blocks(q, hkv, cfg.block_q), _kv_to_blocks(k, cfg.block_kv),
            _kv_to_blocks(v, cfg.block_kv), end.reshape(-1, cfg.block_kv),
            q_pos.reshape(-1, cfg.block_q), sched.kv_index, sched.kv_kind, sched.count,
            k_path.reshape(-1, cfg.block_kv), q_path.reshape(-1, cfg.block_q))


def _forward(q, k, v, end, q_pos, k_path, q_path, sched: _Schedule, cfg: _Config):
    args = _block_inputs(q, k, v, end, q_pos, k_path, q_path, sched, cfg)
    qb = args[0]
    out_shape = (*qb.shape[:3], v.shape[3])  # the value head dim (MLA: not q's)
    out, lse = jax.ffi.ffi_call(_FORWARD, (jax.ShapeDtypeStruct(out_shape, jnp.float32),
                                           jax.ShapeDtypeStruct(qb.shape[:3], jnp.float32)))(
        *args, **_attrs(cfg, k.shape[1] // cfg.block_kv))
    out, lse = varying_like((out, lse), *args)  # inside shard_map: per-device like the inputs
    return _q_from_blocks(out, q.shape[0], q.shape[2], cfg.block_q), lse


def _backward(cfg, q, k, v, end, q_pos, k_path, q_path, sched, out, lse, d_out):
    rows, _, hq, _ = q.shape
    hkv = k.shape[2]
    args = _block_inputs(q, k, v, end, q_pos, k_path, q_path, sched, cfg)
    delta = last_axis_dot(d_out, out)
    args += (_q_to_blocks(d_out, hkv, cfg.block_q), lse, _q_to_blocks(delta, hkv, cfg.block_q))
    grads = jax.ffi.ffi_call(_BACKWARD, (jax.ShapeDtypeStruct(args[0].shape, jnp.float32),
                                         jax.ShapeDtypeStruct(args[1].shape, jnp.float32),
                                         jax.ShapeDtypeStruct(args[2].shape, jnp.float32)))(
        *args, **_attrs(cfg, k.shape[1] // cfg.block_kv))
    dq, dk, dv = varying_like(grads, *args)
    return (_q_from_blocks(dq, rows, hq, cfg.block_q), _kv_from_blocks(dk, rows),
            _kv_from_blocks(dv, rows))


_attention = flash_vjp(_forward, _backward, 8, lse_rows=lse_rows, rows_lse=rows_lse)
