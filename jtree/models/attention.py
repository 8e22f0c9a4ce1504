"""Self-attention under the tree mask, plain (HF `Qwen3Attention`) or gated (HF
`Qwen3NextAttention`), and `attend`, the one call of `jtree.kernels.tree_attention`.

GQA with per-head q/k RMSNorm before RoPE where the architecture has it (Qwen3; not Llama or
Qwen2), RoPE on the first `rotary_dim` features of each head (the width of the cos/sin tables),
biases on q/k/v and on o_proj as the architecture says (`DecoderSpec`). The gated form's q_proj
also emits a per-head output gate ([query, gate] per head) and the output is multiplied by
sigmoid(gate) before o_proj. gpt-oss adds learned per-head sinks (`sinks`, one extra logit per
query head in the softmax) and, on its sliding-attention layers, a key window along the path
(`window`, set on the layer's copy of the mask, whose `positions` the decoder fills in).

Tensor parallelism (`RuntimeConfig.tensor_parallel_axis`) splits query heads (with their sinks):
q_proj is column-parallel (a column split keeps each head's gate with it, so the gate multiplies
only local heads), o_proj row-parallel; kv heads are split like the query heads or, when there
are fewer of them than devices, replicated (`local_kv_heads`).

Context parallelism (`RuntimeConfig.context_axis`): the layer holds one slice of each row; its
keys and values are all-gathered over the axis and its queries run at the slice's offset (the
mask of `jtree.parallel.context.context_mask`, built once per forward). The returned cache holds
the slice's own keys and values.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jtree.config.architectures import DecoderSpec
from jtree.config.runtime import RuntimeConfig
from jtree.kernels import TreeMask, tree_attention
from jtree.kernels.precision import accumulation_dtype
from jtree.models.layers import NORMS, apply_rope, linear, local_kv_heads, row_parallel
from jtree.models.prefix import AttentionCache
from jtree.parallel.context import gathered_keys


class Attention(nnx.Module):
    """GQA self-attention of one decoder layer; `gated` adds Qwen3-Next's output gate, `spec`
    (the architecture's `DecoderSpec`) says whether there is a q/k norm (of kind `spec.norm`,
    `jtree.models.layers.NORMS`) and which projections have biases."""

    def __init__(self, cfg: Any, runtime: RuntimeConfig, spec: DecoderSpec, *, gated: bool,
                 rngs: nnx.Rngs, window: int | None = None):
        d, hd = cfg.hidden_size, cfg.head_dim
        kw = dict(init_std=cfg.initializer_range, dtype=runtime.compute_dtype,
                  param_dtype=runtime.weight_dtype, rngs=rngs)
        self.q_proj = linear(d, cfg.num_attention_heads * hd * (2 if gated else 1),
                             bias=spec.qkv_bias, **kw)
        self.k_proj = linear(d, cfg.num_key_value_heads * hd, bias=spec.qkv_bias, **kw)
        self.v_proj = linear(d, cfg.num_key_value_heads * hd, bias=spec.qkv_bias, **kw)
        self.o_proj = linear(cfg.num_attention_heads * hd, d, bias=spec.o_bias, **kw)

        def qk_norm() -> nnx.Module | None:
            return (NORMS[spec.norm](hd, eps=cfg.rms_norm_eps, param_dtype=runtime.weight_dtype)
                    if spec.qk_norm else None)

        self.q_norm, self.k_norm = nnx.data(qk_norm()), nnx.data(qk_norm())
        # gpt-oss's learned sink logit per query head (HF `sinks`, normal(0, std) init)
        self.sinks = nnx.data(nnx.Param(nnx.initializers.normal(cfg.initializer_range)(
            rngs.params(), (cfg.num_attention_heads,), runtime.weight_dtype))
            if spec.attention_sinks else None)
        self.cfg, self.runtime, self.gated, self.window = cfg, runtime, gated, window

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: TreeMask,
                 prefix: AttentionCache | None = None) -> tuple[jax.Array, AttentionCache]:
        """Output and this call's keys/values; `prefix` adds cached keys before the own ones."""
        rows, s, _ = x.shape
        cfg, tp = self.cfg, self.runtime.tensor_parallel_axis
        # Head counts come from the weights: under tensor parallelism they are this device's.
        q = self.q_proj(x).reshape(rows, s, -1, cfg.head_dim * (2 if self.gated else 1))
        if self.gated:
            q, gate = jnp.split(q, 2, axis=-1)
        k = self.k_proj(x).reshape(rows, s, -1, cfg.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        v = self.v_proj(x).reshape(rows, s, -1, cfg.head_dim)
        heads = (q.shape[2], cfg.num_attention_heads, cfg.num_key_value_heads, tp)
        k, v = local_kv_heads(k, *heads), local_kv_heads(v, *heads)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        sinks = (None if self.sinks is None
                 else self.sinks[...].astype(accumulation_dtype(q.dtype)))
        if self.window is not None:
            mask = dataclasses.replace(mask, window=self.window)
        if self.runtime.context_axis is None:
            out = attend(q, k, v, mask, prefix, self.runtime, sinks)
        else:
            k_row, v_row = gathered_keys(k, v, self.runtime.context_axis)
            out = attend(q, k_row, v_row, mask, prefix, self.runtime, sinks)
        out = out.reshape(rows, s, -1)
        if self.gated:
            out = out * jax.nn.sigmoid(gate.reshape(rows, s, -1))
        return row_parallel(self.o_proj, out, tp), AttentionCache(k, v)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: TreeMask,
           prefix: AttentionCache | None, runtime: RuntimeConfig, sinks: jax.Array | None = None,
           scale: float | None = None) -> jax.Array:
    """`tree_attention` with the runtime's implementation and GPU target, over the cached prefix
    keys too when there is a prefix (whose key ends the mask carries); `sinks` [Hq]: per-head
    attention-sink logits (None: none); `scale`: the softmax scale (None: head_dim ** -0.5)."""
    prefix_kv = {} if prefix is None else {"prefix_k": prefix.k, "prefix_v": prefix.v}
    return tree_attention(q, k, v, mask, impl=runtime.attention_impl, sinks=sinks, scale=scale,
                          compute_capability=runtime.gpu_compute_capability, **prefix_kv)
