"""Building blocks shared by the Qwen3 family, with Hugging Face numerics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
    """x / rms(x) * weight, normalized in float32 and cast back before the scale (as in HF)."""

    def __init__(self, dim: int, *, eps: float, param_dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = x.dtype
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(dtype) * x32.astype(dtype)


def linear(
    din: int, dout: int, *, bias: bool, init_std: float, dtype: jnp.dtype, param_dtype: jnp.dtype,
    rngs: nnx.Rngs,
) -> nnx.Linear:
    """A Linear layer with HF's normal(0, initializer_range) init; kernel is [in, out]."""
    return nnx.Linear(
        din,
        dout,
        use_bias=bias,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=nnx.initializers.normal(init_std),
        bias_init=nnx.initializers.zeros_init(),
        rngs=rngs,
    )


def rope_cos_sin(pos: jax.Array, rotary_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables [..., rotary_dim] for integer positions, in float32 (as HF computes them)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    freqs = pos.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on the first cos.shape[-1] features of x [rows, S, heads, head_dim]."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2 :]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    out = x_rot * cos + rotated * sin
    return jnp.concatenate([out, x_pass], axis=-1) if x_pass.shape[-1] else out


class SwiGLU(nnx.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, *, init_std: float, dtype: jnp.dtype,
                 param_dtype: jnp.dtype, rngs: nnx.Rngs):
        kw = dict(bias=False, init_std=init_std, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate_proj = linear(hidden, intermediate, **kw)
        self.up_proj = linear(hidden, intermediate, **kw)
        self.down_proj = linear(intermediate, hidden, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
