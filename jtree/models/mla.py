"""Multi-head latent attention (MLA, DeepSeek-V2/V3 and Kimi-K2; HF `DeepseekV3Attention`; and
Kimi-Linear's `KimiLinearAttention`, the same without RoPE) under the tree mask.

Per token x: the query is `q_b_proj(q_a_layernorm(q_a_proj(x)))` (or `q_proj(x)` without a query
bottleneck), split per head into `qk_nope_head_dim` features without position and
`qk_rope_head_dim` features that RoPE rotates. `kv_a_proj_with_mqa(x)` gives a `kv_lora_rank`
latent and one RoPE key of `qk_rope_head_dim` features; the normed latent expands through
`kv_b_proj` into each head's RoPE-free key part and its value (`v_head_dim`). Every head's key is
[its own RoPE-free part | the one shared RoPE part], so q/k heads are `qk_nope_head_dim +
qk_rope_head_dim` wide and value heads `v_head_dim` wide. The softmax scale is that q/k width to
the -1/2, times YaRN's mscale correction (`DeepseekV3Config.softmax_scale`). The two bottleneck
norms use eps 1e-6 whatever `rms_norm_eps` says, as transformers builds them.

RoPE layout. With `rope_interleave` (HF's default, DeepSeek's checkpoints) the RoPE features of q
and k are stored as pairs (x0, x1), (x2, x3), ... each turned by one frequency; transformers'
`apply_rotary_pos_emb_interleave` returns them de-interleaved ([evens turned | odds turned]), the
rotate-half layout of the same pairs. Here the even and odd features are gathered into that
layout first and `jtree.models.layers.apply_rope` turns them, the same numbers as transformers'.
Queries and keys are both permuted alike, so the scores do not depend on the layout.

The tree mask, prefixes and context parallelism are those of `jtree.models.attention`: each token
attends to its ancestors only; the cache of a redundancy-free part holds the expanded keys and
values at their own widths. `jtree.kernels.tree_attention` takes the value width apart from the
q/k width; an implementation that cannot run Dv != Dk raises naming itself (docs/kernels.md).

Tensor parallelism splits the heads: `q_b_proj` (or `q_proj`) and `kv_b_proj` are
column-parallel in whole heads, `o_proj` row-parallel, the bottleneck projections and norms
replicated (each device expands the whole latent into its own heads only).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jtree.config.runtime import RuntimeConfig
from jtree.kernels import TreeMask
from jtree.models.attention import attend
from jtree.models.layers import RMSNorm, apply_rope, linear, row_parallel
from jtree.models.prefix import AttentionCache
from jtree.parallel.context import gathered_keys

# transformers builds the query and latent norms with their default eps, not rms_norm_eps.
BOTTLENECK_NORM_EPS = 1e-6


class MultiHeadLatentAttention(nnx.Module):
    """MLA of one decoder layer (module docstring); `cfg` is a `DeepseekV3Config` or a
    `KimiLinearConfig`. `rope=False` (Kimi-Linear, whose model has no rotary embedding) uses the
    shared key part and the queries' matching features as they are, unrotated."""

    def __init__(self, cfg: Any, runtime: RuntimeConfig, *, rngs: nnx.Rngs, rope: bool = True):
        d, heads = cfg.hidden_size, cfg.num_attention_heads
        kw = dict(init_std=cfg.initializer_range, dtype=runtime.compute_dtype,
                  param_dtype=runtime.weight_dtype, rngs=rngs)

        def norm(dim: int) -> RMSNorm:
            return RMSNorm(dim, eps=BOTTLENECK_NORM_EPS, param_dtype=runtime.weight_dtype)

        q_width = heads * cfg.qk_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = linear(d, q_width, bias=False, **kw)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = nnx.data(None)
        else:
            self.q_proj = nnx.data(None)
            self.q_a_proj = linear(d, cfg.q_lora_rank, bias=cfg.attention_bias, **kw)
            self.q_a_layernorm = norm(cfg.q_lora_rank)
            self.q_b_proj = linear(cfg.q_lora_rank, q_width, bias=False, **kw)
        self.kv_a_proj_with_mqa = linear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                                         bias=cfg.attention_bias, **kw)
        self.kv_a_layernorm = norm(cfg.kv_lora_rank)
        self.kv_b_proj = linear(cfg.kv_lora_rank,
                                heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False, **kw)
        self.o_proj = linear(heads * cfg.v_head_dim, d, bias=cfg.attention_bias, **kw)
        self.cfg, self.runtime, self.rope = cfg, runtime, rope

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: TreeMask,
                 prefix: AttentionCache | None = None) -> tuple[jax.Array, AttentionCache]:
        """Output and this call's keys [rows, S, H, qk_head_dim] and values [rows, S, H,
        v_head_dim]; `prefix` adds cached keys before the own ones."""
        rows, s, _ = x.shape
        cfg = self.cfg
        nope, rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        # Head counts come from the weights: under tensor parallelism they are this device's.
        q = q.reshape(rows, s, -1, cfg.qk_head_dim)
        compressed = self.kv_a_proj_with_mqa(x)
        latent, k_rot = compressed[..., :cfg.kv_lora_rank], compressed[..., cfg.kv_lora_rank:]
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).reshape(rows, s, -1, nope + cfg.v_head_dim)
        k_nope, v = kv[..., :nope], kv[..., nope:]
        k_rot = k_rot[:, :, None, :]
        if self.rope:
            q_rot = q[..., nope:]
            if cfg.rope_interleave:
                q_rot, k_rot = rotate_half_layout(q_rot), rotate_half_layout(k_rot)
            q = jnp.concatenate([q[..., :nope], apply_rope(q_rot, cos, sin)], axis=-1)
            k_rot = apply_rope(k_rot, cos, sin)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rot, (*k_nope.shape[:3], rope))], axis=-1)
        if self.runtime.context_axis is None:
            k_all, v_all = k, v
        else:
            k_all, v_all = gathered_keys(k, v, self.runtime.context_axis)
        out = attend(q, k_all, v_all, mask, prefix, self.runtime, scale=cfg.softmax_scale)
        return (row_parallel(self.o_proj, out.reshape(rows, s, -1),
                             self.runtime.tensor_parallel_axis), AttentionCache(k, v))


def rotate_half_layout(x: jax.Array) -> jax.Array:
    """Interleaved RoPE pairs (x0, x1), (x2, x3), ... on the last axis -> [x0, x2, ... | x1, x3,
    ...], the layout `apply_rope` (rotate-half) turns pair by pair."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
