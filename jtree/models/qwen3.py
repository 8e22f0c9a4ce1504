"""Qwen3 dense decoder in Flax NNX, reading positions and the tree mask from a linearized batch.

Module and parameter names mirror Hugging Face `Qwen3ForCausalLM` (`model.layers.N.self_attn.
q_proj`, ...; NNX `kernel` is HF `weight` transposed), so checkpoints map by name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jtree.models.config import Qwen3Config
from jtree.models.layers import (
    RMSNorm,
    SwiGLU,
    apply_rope,
    call_layer,
    linear,
    local_kv_heads,
    rope_cos_sin,
    row_parallel,
    vocab_parallel_embed,
)
from jtree.models.output import ModelOutput
from jtree.batch import DeviceBatch
from jtree.models.prefix import AttentionCache, prefix_inputs
from jtree.kernels import TreeMask, tree_attention


class Qwen3Attention(nnx.Module):
    """GQA self-attention with per-head q/k RMSNorm before RoPE, under the tree mask."""

    def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs):
        d, hd = cfg.hidden_size, cfg.head_dim
        kw = dict(init_std=cfg.initializer_range, dtype=cfg.compute_dtype,
                  param_dtype=cfg.weight_dtype, rngs=rngs)
        self.q_proj = linear(d, cfg.num_attention_heads * hd, bias=cfg.attention_bias, **kw)
        self.k_proj = linear(d, cfg.num_key_value_heads * hd, bias=cfg.attention_bias, **kw)
        self.v_proj = linear(d, cfg.num_key_value_heads * hd, bias=cfg.attention_bias, **kw)
        self.o_proj = linear(cfg.num_attention_heads * hd, d, bias=cfg.attention_bias, **kw)
        self.q_norm = RMSNorm(hd, eps=cfg.rms_norm_eps, param_dtype=cfg.weight_dtype)
        self.k_norm = RMSNorm(hd, eps=cfg.rms_norm_eps, param_dtype=cfg.weight_dtype)
        self.cfg = cfg

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: TreeMask,
                 prefix: AttentionCache | None = None) -> tuple[jax.Array, AttentionCache]:
        """Output and this call's keys/values; `prefix` adds cached keys before the own ones."""
        rows, s, _ = x.shape
        cfg, tp = self.cfg, self.cfg.tensor_parallel_axis
        # Head counts come from the weights: under tensor parallelism they are this device's.
        q = self.q_norm(self.q_proj(x).reshape(rows, s, -1, cfg.head_dim))
        k = self.k_norm(self.k_proj(x).reshape(rows, s, -1, cfg.head_dim))
        v = self.v_proj(x).reshape(rows, s, -1, cfg.head_dim)
        heads = (q.shape[2], cfg.num_attention_heads, cfg.num_key_value_heads, tp)
        k, v = local_kv_heads(k, *heads), local_kv_heads(v, *heads)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attend(q, k, v, mask, prefix, cfg.attention_impl)
        return row_parallel(self.o_proj, out.reshape(rows, s, -1), tp), AttentionCache(k, v)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: TreeMask,
           prefix: AttentionCache | None, impl: str) -> jax.Array:
    """`tree_attention`, over the cached prefix keys too when there is a prefix."""
    if prefix is None:
        return tree_attention(q, k, v, mask, impl=impl)
    return tree_attention(q, k, v, mask, impl=impl, prefix_k=prefix.k, prefix_v=prefix.v)


class Qwen3DecoderLayer(nnx.Module):
    def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps,
                                       param_dtype=cfg.weight_dtype)
        self.self_attn = Qwen3Attention(cfg, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps,
                                                param_dtype=cfg.weight_dtype)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, init_std=cfg.initializer_range,
                          dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype, rngs=rngs,
                          tp_axis=cfg.tensor_parallel_axis)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: TreeMask,
                 prefix: AttentionCache | None = None) -> tuple[jax.Array, AttentionCache]:
        h, kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, prefix)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class Qwen3Model(nnx.Module):
    """Embedding, decoder layers and final norm (HF `Qwen3Model`)."""

    def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size, cfg.hidden_size, dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype,
            embedding_init=nnx.initializers.normal(cfg.initializer_range), rngs=rngs,
        )
        self.layers = nnx.List([Qwen3DecoderLayer(cfg, rngs=rngs)
                                for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=cfg.weight_dtype)
        self.cfg = cfg

    def __call__(self, tokens: jax.Array, pos: jax.Array, mask: TreeMask,
                 prefix: tuple[AttentionCache, ...] | None = None
                 ) -> tuple[jax.Array, tuple[AttentionCache, ...]]:
        """Final hidden states and every layer's keys/values of these tokens."""
        x = vocab_parallel_embed(self.embed_tokens, tokens, self.cfg.tensor_parallel_axis)
        cos, sin = rope_cos_sin(pos, self.cfg.head_dim, self.cfg.rope_theta)
        exports = []
        for i, layer in enumerate(self.layers):
            x, kv = call_layer(layer, x, cos, sin, mask, None if prefix is None else prefix[i],
                               remat=self.cfg.remat)
            exports.append(kv)
        return self.norm(x), tuple(exports)


class Qwen3(nnx.Module):
    """Qwen3 causal LM (HF `Qwen3ForCausalLM`). Returns final hidden states, not logits.

    Called on the batch inputs (a `jtree.batch.DeviceBatch`). Logits are
    never formed for the whole batch here: `jtree.token_logprobs` combines the hidden states with
    `output_embedding()` only where a token is scored.
    """

    def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs):
        self.config = cfg
        self.model = Qwen3Model(cfg, rngs=rngs)
        self.lm_head = None if cfg.tie_word_embeddings else linear(
            cfg.hidden_size, cfg.vocab_size, bias=False, init_std=cfg.initializer_range,
            dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype, rngs=rngs,
        )

    def __call__(self, inputs: DeviceBatch,
                 prefix: tuple[AttentionCache, ...] | None = None) -> ModelOutput:
        """`prefix`: per-layer keys/values of the tokens above a part (`jtree.models.prefix`)."""
        mask, _ = prefix_inputs(inputs, prefix)
        hidden, exports = self.model(inputs.tokens, inputs.pos, mask, prefix)
        return ModelOutput(hidden, jnp.zeros((), jnp.float32), exports)

    def output_embedding(self) -> jax.Array:
        """[hidden, vocab] matrix mapping final hidden states to logits (this device's vocabulary
        columns under tensor parallelism)."""
        if self.lm_head is None:
            w = self.model.embed_tokens.embedding[...].T
        else:
            w = self.lm_head.kernel[...]
        return w.astype(self.config.compute_dtype)
