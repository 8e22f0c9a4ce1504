"""The Mamba2 (SSD) token mixer on tree batches (HF `NemotronHMamba2Mixer`).

x -> in_proj -> [z (gate) | x B C | dt] -> depthwise causal conv1d (with bias) over (x, B, C) along
each token's path, then SiLU -> per head h (of H, head dim P, state size N, B and C in G groups,
head h reading group h // (H / G)):

    dt_t = max(softplus(dt_t + dt_bias), time_step_min),   a_t = dt_t * A,   A = -exp(A_log)
    S_t = exp(a_t) S_{t-1} + B_t (dt_t x_t)^T    (S [N, P]),   y_t = S_t^T C_t + D x_t

-> gated group RMSNorm (the gate multiplies first, `norm_before_gate=False`: rms over each of the G
groups of y * silu(z), times weight) -> out_proj. transformers clamps dt from below by
`time_step_min` and never from above (its mixer's `time_step_limit` is (time_step_min, inf);
config.json's `time_step_limit` is not read), which is what runs here.

The recurrence is the gated delta rule's chunked machinery without the delta rule (q = C, k = B,
v = dt x, g = dt A, `beta=None` of `jtree.kernels.gdn.delta_rule.tree_gated_delta_rule`): the same
chunk tables route each node's first chunk from its parent's last chunk, by the sequential or the
parallel tree scan (`RuntimeConfig.gdn_scan`), and the conv reads the parent chain (`GdnRouting`,
built once per forward for the Gated DeltaNet and Mamba2 layers alike). Under context parallelism
(`RuntimeConfig.context_axis`) the conv reads the gathered halo and the states cross devices as
composed chunk maps, exactly as the Gated DeltaNet's (`conv_source`, `routed_recurrence`).

With a prefix (a part of a tree below tokens an earlier part computed) the conv reads the
prefix's cached pre-conv activations and the part's subtrees start from the prefix's state, as in
the Gated DeltaNet.

Layout. jtree holds the fused in_proj and the conv grouped by B/C group: in_proj's columns are,
for each of the G groups in turn, [z of its H / G heads | x of its heads | B_g | C_g | dt of its
heads], and the conv's channels [x of its heads | B_g | C_g] per group (HF stores each component
of all heads one after another; `jtree.models.architectures.nemotron_h` permutes on load and back
on save, bit-exact). Heads are ordered as in HF, so dt_bias, A_log, D, the norm weight and
out_proj's rows need no permutation: group g's heads are a contiguous block of each.

Tensor parallelism (`RuntimeConfig.tensor_parallel_axis`) splits the groups, each with its heads:
a contiguous column block of the grouped in_proj is whole groups of every component
(column-parallel), the conv's channels, dt_bias, A_log, D and the gated norm's weight split
alike, the recurrence and the per-group norm need nothing from other devices, and out_proj is
row-parallel (one all-reduce forward, one backward). The mesh's model axis must divide n_groups
(`jtree.parallel.sharding`). Counts are read from the local weights.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jtree.config.runtime import RuntimeConfig
from jtree.kernels.flat_tokens import scale_channels
from jtree.kernels.precision import accumulation_dtype
from jtree.models.gated_deltanet import (
    DepthwiseConv1d,
    GdnRouting,
    conv_source,
    routed_recurrence,
)
from jtree.models.layers import linear, rms_normalized, row_parallel
from jtree.models.prefix import GdnCache


class GroupGatedRMSNorm(nnx.Module):
    """weight * RMSNorm over each group of `group_size` consecutive features of
    (x * silu(gate)), in float32 (HF `NemotronHRMSNormGated`: the gate before the norm). The
    group is given by its size, not the count, so a device holding some of the groups (tensor
    parallel) normalizes its own."""

    def __init__(self, dim: int, group_size: int, *, eps: float, param_dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.group_size, self.eps = group_size, eps

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        dtype, acc = x.dtype, accumulation_dtype(x.dtype)
        h = x.astype(acc) * jax.nn.silu(gate.astype(acc))
        grouped = h.reshape(h.shape[:-1] + (-1, self.group_size))
        h = rms_normalized(grouped, self.eps).reshape(h.shape).astype(dtype)
        return scale_channels(h, self.weight[...].astype(dtype))


class Mamba2(nnx.Module):
    """The Mamba2 layer of Nemotron-H, exact on tree batches. Parameter names are HF's
    (`in_proj`, `conv1d.weight` / `conv1d.bias`, `dt_bias`, `A_log`, `D`, `norm.weight`,
    `out_proj`); in_proj and the conv are held grouped (module docstring)."""

    def __init__(self, cfg: Any, runtime: RuntimeConfig, *, rngs: nnx.Rngs):
        h, p, n, g = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size, cfg.n_groups
        inner, pdt = h * p, runtime.weight_dtype
        conv_dim = inner + 2 * g * n
        kw = {"bias": cfg.use_bias, "init_std": cfg.initializer_range,
              "dtype": runtime.compute_dtype, "param_dtype": pdt, "rngs": rngs}
        self.in_proj = linear(cfg.hidden_size, inner + conv_dim + h, **kw)
        self.conv1d = DepthwiseConv1d(conv_dim, cfg.conv_kernel, init_std=cfg.initializer_range,
                                      param_dtype=pdt, rngs=rngs, bias=cfg.use_conv_bias)
        self.dt_bias = nnx.Param(jnp.ones((h,), pdt))
        self.A_log = nnx.Param(jnp.log(jnp.arange(1, h + 1, dtype=jnp.float32)).astype(pdt))
        self.D = nnx.Param(jnp.ones((h,), pdt))
        self.norm = GroupGatedRMSNorm(inner, inner // g, eps=cfg.layer_norm_epsilon,
                                      param_dtype=pdt)
        self.out_proj = linear(inner, cfg.hidden_size, **kw)
        self.cfg, self.runtime = cfg, runtime

    def __call__(self, x: jax.Array, routing: GdnRouting, prefix: GdnCache | None = None
                 ) -> tuple[jax.Array, GdnCache]:
        """Output, and the pre-conv activations of these tokens with the states after the
        routing's export slots (as `jtree.models.gated_deltanet.GatedDeltaNet` returns them)."""
        cfg = self.cfg
        r, s, _ = x.shape
        p, n = cfg.mamba_head_dim, cfg.ssm_state_size
        per = cfg.mamba_num_heads // cfg.n_groups  # heads per group
        h = self.dt_bias.shape[0]  # this device's heads (all of them without tensor parallelism)
        g = h // per
        # Token-wise work on one flat token axis, as in the Gated DeltaNet (`flat_tokens`).
        proj = self.in_proj(x.reshape(r * s, -1)).reshape(r * s, g, -1)
        gate, pre_conv, dt = jnp.split(proj, [per * p, 2 * per * p + 2 * n], axis=-1)
        pre_conv = pre_conv.reshape(r, s, -1)
        mixed = jax.nn.silu(self.conv1d(pre_conv, routing.conv_context, None, conv_source(
            pre_conv, routing, prefix, self.runtime.context_axis)))
        xs, b, c = jnp.split(mixed.reshape(r * s, g, -1), [per * p, per * p + n], axis=-1)
        acc = accumulation_dtype(x.dtype)
        dt = jnp.maximum(jax.nn.softplus(dt.reshape(r * s, h).astype(acc)
                                         + self.dt_bias[...].astype(acc)), cfg.time_step_min)
        a = -jnp.exp(self.A_log[...].astype(acc))
        xs = xs.astype(acc).reshape(r * s, h, p)
        y, states = routed_recurrence(
            c.reshape(r, s, g, n), b.reshape(r, s, g, n), (xs * dt[..., None]).reshape(r, s, h, p),
            (dt * a).reshape(r, s, h), None, routing, self.runtime, prefix)
        y = y.reshape(r * s, h, p) + self.D[...].astype(acc)[:, None] * xs
        y = self.norm(y.reshape(r * s, h * p), gate.reshape(r * s, h * p)).astype(x.dtype)
        out = row_parallel(self.out_proj, y, self.runtime.tensor_parallel_axis)
        return out.reshape(r, s, -1), GdnCache(pre_conv, states)
