"""Public entry point for attention under the tree mask, with implementation dispatch.

Every implementation reads the same one-int-per-token mask (`end`, see `jtree.linearize`) and
computes softmax(q k^T * scale) v over the keys j with j <= i < end[j]. An implementation that
cannot honour the mask for given inputs raises; nothing falls back to plain causal attention.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from kernels.attention_mgpu import attention_mgpu
from kernels.attention_reference import attention_reference

_IMPLS: dict[str, Callable[..., jax.Array]] = {"reference": attention_reference}
_IMPLS["pallas_mosaic_gpu"] = attention_mgpu


def available_impls() -> tuple[str, ...]:
    return ("auto",) + tuple(_IMPLS)


def resolve_impl(impl: str) -> str:
    """Map `auto` to the implementation for the default backend."""
    if impl == "auto":
        return "reference"
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
) -> jax.Array:
    """Attention of q [rows, S, Hq, D] over k, v [rows, S, Hkv, D] under the tree mask `end`.

    GQA: Hkv must divide Hq; query head h reads kv head h // (Hq // Hkv). `scale` defaults to
    D**-0.5; `softcap` applies cap * tanh(score / cap) before the softmax.
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [rows, S, heads, head_dim]; got {q.shape}, {k.shape}, {v.shape}")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"shape mismatch: q {q.shape}, k {k.shape}, v {v.shape}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"GQA: kv heads ({k.shape[2]}) must divide q heads ({q.shape[2]})")
    if end.shape != q.shape[:2]:
        raise ValueError(f"end: shape {end.shape} does not match q's [rows, S] {q.shape[:2]}")
    if scale is None:
        scale = q.shape[3] ** -0.5
    return _IMPLS[resolve_impl(impl)](q, k, v, end, scale=scale, softcap=softcap)
