"""DeepSeek-V3 (HF `DeepseekV3ForCausalLM`, model_type `deepseek_v3`; Kimi-K2 is the same
architecture; the config and layer choice are `jtree.config.architectures.DeepseekV3Config`): its
Hugging Face config.json mapping and tensor names.

Tensors keep HF's names (`NNX_TO_TORCH`): MLA's `self_attn.q_a_proj`, `q_a_layernorm`,
`q_b_proj` (or `q_proj`), `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`; the
router's `mlp.gate.weight` and `mlp.gate.e_score_correction_bias`; the routed experts in
transformers 5's fused layout or the Hub's per-expert tensors (`qwen3_moe.EXPERT_TENSORS`). The
shared experts are HF's `mlp.shared_experts.*` (jtree's MoE block calls its shared SwiGLU
`shared_expert`).

Multi-token prediction. The Hub's checkpoints carry their MTP module as one more decoder layer,
`model.layers.{num_hidden_layers}.*` (61 for DeepSeek-V3 and Kimi-K2; `num_nextn_predict_layers`
is 1): `enorm` (the embedding's norm), `hnorm` (the hidden state's), `eh_proj` (input
[enorm(emb); hnorm(h)], the embedding first), the layer's own attention, MoE and norms,
`shared_head.norm` (the output norm), and `embed_tokens` and `shared_head.head`, copies of the
main embedding and head. These are jtree's MTP modules (`jtree.models.mtp`) under other names:
`pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `fc`, `layers.0`, `norm`, with the main model's
embedding and head. `jtree.hf.load(..., mtp_depth=1)` reads them (the two copies must equal
their sources) and `save` writes them back with the copies and `num_mtp_layers: 1`; without MTP
modules the layer is skipped, as transformers skips it, and `save` writes `num_mtp_layers: 0`.
Only depth 1 maps: each further DeepSeek depth has its own `eh_proj` and norms, while jtree's
depths share one fc and its norms.

Config. `n_routed_experts` is jtree's `num_experts`. RoPE is plain or YaRN (read as for gpt-oss,
`mscale` / `mscale_all_dim` included). A `q_lora_rank` of null means one `q_proj` (no query
bottleneck). transformers' derived `head_dim` (= qk_rope_head_dim) and `qk_head_dim` are checked.
The original remote-code config keys (`topk_method`, `scoring_func`, `quantization_config` of the
FP8 checkpoints, ...) are refused by name, like every key jtree does not implement.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jtree.config.architectures import DeepseekV3Config
from jtree.models.architectures import qwen3
from jtree.models.architectures.gpt_oss import ROPE_TYPES, yarn_scaling, yarn_to_hf
from jtree.models.architectures.qwen3_moe import EXPERT_TENSORS
from jtree.models.hf_config import ROPE_KEYS, equals, read_config, renamed, rope_config, whole_head
from jtree.models.hf_mapping import (
    NNX_TO_TORCH,
    TRANSPOSED,
    HfMapping,
    MtpTensors,
    StoredAs,
    TensorRule,
)

HF_NAME = "DeepseekV3ForCausalLM"

# HF key (as jtree names it) -> default when absent (transformers 5.24's DeepseekV3Config).
FIELDS: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": None,  # None: num_attention_heads
    "n_shared_experts": 1,
    "num_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "max_position_embeddings": 4096,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_interleave": True,
    "attention_bias": False,
}
DEFAULT_ROPE_THETA = 10000.0
_ALIASES = {"n_routed_experts": "num_experts", "num_local_experts": "num_experts",
            "num_nextn_predict_layers": "num_mtp_layers"}


def _derived(name: str, value_of: Any) -> Any:
    """A check that transformers' derived field `name` agrees with the fields it comes from."""

    def check(value: Any, hf: Mapping[str, Any]) -> str | None:
        want = value_of(hf)
        return None if value is None or value == want else f"must equal {want}"

    return check


def _rope_dim(hf: Mapping[str, Any]) -> int:
    return hf.get("qk_rope_head_dim") or FIELDS["qk_rope_head_dim"]


