"""Qwen3-Next hybrid decoder in Flax NNX on tree batches (Hugging Face `Qwen3NextForCausalLM`).

Layers follow `config.layer_types`: Gated DeltaNet (`linear_attn`, `jtree.models.gated_deltanet`)
or gated full attention (`self_attn`: q_proj also emits a per-head output gate, q/k RMSNorm, RoPE on
the first `partial_rotary_factor` of each head, output * sigmoid(gate) before o_proj). The
feed-forward is a sparse MoE block with a gated shared expert (or a dense MLP per HF's rule).
Qwen3-Next's RMSNorms scale by (1 + weight) with zero-initialized weights. Parameter names mirror
HF (`model.layers.N.linear_attn.in_proj_qkvz`, `...self_attn.q_proj`, `...mlp.shared_expert_gate`).

Tensor parallelism (`tensor_parallel_axis`): gated attention splits query heads like dense Qwen3
(q_proj's columns are [query, gate] per head, so a column split keeps each head's gate with it and
the gate multiplies only local heads), Gated DeltaNet splits key heads with their value heads
(`jtree.models.gated_deltanet`), MoE blocks are expert parallel, embeddings vocab parallel.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from flax import nnx

from jtree.models.gated_deltanet import GatedDeltaNet, GdnRouting, gdn_routing
from jtree.models.layers import (
    apply_rope, call_layer, linear, local_kv_heads, rope_cos_sin, row_parallel, vocab_parallel_embed,
)
from jtree.models.moe import RouterStats
from jtree.models.moe_config import Qwen3NextConfig
from jtree.models.output import ModelOutput
from jtree.batch import DeviceBatch
from jtree.kernels import TreeMask
from jtree.models.prefix import AttentionCache, LayerCache, prefix_inputs
from jtree.models.qwen3 import Qwen3, attend
from jtree.models.qwen3_moe import (
    apply_feed_forward,
    feed_forward,
    router_aux_loss,
    token_embedding,
)


class OffsetRMSNorm(nnx.Module):
    """x / rms(x) * (1 + weight) in float32, cast back after the scale (HF `Qwen3NextRMSNorm`)."""

    def __init__(self, dim: int, *, eps: float, param_dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.zeros((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


class Qwen3NextAttention(nnx.Module):
    """Gated GQA attention under the tree mask."""

    def __init__(self, cfg: Qwen3NextConfig, *, rngs: nnx.Rngs):
        d, hd = cfg.hidden_size, cfg.head_dim
        kw = dict(bias=cfg.attention_bias, init_std=cfg.initializer_range, dtype=cfg.compute_dtype,
                  param_dtype=cfg.weight_dtype, rngs=rngs)
        self.q_proj = linear(d, cfg.num_attention_heads * hd * 2, **kw)
        self.k_proj = linear(d, cfg.num_key_value_heads * hd, **kw)
        self.v_proj = linear(d, cfg.num_key_value_heads * hd, **kw)
        self.o_proj = linear(cfg.num_attention_heads * hd, d, **kw)
        self.q_norm = OffsetRMSNorm(hd, eps=cfg.rms_norm_eps, param_dtype=cfg.weight_dtype)
        self.k_norm = OffsetRMSNorm(hd, eps=cfg.rms_norm_eps, param_dtype=cfg.weight_dtype)
        self.cfg = cfg

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: TreeMask,
                 prefix: AttentionCache | None = None) -> tuple[jax.Array, AttentionCache]:
        rows, s, _ = x.shape
        cfg, tp = self.cfg, self.cfg.tensor_parallel_axis
        # Head counts come from the weights: under tensor parallelism they are this device's.
        q, gate = jnp.split(self.q_proj(x).reshape(rows, s, -1, 2 * cfg.head_dim), 2, axis=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).reshape(rows, s, -1, cfg.head_dim))
        v = self.v_proj(x).reshape(rows, s, -1, cfg.head_dim)
        heads = (q.shape[2], cfg.num_attention_heads, cfg.num_key_value_heads, tp)
        k, v = local_kv_heads(k, *heads), local_kv_heads(v, *heads)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attend(q, k, v, mask, prefix, cfg.attention_impl).reshape(rows, s, -1)
        out = row_parallel(self.o_proj, out * jax.nn.sigmoid(gate.reshape(rows, s, -1)), tp)
        return out, AttentionCache(k, v)


class Qwen3NextDecoderLayer(nnx.Module):
    def __init__(self, cfg: Qwen3NextConfig, layer: int, *, rngs: nnx.Rngs):
        self.layer_type = cfg.layer_types[layer]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, rngs=rngs)
        else:
            self.self_attn = Qwen3NextAttention(cfg, rngs=rngs)
        self.mlp = feed_forward(cfg, layer, cfg.shared_expert_intermediate_size, rngs=rngs)
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps,
                                             param_dtype=cfg.weight_dtype)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps,
                                                      param_dtype=cfg.weight_dtype)

    def __call__(self, x, cos, sin, mask: TreeMask, routing: GdnRouting | None,
                 prefix: LayerCache | None = None):
        h = self.input_layernorm(x)
        if self.layer_type == "linear_attention":
            h, cache = self.linear_attn(h, routing, prefix)
        else:
            h, cache = self.self_attn(h, cos, sin, mask, prefix)
        x = x + h
        y, stats = apply_feed_forward(self.mlp, self.post_attention_layernorm(x))
        return x + y, stats, cache


class Qwen3NextModel(nnx.Module):
    """Embedding, hybrid decoder layers and final norm (HF `Qwen3NextModel`)."""

    def __init__(self, cfg: Qwen3NextConfig, *, rngs: nnx.Rngs):
        self.embed_tokens = token_embedding(cfg, rngs=rngs)
        self.layers = nnx.List([Qwen3NextDecoderLayer(cfg, i, rngs=rngs)
                                for i in range(cfg.num_hidden_layers)])
        self.norm = OffsetRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=cfg.weight_dtype)
        self.cfg = cfg

    def __call__(self, inputs: DeviceBatch,
                 prefix: tuple[LayerCache, ...] | None = None
                 ) -> tuple[jax.Array, list[RouterStats], tuple[LayerCache, ...]]:
        cfg = self.cfg
        mask, prefix_pred = prefix_inputs(inputs, prefix)
        x = vocab_parallel_embed(self.embed_tokens, inputs.tokens, cfg.tensor_parallel_axis)
        cos, sin = rope_cos_sin(inputs.pos, cfg.rotary_dim, cfg.rope_theta)
        routing = (gdn_routing(inputs, cfg.linear_conv_kernel_dim, prefix_pred)
                   if "linear_attention" in cfg.layer_types else None)
        all_stats, exports = [], []
        for i, layer in enumerate(self.layers):
            x, stats, cache = call_layer(layer, x, cos, sin, mask, routing,
                                         None if prefix is None else prefix[i], remat=cfg.remat)
            exports.append(cache)
            if stats is not None:
                all_stats.append(stats)
        return self.norm(x), all_stats, tuple(exports)


class Qwen3Next(Qwen3):
    """Qwen3-Next causal LM: final hidden states and the weighted router aux loss."""

    def __init__(self, cfg: Qwen3NextConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.model = Qwen3NextModel(cfg, rngs=rngs)
        self.lm_head = None if cfg.tie_word_embeddings else linear(
            cfg.hidden_size, cfg.vocab_size, bias=False, init_std=cfg.initializer_range,
            dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype, rngs=rngs)

    def __call__(self, inputs: DeviceBatch,
                 prefix: tuple[LayerCache, ...] | None = None) -> ModelOutput:
        """`prefix`: per-layer caches of the tokens above a part (`jtree.models.prefix`)."""
        hidden, stats, exports = self.model(inputs, prefix)
        aux, load = router_aux_loss(self.config, stats, inputs)
        return ModelOutput(hidden, aux, exports, load)
