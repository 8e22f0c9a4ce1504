"""Qwen3-MoE decoder in Flax NNX on tree batches (Hugging Face `Qwen3MoeForCausalLM`).

Attention, norms and RoPE are Qwen3's; the feed-forward of each layer is a sparse MoE block
(`jtree.models.moe`) or, for `mlp_only_layers` / off `decoder_sparse_step`, Qwen3's dense MLP.
Parameter names mirror HF (`model.layers.N.mlp.gate.weight`, `...mlp.experts.gate_up_proj`, ...).
The router load-balancing loss is weighted per token by `path_count` so that it equals the
per-path baseline's (see `jtree.models.moe`). Under tensor parallelism (`tensor_parallel_axis`)
attention and embeddings are split like dense Qwen3's and the MoE blocks are expert parallel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jtree.models.layers import (
    RMSNorm,
    SwiGLU,
    call_layer,
    linear,
    rope_cos_sin,
    vocab_parallel_embed,
)
from jtree.models.moe import (
    RouterStats,
    SparseMoeBlock,
    is_moe_layer,
    load_balancing_loss,
    router_load,
)
from jtree.models.moe_config import Qwen3MoeConfig
from jtree.models.output import ModelOutput
from jtree.batch import DeviceBatch
from jtree.kernels import TreeMask
from jtree.models.prefix import AttentionCache, prefix_inputs
from jtree.models.qwen3 import Qwen3, Qwen3Attention


def feed_forward(cfg: Qwen3MoeConfig, layer: int, shared_intermediate: int | None, *,
                 rngs: nnx.Rngs) -> SparseMoeBlock | SwiGLU:
    """The MoE block or dense MLP of decoder layer `layer`, by HF's rule."""
    kw = dict(init_std=cfg.initializer_range, dtype=cfg.compute_dtype,
              param_dtype=cfg.weight_dtype, rngs=rngs, tp_axis=cfg.tensor_parallel_axis)
    if is_moe_layer(layer, cfg.num_experts, cfg.decoder_sparse_step, cfg.mlp_only_layers):
        return SparseMoeBlock(cfg.hidden_size, num_experts=cfg.num_experts,
                              top_k=cfg.num_experts_per_tok,
                              moe_intermediate=cfg.moe_intermediate_size,
                              norm_topk_prob=cfg.norm_topk_prob,
                              shared_intermediate=shared_intermediate, **kw)
    return SwiGLU(cfg.hidden_size, cfg.intermediate_size, **kw)


def token_embedding(cfg: Qwen3MoeConfig, *, rngs: nnx.Rngs) -> nnx.Embed:
    """HF `embed_tokens` with normal(0, initializer_range) init."""
    return nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.compute_dtype,
                     param_dtype=cfg.weight_dtype,
                     embedding_init=nnx.initializers.normal(cfg.initializer_range), rngs=rngs)


def apply_feed_forward(mlp: nnx.Module, x: jax.Array) -> tuple[jax.Array, RouterStats | None]:
    if isinstance(mlp, SparseMoeBlock):
        return mlp(x)
    return mlp(x), None


def router_aux_loss(cfg: Qwen3MoeConfig, stats: list[RouterStats],
                    inputs: DeviceBatch
                    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    """router_aux_loss_coef * load-balancing loss when `output_router_logits` (as HF), else 0;
    and this forward's `router_load` (None without the aux loss). With `inputs.router_load`
    (counts [E], total []: the load of the larger forward this batch is a piece of), the loss is
    this piece's share of that forward's (`load_balancing_loss`)."""
    if not cfg.output_router_logits or not stats:
        return jnp.zeros((), jnp.float32), None
    aux = cfg.router_aux_loss_coef * load_balancing_loss(
        stats, inputs.path_count, cfg.num_experts, cfg.data_parallel_axis, inputs.router_load)
    return aux, router_load(stats, inputs.path_count, cfg.num_experts)


class Qwen3MoeDecoderLayer(nnx.Module):
    def __init__(self, cfg: Qwen3MoeConfig, layer: int, *, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps,
                                       param_dtype=cfg.weight_dtype)
        self.self_attn = Qwen3Attention(cfg, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps,
                                                param_dtype=cfg.weight_dtype)
        self.mlp = feed_forward(cfg, layer, None, rngs=rngs)

    def __call__(self, x, cos, sin, mask: TreeMask, prefix: AttentionCache | None = None
                 ) -> tuple[jax.Array, RouterStats | None, AttentionCache]:
        h, kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, prefix)
        x = x + h
        y, stats = apply_feed_forward(self.mlp, self.post_attention_layernorm(x))
        return x + y, stats, kv


class Qwen3MoeModel(nnx.Module):
    """Embedding, decoder layers and final norm (HF `Qwen3MoeModel`)."""

    def __init__(self, cfg: Qwen3MoeConfig, *, rngs: nnx.Rngs):
        self.embed_tokens = token_embedding(cfg, rngs=rngs)
        self.layers = nnx.List([Qwen3MoeDecoderLayer(cfg, i, rngs=rngs)
                                for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=cfg.weight_dtype)
        self.cfg = cfg

    def __call__(self, tokens, pos, mask: TreeMask,
                 prefix: tuple[AttentionCache, ...] | None = None
                 ) -> tuple[jax.Array, list[RouterStats], tuple[AttentionCache, ...]]:
        x = vocab_parallel_embed(self.embed_tokens, tokens, self.cfg.tensor_parallel_axis)
        cos, sin = rope_cos_sin(pos, self.cfg.head_dim, self.cfg.rope_theta)
        all_stats, exports = [], []
        for i, layer in enumerate(self.layers):
            x, stats, kv = call_layer(layer, x, cos, sin, mask,
                                      None if prefix is None else prefix[i],
                                      remat=self.cfg.remat)
            exports.append(kv)
            if stats is not None:
                all_stats.append(stats)
        return self.norm(x), all_stats, tuple(exports)


class Qwen3Moe(Qwen3):
    """Qwen3-MoE causal LM (HF `Qwen3MoeForCausalLM`): final hidden states and the weighted router
    aux loss. Reuses Qwen3's output embedding (tied or `lm_head`)."""

    def __init__(self, cfg: Qwen3MoeConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.model = Qwen3MoeModel(cfg, rngs=rngs)
        self.lm_head = None if cfg.tie_word_embeddings else linear(
            cfg.hidden_size, cfg.vocab_size, bias=False, init_std=cfg.initializer_range,
            dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype, rngs=rngs)

    def __call__(self, inputs: DeviceBatch,
                 prefix: tuple[AttentionCache, ...] | None = None) -> ModelOutput:
        mask, _ = prefix_inputs(inputs, prefix)
        hidden, stats, exports = self.model(inputs.tokens, inputs.pos, mask, prefix)
        aux, load = router_aux_loss(self.config, stats, inputs)
        return ModelOutput(hidden, aux, exports, load)