def _qk_dim(hf: Mapping[str, Any]) -> int:
    return _rope_dim(hf) + (hf.get("qk_nope_head_dim") or FIELDS["qk_nope_head_dim"])


CHECKS = {
    "hidden_act": equals("silu"),
    "attention_dropout": equals(0.0),
    "pretraining_tp": equals(1),
    "head_dim": _derived("head_dim", _rope_dim),
    "qk_head_dim": _derived("qk_head_dim", _qk_dim),
}
# `output_router_logits` only returns the router logits in transformers (no loss is added);
# the MTP layers are not part of the causal LM (module docstring; `save` writes their count).
INERT = frozenset({"output_router_logits", "num_mtp_layers"}) | ROPE_KEYS


def config_from_hf(hf: Mapping[str, Any]) -> DeepseekV3Config:
    hf = renamed(hf, _ALIASES)
    values = read_config(hf, HF_NAME, fields=FIELDS, checks=CHECKS, inert=INERT)
    if "q_lora_rank" in hf and hf["q_lora_rank"] is None:
        values["q_lora_rank"] = None  # null here means no query bottleneck, not the default
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    theta, partial, rope_type, params = rope_config(hf, DEFAULT_ROPE_THETA, 1.0, ROPE_TYPES)
    whole_head(partial)
    values["rope_theta"] = theta
    if rope_type == "yarn":
        values["rope_scaling"] = yarn_scaling(params)
    return DeepseekV3Config(**values)


def config_to_hf(cfg: DeepseekV3Config) -> dict[str, Any]:
    """config.json fields in transformers' form (top-level `rope_theta`, `rope_scaling` with its
    `rope_type`, `n_routed_experts`); `num_mtp_layers` 0, the causal LM's (`save` writes the
    saved model's MTP depth)."""
    out = {key: getattr(cfg, key) for key in FIELDS}
    out["n_routed_experts"] = out.pop("num_experts")
    scaling = cfg.rope_scaling
    out.update(
        model_type="deepseek_v3",
        rope_theta=cfg.rope_theta,
        rope_scaling=None if scaling is None else yarn_to_hf(scaling),
        hidden_act="silu",
        attention_dropout=0.0,
        pretraining_tp=1,
        num_mtp_layers=0,
        use_cache=True,
    )
    return out


# The Hub's MTP layer (module docstring): jtree's MTP parameters stored as the decoder layer
# after the last one, its extra tensors named as DeepSeek names them.
MTP_LAYER = "model.layers.{num_hidden_layers}."
MTP_TENSORS = (
    StoredAs(r"mtp\.pre_fc_norm_embedding\.(\w+)", MTP_LAYER + r"enorm.\1"),
    StoredAs(r"mtp\.pre_fc_norm_hidden\.(\w+)", MTP_LAYER + r"hnorm.\1"),
    StoredAs(r"mtp\.fc\.(\w+)", MTP_LAYER + r"eh_proj.\1"),
    StoredAs(r"mtp\.norm\.(\w+)", MTP_LAYER + r"shared_head.norm.\1"),
    StoredAs(r"mtp\.layers\.0\.(.*)", MTP_LAYER + r"\1"),
)
MTP = MtpTensors(
    prefix=MTP_LAYER, fc=MTP_LAYER + "eh_proj.weight", layer=MTP_LAYER, max_depth=1,
    copies={MTP_LAYER + "embed_tokens.weight": "model.embed_tokens.weight",
            MTP_LAYER + "shared_head.head.weight": "lm_head.weight"},
    count_key="num_mtp_layers")

TENSORS = MTP_TENSORS + (
    TensorRule(r"(.*)\.mlp\.shared_expert\.(\w+)\.kernel", r"\1.mlp.shared_experts.\2.weight",
               TRANSPOSED),
    TensorRule(r".*\.e_score_correction_bias", r"\g<0>"),
) + EXPERT_TENSORS + NNX_TO_TORCH

HF = HfMapping(
    hf_name=HF_NAME,
    model_type="deepseek_v3",
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    tensors=TENSORS,
    tied=qwen3.tied_head,
    mtp=MTP,
    float32=(r".*\.mlp\.gate\.(weight|e_score_correction_bias)",),
)
