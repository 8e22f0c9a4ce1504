"""Qwen3-Next (HF `Qwen3NextForCausalLM`): Gated DeltaNet layers interleaved with gated full
attention (partial RoPE), MoE with a gated shared expert, RMSNorms that scale by (1 + weight)
(the config is `jtree.config.architectures.Qwen3NextConfig`): its Hugging Face mapping.

Tensors. Everything is stored as transformers' modules name it; experts as in Qwen3-MoE (one tensor
per expert on the Hub, fused in transformers 5 memory, see `jtree.models.architectures.qwen3_moe`).
The Gated DeltaNet projections `linear_attn.in_proj_qkvz` and `in_proj_ba` are kept by jtree in
HF's own layout, grouped per key head ([q, k, v-group, z-group] and [b-group, a-group] per key
head, see `jtree.models.gated_deltanet`), so they map without a permutation, and a contiguous split
of their output features is a split by key heads. Hub checkpoints also carry the multi-token-
prediction modules (`mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`,
`mtp.layers.0.*` named like a decoder layer, `mtp.norm`): `jtree.hf.load(..., mtp_depth=1)` reads
them into `jtree.models.mtp` (the same name rules map them); without MTP modules they are skipped,
as transformers skips them.

Config. Field names and defaults follow HF's `Qwen3NextConfig`, except that RoPE's `rope_theta` and
`partial_rotary_factor` are flat fields instead of HF's `rope_parameters` dict. transformers 5
nests them in `rope_parameters`; transformers 4 and the Hub configs have them at the top level
(both are read; `save` writes the top level form, read by both). `layer_types` wins over
`full_attention_interval`, as in transformers. Sliding-window keys are accepted and ignored:
transformers' Qwen3-Next has no sliding window.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jtree.config.architectures import Qwen3NextConfig
from jtree.models.architectures import qwen3, qwen3_moe
from jtree.models.hf_config import equals, read_config, rope_settings
from jtree.models.hf_mapping import NNX_TO_TORCH, HfMapping, MtpTensors, TensorRule

# ---------------------------------------------------------------------- Hugging Face mapping

HF_NAME = "Qwen3NextForCausalLM"

# The hybrid's own keys -> default when absent (`HybridFields`; Qwen3.5's defaults are the same).
HYBRID_FIELDS: dict[str, Any] = {
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "full_attention_interval": 4,
    "layer_types": None,  # None: from full_attention_interval
}
# HF key -> default when absent (transformers 5.23's Qwen3NextConfig defaults).
_FIELDS: dict[str, Any] = {
    **qwen3.FIELDS,
    "num_key_value_heads": 2,
    "head_dim": 256,
    **qwen3_moe.MOE_FIELDS,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "norm_topk_prob": True,
    "shared_expert_intermediate_size": 512,
    **HYBRID_FIELDS,
}
_CHECKS = {"hidden_act": equals("silu"), "attention_dropout": equals(0.0)}
_INERT = qwen3.INERT | {"use_sliding_window"}
DEFAULT_PARTIAL_ROTARY = 0.25

# Bare parameters (no `.weight`) of the Gated DeltaNet, stored as they are.
GDN_TENSORS = (TensorRule(r".*\.linear_attn\.(A_log|dt_bias)", r"\g<0>"),)
# The multi-token-prediction modules of Hub checkpoints (`mtp_num_hidden_layers` layers, one on
# the Hub): read when the model has MTP modules (`jtree.models.mtp`, whose parameter names they
# are), skipped otherwise.
MTP = MtpTensors(prefix="mtp.", fc="mtp.fc.weight", layer="mtp.layers.{depth}.")


def config_from_hf(hf: Mapping[str, Any]) -> Qwen3NextConfig:
    values = read_config(hf, HF_NAME, fields=_FIELDS, checks=_CHECKS, inert=_INERT)
    values["rope_theta"], values["partial_rotary_factor"] = rope_settings(
        hf, qwen3.DEFAULT_ROPE_THETA, DEFAULT_PARTIAL_ROTARY)
    return Qwen3NextConfig(**values)


def config_to_hf(cfg: Qwen3NextConfig) -> dict[str, Any]:
    out = {key: getattr(cfg, key) for key in _FIELDS}
    out.update(
        qwen3_moe.moe_values_to_hf(cfg),
        model_type="qwen3_next",
        layer_types=list(cfg.layer_types),
        rope_theta=cfg.rope_theta,
        partial_rotary_factor=cfg.partial_rotary_factor,
        rope_scaling=None,
        hidden_act="silu",
        attention_dropout=0.0,
        use_cache=True,
    )
    return out


HF = HfMapping(
    hf_name=HF_NAME,
    model_type="qwen3_next",
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    tensors=qwen3_moe.EXPERT_TENSORS + GDN_TENSORS + NNX_TO_TORCH,
    tied=qwen3.tied_head,
    mtp=MTP,
)
