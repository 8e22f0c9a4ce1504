"""Per-token and per-channel ops computed over one flat token axis, for XLA:CPU on one long row.

A tree row is one long row ([1, S, ..]) where the per-path layout has many short ones
([R, S', ..]). XLA:CPU (jax 0.10.2) runs two kinds of fused reduction far slower when the size-1
row axis is kept:
- the gradient of a per-channel weight w [C] in x * w, x [R, S, C], is a sum over the leading
  axes, which with R = 1 is a sum of [1, S, C] over its middle axis: 40-70x slower than over
  [S, C] (117 ms vs 1.9 ms for [1, 8192, 512]);
- a fused multiply-and-sum of two [1, S, ..] arrays over the last axis (in the backward of a
  normalization, and the row-wise dot of attention's output with its cotangent): about 25x
  slower than over [S, ..] (23 ms vs 0.8 ms for [1, 8192, 256]); a plain sum is not affected.
  Both are XLA:CPU's YNNPACK reduce fusions; `--xla_cpu_experimental_ynn_fusion_type=
  LIBRARY_FUSION_TYPE_DOT` turns those off, but then the sequential GDN scan's small steps run
  slower (the GDN layer step 1.2x), so the code avoids the pattern instead.
Computing over the leading axes flattened into one (or, for a plain row-wise dot, as an einsum)
makes both the fast kind, for every row count; the values are the same.
(`python -m jtree.launch.bench.gdn` shows the effect on a whole layer.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jtree.kernels.precision import accumulation_dtype


def scale_channels(x: jax.Array, weight: jax.Array) -> jax.Array:
    """x [..., *weight.shape] * weight (broadcast over x's leading axes), with the leading axes
    flattened into one so that the weight's gradient is a sum over a single leading axis."""
    channels = x.shape[x.ndim - weight.ndim:]
    if channels != weight.shape:
        raise ValueError(f"weight {weight.shape} must match x's trailing axes; x is {x.shape}")
    return (x.reshape((-1,) + channels) * weight).reshape(x.shape)


def normalized_last_axis(x: jax.Array, eps: float, *, mean: bool) -> jax.Array:
    """x / sqrt(m + eps) in float32 (float64 for float64 x: `accumulation_dtype`), m the mean
    (RMS norm) or the sum (L2 norm) of x^2 over the last axis, computed over the leading axes
    flattened into one."""
    flat = x.astype(accumulation_dtype(x.dtype)).reshape(-1, x.shape[-1])
    reduce = jnp.mean if mean else jnp.sum
    flat = flat * jax.lax.rsqrt(reduce(flat * flat, axis=-1, keepdims=True) + eps)
    return flat.reshape(x.shape)


def last_axis_dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """sum(a * b) over the last axis, in float32 (`accumulation_dtype`): [...] for a, b
    [..., C]. Written as a dot (an einsum), which XLA:CPU does not lower to the slow reduce
    fusion whatever the leading axes; flattening them does not help here (XLA moves the reshape
    out of the fusion again)."""
    if a.shape != b.shape:
        raise ValueError(f"a {a.shape} and b {b.shape} must have the same shape")
    return jnp.einsum("...c,...c->...", a, b, precision=jax.lax.Precision.HIGHEST,
                      preferred_element_type=accumulation_dtype(a.dtype, b.dtype))
