"""The Gated DeltaNet token mixer on tree batches (HF `Qwen3NextGatedDeltaNet`,
`Qwen3_5GatedDeltaNet`).

x -> input projections, in one of two layouts (`DecoderSpec.gdn_projections`) of the same widths:
Qwen3-Next's in_proj_qkvz / in_proj_ba, grouped per key head as HF lays them out ([q, k, v-group,
z-group] and [b-group, a-group] for each key head), or Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b,
in_proj_a, held grouped per key head too: in_proj_qkv as [q, k, v-group] per key head (HF stores
[all q | all k | all v]; the name table permutes it, `jtree.models.architectures.qwen3_5`), the
others are value-head ordered, which is already grouped -> depthwise causal conv1d over (q, k, v)
along each token's path, then SiLU -> gated delta rule with beta = sigmoid(b) and g = -exp(A_log) *
softplus(a + dt_bias), routed over the tree's chunks -> RMSNorm of each head's output gated by
SiLU(z) -> out_proj.

With a prefix (a part of a tree below tokens an earlier part computed, `jtree.models.prefix`), the
conv reads its left context from the prefix's cached pre-conv activations and the part's subtrees
start from the prefix's state (initial slot 1 of the chunk tables; slot 0 stays zeros for other
trees of the row).

Context parallelism (`RuntimeConfig.context_axis`: each device holds a slice of every row,
`jtree.kernels.gdn.context`): the conv reads the left context that lives on earlier devices
through the tables' fixed-capacity halo (`GdnTables.conv_halo`, one all-gather of [c H, channels]
per layer) and the recurrence exchanges only the composed maps of the chunks other devices start
from (`GdnTables.context_exports`), by pointer jumping whatever `RuntimeConfig.gdn_scan` says
(the exchange needs the composed maps). Not combined with a prefix or exported states
(redundancy-free parts).

Tensor parallelism (`RuntimeConfig.tensor_parallel_axis`) splits key heads, each with its value
heads: the grouped input projections (either layout) are column-parallel (a contiguous column block
is whole key-head groups), dt_bias and A_log are split per value head, the recurrence and the gated
norm are per head and need nothing, out_proj is row-parallel (one all-reduce forward, one backward).
The conv weight lists the q, k and v channels of all heads one after another, so it stays replicated
and each device convolves its own heads' channels (`local_conv_channels`); its gradient is
all-reduced (channels x kernel numbers).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jtree.config.architectures import GdnProjections
from jtree.config.runtime import RuntimeConfig
from jtree.kernels.flat_tokens import scale_channels
from jtree.kernels.gdn.context import (
    context_conv_index,
    context_conv_source,
    context_gated_delta_rule,
)
from jtree.kernels.gdn.delta_rule import tree_gated_delta_rule
from jtree.kernels.precision import accumulation_dtype
from jtree.kernels.tree_conv import path_context, tree_causal_conv1d
from jtree.layout.batch import GdnTables
from jtree.models.layers import linear, rms_normalized, row_parallel
from jtree.models.prefix import GdnCache


class GdnRouting(NamedTuple):
    """Per-batch tree layout the GDN layers read (built once per forward by `gdn_routing`)."""

    conv_context: jax.Array  # [R, S, K - 1] previous tokens along each path (see gdn_routing)
    chunk_tokens: jax.Array  # [R, NC, C]
    chunk_src: jax.Array  # [R, NC]
    token_slot: jax.Array  # [R, S]
    export_slots: jax.Array | None  # [R, E] buffer slots whose states later parts start from
    context_exports: jax.Array | None = None  # [R, E'] under context parallelism (GdnTables)
    conv_halo: jax.Array | None = None  # [R, H] under context parallelism (GdnTables)


def gdn_routing(pred: jax.Array, tables: GdnTables, conv_kernel: int,
                prefix_pred: jax.Array | None = None, context_axis: str | None = None
                ) -> GdnRouting:
    """Conv context and chunk tables (`jtree.layout.linearize`'s pred chain and GDN tables). Without a
    prefix the conv context indexes the row's own tokens; with one (its chain `prefix_pred`
    [R, P]) it indexes [K - 1 cached activations before the part | own tokens]; under context
    parallelism over `context_axis` (this device's slice of `pred` and the tables, built by
    `jtree.layout.context_gdn_tables.context_gdn_tables`) it indexes [the slice | the gathered conv halo]."""
    width = conv_kernel - 1
    if context_axis is not None:
        if tables.context_exports is None or tables.conv_halo is None:
            raise ValueError("inputs: 'gdn.context_exports' / 'gdn.conv_halo' missing; gated "
                             "deltanet under context parallelism needs the tables of "
                             "jtree.layout.context_gdn_tables.context_gdn_tables")
        if prefix_pred is not None or tables.export_slots is not None:
            raise ValueError("gated deltanet under context parallelism does not run a "
                             "redundancy-free part (a prefix or exported states)")
        context = context_conv_index(pred, tables.conv_halo, width, context_axis)
    elif prefix_pred is None:
        context = path_context(pred, width)
    else:
        p = prefix_pred.shape[1]
        combined = path_context(jnp.concatenate([prefix_pred, pred], axis=1), width)
        context = combined[:, p:]
        context = jnp.where(context >= 0, context - p + width, -1)
    return GdnRouting(context, tables.chunk_tokens, tables.chunk_src, tables.token_slot,
                      tables.export_slots, tables.context_exports, tables.conv_halo)


def conv_source(pre_conv: jax.Array, routing: GdnRouting, prefix: GdnCache | None,
                context_axis: str | None) -> jax.Array | None:
    """What the path conv reads its left context from (`tree_causal_conv1d`'s `source`): the
    tokens' own pre-conv activations (None), behind a prefix's cached ones, or, under context
    parallelism over `context_axis`, followed by the gathered conv halo. Shared by the Gated
    DeltaNet and Mamba2 layers."""
    if context_axis is not None:
        return context_conv_source(pre_conv, routing.conv_halo, context_axis)
    if prefix is None:
        return None
    return jnp.concatenate([prefix.conv.astype(pre_conv.dtype), pre_conv], axis=1)


def routed_recurrence(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                      beta: jax.Array | None, routing: GdnRouting, runtime: RuntimeConfig,
                      prefix: GdnCache | None = None) -> tuple[jax.Array, jax.Array]:
    """The chunked recurrence (`tree_gated_delta_rule`; `beta=None`: Mamba2's, without the delta
    rule) over the routing's chunk tables: on this device, the subtrees below a prefix starting
    from its state (initial slot 1; slot 0 zeros), or over the context axis
    (`context_gated_delta_rule`). Returns (o [R, S, H, dv], the states after the routing's
    export slots [R, E, H, dk, dv]; none under context parallelism, whose routing has none)."""
    r, h = v.shape[0], v.shape[2]
    tables = {"chunk_tokens": routing.chunk_tokens, "chunk_src": routing.chunk_src,
              "token_slot": routing.token_slot}
    if runtime.context_axis is not None:
        o = context_gated_delta_rule(q, k, v, g, beta, **tables,
                                     context_exports=routing.context_exports,
                                     axis=runtime.context_axis)
        return o, jnp.zeros((r, 0, h, q.shape[-1], v.shape[-1]), jnp.float32)
    initial = None if prefix is None else jnp.stack(
        [jnp.zeros_like(prefix.state), prefix.state], axis=1).astype(accumulation_dtype(v.dtype))
    o, buffer = tree_gated_delta_rule(q, k, v, g, beta, **tables, initial_states=initial,
                                      scan=runtime.gdn_scan)
    slots = jnp.zeros((r, 0), jnp.int32) if routing.export_slots is None else routing.export_slots
    return o, jnp.take_along_axis(buffer, slots[:, :, None, None, None], axis=1)


class GatedRMSNorm(nnx.Module):
    """RMSNorm(x) * weight * SiLU(gate) (HF `Qwen3NextRMSNormGated`; norm before gate)."""

    def __init__(self, dim: int, *, eps: float, param_dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        dtype = x.dtype
        out = scale_channels(rms_normalized(x, self.eps).astype(dtype), self.weight[...])
        return (out * jax.nn.silu(gate.astype(accumulation_dtype(dtype)))).astype(dtype)


class DepthwiseConv1d(nnx.Module):
    """Holds HF's `conv1d.weight` [channels, 1, K] and, with `bias` (Mamba2's `use_conv_bias`),
    `conv1d.bias` [channels] (the Gated DeltaNet's conv has none)."""

    def __init__(self, channels: int, kernel: int, *, init_std: float, param_dtype: jnp.dtype,
                 rngs: nnx.Rngs, bias: bool = False):
        self.weight = nnx.Param(
            nnx.initializers.normal(init_std)(rngs.params(), (channels, 1, kernel), param_dtype))
        self.bias = nnx.data(nnx.Param(jnp.zeros((channels,), param_dtype)) if bias else None)

    def __call__(self, x: jax.Array, context: jax.Array, channels: jax.Array | None = None,
                 source: jax.Array | None = None) -> jax.Array:
        """Convolve x [R, S, D] along the paths; `channels` [D] picks the weight rows x holds
        (all of them by default); `source` holds the context tokens when they are not x's own
        (a cached prefix before them, `tree_causal_conv1d`)."""
        weight = self.weight[...][:, 0, :]
        out = tree_causal_conv1d(x, weight if channels is None else weight[channels], context,
                                 source)
        if self.bias is None:
            return out
        bias = self.bias[...] if channels is None else self.bias[...][channels]
        return out + bias.astype(out.dtype)


def local_conv_channels(key_dim: int, value_dim: int, local_key_dim: int, local_value_dim: int,
                        axis: str | None) -> jax.Array | None:
    """Indices of this device's channels in the conv weight, whose rows are the q, k (key_dim
    each) and v (value_dim) channels of all heads: its contiguous block of each. None (every
    channel) when not tensor parallel."""
    if axis is None or local_key_dim == key_dim:
        return None
    i = jax.lax.axis_index(axis)
    key = i * local_key_dim + jnp.arange(local_key_dim)
    value = 2 * key_dim + i * local_value_dim + jnp.arange(local_value_dim)
    return jnp.concatenate([key, key_dim + key, value])


class GatedDeltaNet(nnx.Module):
    """The linear-attention layer of Qwen3-Next and Qwen3.5, exact on tree batches; `projections`
    is the layout of its input projections (`DecoderSpec.gdn_projections`)."""

    def __init__(self, cfg: Any, runtime: RuntimeConfig, *, rngs: nnx.Rngs,
                 projections: GdnProjections = "qkvz_ba"):
        nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        pdt = runtime.weight_dtype
        kw = dict(bias=False, init_std=cfg.initializer_range, dtype=runtime.compute_dtype,
                  param_dtype=pdt, rngs=rngs)
        if projections == "qkvz_ba":
            self.in_proj_qkvz = linear(cfg.hidden_size, 2 * nk * dk + 2 * nv * dv, **kw)
            self.in_proj_ba = linear(cfg.hidden_size, 2 * nv, **kw)
        else:
            self.in_proj_qkv = linear(cfg.hidden_size, 2 * nk * dk + nv * dv, **kw)
            self.in_proj_z = linear(cfg.hidden_size, nv * dv, **kw)
            self.in_proj_b = linear(cfg.hidden_size, nv, **kw)
            self.in_proj_a = linear(cfg.hidden_size, nv, **kw)
        self.conv1d = DepthwiseConv1d(2 * nk * dk + nv * dv, cfg.linear_conv_kernel_dim,
                                      init_std=cfg.initializer_range, param_dtype=pdt, rngs=rngs)
        self.dt_bias = nnx.Param(jnp.ones((nv,), pdt))
        a = jax.random.uniform(rngs.params(), (nv,), jnp.float32, 0.01, 16.0)
        self.A_log = nnx.Param(jnp.log(a).astype(pdt))
        self.norm = GatedRMSNorm(dv, eps=cfg.rms_norm_eps, param_dtype=pdt)
        self.out_proj = linear(nv * dv, cfg.hidden_size, **kw)
        self.cfg, self.runtime, self.projections = cfg, runtime, projections

    def project(self, flat: jax.Array) -> tuple[jax.Array, ...]:
        """q, k [T, nk, dk], v, z [T, nk, per * dv] (each key head's value heads) and b, a
        [T, nv] of tokens `flat` [T, hidden]; head counts are this device's under tensor
        parallelism (read from the weights)."""
        cfg, t = self.cfg, flat.shape[0]
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        per = cfg.linear_num_value_heads // cfg.linear_num_key_heads
        if self.projections == "qkvz_ba":
            nk = self.in_proj_qkvz.kernel.shape[1] // (2 * dk + 2 * per * dv)
            qkvz = self.in_proj_qkvz(flat).reshape(t, nk, 2 * dk + 2 * per * dv)
            q, k, v, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + per * dv], axis=-1)
            ba = self.in_proj_ba(flat).reshape(t, nk, 2 * per)
            b, a = ba[..., :per].reshape(t, nk * per), ba[..., per:].reshape(t, nk * per)
            return q, k, v, z, b, a
        nk = self.in_proj_qkv.kernel.shape[1] // (2 * dk + per * dv)
        qkv = self.in_proj_qkv(flat).reshape(t, nk, 2 * dk + per * dv)
        q, k, v = jnp.split(qkv, [dk, 2 * dk], axis=-1)
        return (q, k, v, self.in_proj_z(flat).reshape(t, nk, per * dv), self.in_proj_b(flat),
                self.in_proj_a(flat))

    def __call__(self, x: jax.Array, routing: GdnRouting, prefix: GdnCache | None = None
                 ) -> tuple[jax.Array, GdnCache]:
        """Output, and the pre-conv activations of these tokens with the states after the
        routing's export slots (what later parts of a partitioned tree start from)."""
        cfg, tp = self.cfg, self.runtime.tensor_parallel_axis
        r, s, _ = x.shape
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        # Token-wise work runs on the tokens of all rows as one axis ([R * S, ..]): on one long tree
        # row XLA:CPU runs several fused reductions with a leading size-1 axis far slower
        # (`jtree.kernels.flat_tokens`). Only the conv and the recurrence see the rows.
        q, k, v, z, b, a = self.project(x.reshape(r * s, x.shape[-1]))
        nk, nv = q.shape[1], b.shape[1]

        pre_conv = jnp.concatenate([q.reshape(r * s, -1), k.reshape(r * s, -1),
                                    v.reshape(r * s, -1)], -1).reshape(r, s, -1)
        channels = local_conv_channels(cfg.linear_num_key_heads * dk,
                                       cfg.linear_num_value_heads * dv, nk * dk, nv * dv, tp)
        mixed = jax.nn.silu(self.conv1d(
            pre_conv, routing.conv_context, channels,
            conv_source(pre_conv, routing, prefix, self.runtime.context_axis)))
        q, k, v = jnp.split(mixed.reshape(r * s, -1), [nk * dk, 2 * nk * dk], axis=-1)
        beta = jax.nn.sigmoid(b)
        acc = accumulation_dtype(a.dtype)
        g = -jnp.exp(self.A_log[...].astype(acc)) * jax.nn.softplus(
            a.astype(acc) + self.dt_bias[...].astype(acc))
        g, beta = g.reshape(r, s, nv), beta.reshape(r, s, nv)
        q, k, v = q.reshape(r, s, nk, dk), k.reshape(r, s, nk, dk), v.reshape(r, s, nv, dv)
        o, states = routed_recurrence(q, k, v, g, beta, routing, self.runtime, prefix)
        o = self.norm(o.reshape(r * s, nv, dv), z.reshape(r * s, nv, dv))
        out = row_parallel(self.out_proj, o.reshape(r * s, nv * dv), tp)
        return out.reshape(r, s, -1), GdnCache(pre_conv, states)
