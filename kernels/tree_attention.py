"""Public entry point for attention under the tree mask, with implementation dispatch.

Every implementation reads the same one-int-per-token mask (`end`, see `jtree.linearize`) and
computes softmax(q k^T * scale) v over the keys j with j <= i < end[j]. An implementation that
cannot honour the mask for given inputs raises; nothing falls back to plain causal attention.

Block-sparse implementations need S to be a multiple of their block sizes. The dispatch pads S with
tokens that attend only to themselves (end[j] = j + 1), which no real query can see (j <= i fails),
and drops them from the output, so padding never changes the result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kernels import attention_tpu, attention_xla
from kernels.attention_mgpu import attention_mgpu, handles as mgpu_handles
from kernels.attention_reference import attention_reference


class _Impl(NamedTuple):
    run: Callable[..., jax.Array]  # (q, k, v, end, *, scale, softcap, **options)
    padded_length: Callable[..., int] | None  # (S, **options) -> S' >= S it can run; None: any S


_IMPLS: dict[str, _Impl] = {
    "reference": _Impl(attention_reference, None),
    "xla": _Impl(attention_xla.tree_attention_xla, attention_xla.padded_length),
    "pallas_tpu": _Impl(attention_tpu.tree_attention_tpu, attention_tpu.padded_length),
    "pallas_mosaic_gpu": _Impl(attention_mgpu, None),  # pads S itself
}

# What `auto` runs on each backend. On a GPU the Mosaic kernel needs bf16/f16 operands and head_dim
# 64 or 128; other inputs run the block-sparse `xla` path (the same masked attention, not causal).
_AUTO = {"tpu": "pallas_tpu", "gpu": "pallas_mosaic_gpu", "cpu": "xla"}


def available_impls() -> tuple[str, ...]:
    return ("auto",) + tuple(_IMPLS)


def resolve_impl(impl: str, backend: str | None = None, *, dtype: Any = None,
                 head_dim: int | None = None) -> str:
    """Map `auto` to the implementation for `backend` (default: jax's default backend) and, when
    given, the operand dtype and head_dim."""
    if impl == "auto":
        choice = _AUTO.get(backend or jax.default_backend(), "xla")
        if choice == "pallas_mosaic_gpu" and dtype is not None and not mgpu_handles(dtype, head_dim):
            return "xla"
        return choice
    if impl not in _IMPLS:
        raise ValueError(f"attention impl {impl!r} is not one of {available_impls()}")
    return impl


def tree_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    end: jax.Array,
    *,
    impl: str = "auto",
    scale: float | None = None,
    softcap: float | None = None,
    **options: Any,
) -> jax.Array:
    """Attention of q [rows, S, Hq, D] over k, v [rows, S, Hkv, D] under the tree mask `end`.

    GQA: Hkv must divide Hq; query head h reads kv head h // (Hq // Hkv). `scale` defaults to
    D**-0.5; `softcap` applies cap * tanh(score / cap) before the softmax. `options` go to the
    implementation (e.g. `block_q`, `block_kv` for `xla` and `pallas_tpu`, `interpret` for
    `pallas_tpu`). `end` [rows, S] int32 must satisfy j < end[j] <= S (checked when it is a
    host array).
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [rows, S, heads, head_dim]; got {q.shape}, {k.shape}, {v.shape}")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"shape mismatch: q {q.shape}, k {k.shape}, v {v.shape}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"GQA: kv heads ({k.shape[2]}) must divide q heads ({q.shape[2]})")
    if end.shape != q.shape[:2]:
        raise ValueError(f"end: shape {end.shape} does not match q's [rows, S] {q.shape[:2]}")
    if isinstance(end, np.ndarray):
        _check_end(end)
    if scale is None:
        scale = q.shape[3] ** -0.5
    chosen = _IMPLS[resolve_impl(impl, dtype=q.dtype, head_dim=q.shape[3])]
    s = q.shape[1]
    target = s if chosen.padded_length is None else chosen.padded_length(s, **options)
    if target == s:
        return chosen.run(q, k, v, end, scale=scale, softcap=softcap, **options)
    q, k, v, end = _pad_sequence(q, k, v, end, target)
    out = chosen.run(q, k, v, end, scale=scale, softcap=softcap, **options)
    return out[:, :s]


def _check_end(end: np.ndarray) -> None:
    if not np.issubdtype(end.dtype, np.integer):
        raise ValueError(f"end: dtype {end.dtype} is not an integer type")
    j = np.arange(end.shape[1])
    bad = (end <= j) | (end > end.shape[1])
    if bad.any():
        r, i = map(int, np.argwhere(bad)[0])
        raise ValueError(f"end: row {r}, token {i} has end={int(end[r, i])}; need "
                         f"{i} < end <= S={end.shape[1]} (every token sees itself)")


def _pad_sequence(q, k, v, end, target: int):
    """Pad the sequence axis to `target`; padding tokens attend only to themselves."""
    s = q.shape[1]
    width = ((0, 0), (0, target - s), (0, 0), (0, 0))
    pad_end = jnp.broadcast_to(jnp.arange(s, target, dtype=jnp.int32) + 1, (end.shape[0], target - s))
    end = jnp.concatenate([jnp.asarray(end, jnp.int32), pad_end], axis=1)
    return jnp.pad(q, width), jnp.pad(k, width), jnp.pad(v, width), end
