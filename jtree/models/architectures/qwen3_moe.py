"""Qwen3-MoE (HF `Qwen3MoeForCausalLM`): Qwen3 with sparse MoE feed-forward layers (a dense
SwiGLU on `mlp_only_layers` and off `decoder_sparse_step`, HF's rule; the config is
`jtree.config.architectures.Qwen3MoeConfig`): its Hugging Face mapping.

Experts. jtree holds each MoE layer's experts stacked, in transformers 5's fused module layout
(`mlp.experts.gate_up_proj` [E, 2 * moe_intermediate, hidden], gate rows first, and
`mlp.experts.down_proj` [E, hidden, moe_intermediate]). Checkpoints on the Hub store one tensor per
expert (`mlp.experts.{e}.gate_proj.weight` [moe_intermediate, hidden], `.up_proj.weight`,
`.down_proj.weight` [hidden, moe_intermediate]); transformers 5.23 converts those to the fused form
when loading and back when saving. `load` accepts both (detected per parameter from the tensor
names); `save` writes the per-expert Hub layout, which transformers 4 and 5, vLLM and the other
tools read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jtree.config.architectures import Qwen3MoeConfig
from jtree.models.architectures import qwen3
from jtree.models.hf_config import read_config, renamed, rope_theta
from jtree.models.hf_mapping import NNX_TO_TORCH, HfMapping, PerExpertRule

# ---------------------------------------------------------------------- Hugging Face mapping

HF_NAME = "Qwen3MoeForCausalLM"

# MoE keys -> default when absent (transformers 5.23's Qwen3MoeConfig defaults).
MOE_FIELDS: dict[str, Any] = {
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": (),
    "router_aux_loss_coef": 0.001,
    "output_router_logits": False,
}
# head_dim None: hidden_size // num_attention_heads, as transformers' Qwen3MoeAttention.
_FIELDS = {**qwen3.FIELDS, "num_key_value_heads": 4, "head_dim": None, **MOE_FIELDS}
# transformers 5 writes `num_experts` under this name (Qwen3MoeConfig.attribute_map).
_ALIASES = {"num_local_experts": "num_experts"}

EXPERT_TENSORS = (
    PerExpertRule(r"(.*)\.experts\.gate_up_proj",
                  (r"\1.experts.{e}.gate_proj.weight", r"\1.experts.{e}.up_proj.weight")),
    PerExpertRule(r"(.*)\.experts\.down_proj", (r"\1.experts.{e}.down_proj.weight",)),
)


def moe_values_to_hf(cfg: Qwen3MoeConfig) -> dict[str, Any]:
    out = {key: getattr(cfg, key) for key in MOE_FIELDS}
    out["mlp_only_layers"] = list(cfg.mlp_only_layers)
    return out


def config_from_hf(hf: Mapping[str, Any]) -> Qwen3MoeConfig:
    hf = renamed(hf, _ALIASES)
    values = read_config(hf, HF_NAME, fields=_FIELDS, checks=qwen3.CHECKS, inert=qwen3.INERT)
    if values["head_dim"] is None:
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    values["rope_theta"] = rope_theta(hf, qwen3.DEFAULT_ROPE_THETA)
    return Qwen3MoeConfig(**values)


def config_to_hf(cfg: Qwen3MoeConfig) -> dict[str, Any]:
    """The dense fields as `qwen3.config_to_hf` writes them, plus the MoE fields (`num_experts`
    under the Hub's name, which transformers 4 and 5 both read)."""
    return {**qwen3.config_to_hf(cfg), "model_type": "qwen3_moe", **moe_values_to_hf(cfg)}


HF = HfMapping(
    hf_name=HF_NAME,
    model_type="qwen3_moe",
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    tensors=EXPERT_TENSORS + NNX_TO_TORCH,
    tied=qwen3.tied_head,
)
