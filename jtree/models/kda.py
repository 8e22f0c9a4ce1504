"""Kimi Delta Attention (KDA), the linear-attention layer of Kimi-Linear (HF
`KimiLinearDeltaAttention`), on tree batches.

Per token x (H heads of d features for q, k and v alike):

    q, k, v = q_proj(x), k_proj(x), v_proj(x) -> depthwise causal conv1d over [q | k | v] along
    each token's path, then SiLU
    g = -exp(A_log[h]) * softplus(f_b_proj(f_a_proj(x)) + dt_bias)     one log decay per key
                                                                         channel: [H, d]
    b = sigmoid(b_proj(x))                                               one per head
    S_t = (I - b_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T,    o_t = S_t^T q_t

with q and k L2-normalised and q scaled by d^-1/2 as in the Gated DeltaNet; then a per-head
RMSNorm of o gated by sigmoid(g_b_proj(g_a_proj(x))) (in float32, `o_norm`) and o_proj. It is
the Gated DeltaNet's recurrence with the scalar decay exp(g_t) of each head replaced by a
diagonal one, still affine in the state, so it runs on the same machinery: the conv reads the
parent chain (`GdnRouting`), the chunk tables route each node's first chunk from its parent's
last, by the sequential or the parallel tree scan, and under context parallelism the states cross
devices as composed chunk maps (`routed_recurrence`, `tree_gated_delta_rule` with g [R, S, H, d]).
A redundancy-free part reads its prefix's conv activations and state as the Gated DeltaNet does.

Tensor parallelism splits heads: q/k/v_proj, b_proj, f_b_proj and g_b_proj are column-parallel
(their columns are whole heads), dt_bias (per channel) and A_log (per head) split alike, o_proj
row-parallel; the low-rank f_a_proj and g_a_proj (and the norm weight, shared by the heads) are
replicated, as is the conv weight, whose rows list the q, k and v channels of all heads
(`local_conv_channels`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jtree.config.runtime import RuntimeConfig
from jtree.kernels.precision import accumulation_dtype
from jtree.models.gated_deltanet import (
    DepthwiseConv1d,
    GdnRouting,
    conv_source,
    local_conv_channels,
    routed_recurrence,
)
from jtree.models.layers import linear, rms_normalized, row_parallel
from jtree.models.prefix import GdnCache


class SigmoidGatedRMSNorm(nnx.Module):
    """RMSNorm(x) * weight * sigmoid(gate) over each head's features, all in float32 and cast
    back at the end (HF `KimiLinearRMSNormGated`: norm before gate)."""

    def __init__(self, dim: int, *, eps: float, param_dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        dtype, acc = x.dtype, accumulation_dtype(x.dtype)
        h = rms_normalized(x.astype(acc), self.eps) * self.weight[...].astype(acc)
        return (h * jax.nn.sigmoid(gate.astype(acc))).astype(dtype)


class ForgetGate(nnx.Module):
    """KDA's per-channel log decay (HF `KimiLinearForgetGate`): a rank-`head_dim` projection to
    every channel of every head, plus `dt_bias` per channel, through softplus, times -exp(A_log)
    of the channel's head. `A_log` is held [H] (HF's [1, 1, H, 1], reshaped by the name table)."""

    def __init__(self, cfg: Any, runtime: RuntimeConfig, *, rngs: nnx.Rngs):
        h, d, pdt = cfg.linear_num_heads, cfg.linear_head_dim, runtime.weight_dtype
        kw = {"bias": False, "init_std": cfg.initializer_range,
              "dtype": runtime.compute_dtype, "param_dtype": pdt, "rngs": rngs}
        self.f_a_proj = linear(cfg.hidden_size, d, **kw)
        self.f_b_proj = linear(d, h * d, **kw)
        # FLA's initialization, as transformers': dt in [1e-3, 1e-1] log-uniform, dt_bias its
        # inverse softplus (held in float32 whatever the run's weight dtype, as transformers
        # keeps it), A in [1, 16].
        dt = jnp.exp(jax.random.uniform(rngs.params(), (h * d,), jnp.float32,
                                        jnp.log(1e-3), jnp.log(1e-1)))
        self.dt_bias = nnx.Param(dt + jnp.log(-jnp.expm1(-dt)))
        a = jax.random.uniform(rngs.params(), (h,), jnp.float32, 1.0, 16.0)
        self.A_log = nnx.Param(jnp.log(a).astype(pdt))
        self.head_dim = d

    def __call__(self, x: jax.Array) -> jax.Array:
        """g [T, h, d] in float32 for tokens x [T, hidden] (h: this device's heads)."""
        f = self.f_b_proj(self.f_a_proj(x))
        acc = accumulation_dtype(f.dtype)
        f = (f.astype(acc) + self.dt_bias[...].astype(acc)).reshape(x.shape[0], -1, self.head_dim)
        return -jnp.exp(self.A_log[...].astype(acc))[:, None] * jax.nn.softplus(f)


class KimiDeltaAttention(nnx.Module):
    """The KDA layer of Kimi-Linear, exact on tree batches (module docstring). Parameter names
    are transformers' in-memory ones (`q_proj`, `conv1d.weight`, `forget_gate.*`, `b_proj`,
    `g_a_proj`, `g_b_proj`, `o_norm`, `o_proj`)."""

    def __init__(self, cfg: Any, runtime: RuntimeConfig, *, rngs: nnx.Rngs):
        h, d, pdt = cfg.linear_num_heads, cfg.linear_head_dim, runtime.weight_dtype
        kw = {"bias": False, "init_std": cfg.initializer_range,
              "dtype": runtime.compute_dtype, "param_dtype": pdt, "rngs": rngs}
        self.q_proj = linear(cfg.hidden_size, h * d, **kw)
        self.k_proj = linear(cfg.hidden_size, h * d, **kw)
        self.v_proj = linear(cfg.hidden_size, h * d, **kw)
        self.conv1d = DepthwiseConv1d(3 * h * d, cfg.linear_conv_kernel_dim,
                                      init_std=cfg.initializer_range, param_dtype=pdt, rngs=rngs)
        self.forget_gate = ForgetGate(cfg, runtime, rngs=rngs)
        self.b_proj = linear(cfg.hidden_size, h, **kw)
        self.g_a_proj = linear(cfg.hidden_size, d, **kw)
        self.g_b_proj = linear(d, h * d, **kw)
        self.o_norm = SigmoidGatedRMSNorm(d, eps=cfg.rms_norm_eps, param_dtype=pdt)
        self.o_proj = linear(h * d, cfg.hidden_size, **kw)
        self.cfg, self.runtime = cfg, runtime

    def __call__(self, x: jax.Array, routing: GdnRouting, prefix: GdnCache | None = None
                 ) -> tuple[jax.Array, GdnCache]:
        """Output, and the pre-conv activations of these tokens with the states after the
        routing's export slots (as `jtree.models.gated_deltanet.GatedDeltaNet` returns them)."""
        cfg, tp = self.cfg, self.runtime.tensor_parallel_axis
        r, s, _ = x.shape
        d = cfg.linear_head_dim
        # Token-wise work on one flat token axis, as in the Gated DeltaNet (`flat_tokens`).
        flat = x.reshape(r * s, -1)
        q, k, v = self.q_proj(flat), self.k_proj(flat), self.v_proj(flat)
        width = q.shape[-1]  # this device's heads x d
        h = width // d
        pre_conv = jnp.concatenate([q, k, v], -1).reshape(r, s, -1)
        full = cfg.linear_num_heads * d
        channels = local_conv_channels(full, full, width, width, tp)
        mixed = jax.nn.silu(self.conv1d(
            pre_conv, routing.conv_context, channels,
            conv_source(pre_conv, routing, prefix, self.runtime.context_axis)))
        q, k, v = (part.reshape(r, s, h, d) for part in jnp.split(mixed, 3, axis=-1))
        g = self.forget_gate(flat).reshape(r, s, h, d)
        beta = jax.nn.sigmoid(self.b_proj(flat)).reshape(r, s, h)
        o, states = routed_recurrence(q, k, v, g, beta, routing, self.runtime, prefix)
        gate = self.g_b_proj(self.g_a_proj(flat)).reshape(r * s, h, d)
        o = self.o_norm(o.reshape(r * s, h, d), gate)
        out = row_parallel(self.o_proj, o.reshape(r * s, h * d), tp)
        return out.reshape(r, s, -1), GdnCache(pre_conv, states)
