"""Qwen3.5-MoE (HF `Qwen3_5MoeForCausalLM`, text config `Qwen3_5MoeTextConfig`; the jtree config
is `jtree.config.architectures.Qwen3_5MoeConfig`): Qwen3.5 (`jtree.models.architectures.qwen3_5`:
separate GDN projections, mrope reduced to 1-D RoPE, the accepted Hub keys) with Qwen3-Next's MoE
block with a gated shared expert in every layer. Experts are stored as in Qwen3-MoE (one tensor
per expert on the Hub, fused in transformers 5's memory; `jtree.models.architectures.qwen3_moe`).

HF's config has no `intermediate_size`, `norm_topk_prob`, `decoder_sparse_step` or
`mlp_only_layers`: every layer is sparse and the router always renormalizes its top-k weights,
which the jtree config's fixed values say (`Qwen3_5MoeConfig`); an empty `mlp_only_layers` (as
released configs carry) is accepted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jtree.config.architectures import Qwen3_5MoeConfig
from jtree.models.architectures import qwen3, qwen3_5, qwen3_moe, qwen3_next
from jtree.models.hf_mapping import NNX_TO_TORCH, HfMapping

# ---------------------------------------------------------------------- Hugging Face mapping

HF_NAME = "Qwen3_5MoeForCausalLM"

# HF key -> default when absent (transformers 5.24's Qwen3_5MoeTextConfig defaults).
FIELDS: dict[str, Any] = {
    **{key: default for key, default in qwen3_5.FIELDS.items() if key != "intermediate_size"},
    "num_key_value_heads": 2,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "router_aux_loss_coef": 0.001,
    "output_router_logits": False,
}


def config_from_hf(hf: Mapping[str, Any]) -> Qwen3_5MoeConfig:
    return Qwen3_5MoeConfig(**qwen3_5.config_values(hf, HF_NAME, FIELDS))


def config_to_hf(cfg: Qwen3_5MoeConfig) -> dict[str, Any]:
    return qwen3_5.hybrid_values_to_hf(cfg, FIELDS, "qwen3_5_moe_text")


HF = HfMapping(
    hf_name=HF_NAME,
    model_type="qwen3_5_moe_text",
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    tensors=qwen3_moe.EXPERT_TENSORS + qwen3_5.GDN_TENSORS + NNX_TO_TORCH,
    tied=qwen3.tied_head,
    mtp=qwen3_next.MTP,
)
