"""Qwen3.5, dense (HF `Qwen3_5ForCausalLM`, text config `Qwen3_5TextConfig`; the jtree config is
`jtree.config.architectures.Qwen3_5Config`): its Hugging Face mapping. Qwen3.5-MoE
(`jtree.models.architectures.qwen3_5_moe`) shares all of it but the MoE fields.

Layers. Qwen3-Next's hybrid (Gated DeltaNet and gated attention with partial RoPE, (1 + weight)
RMSNorms), with a dense SwiGLU in every layer. The one difference of the token mixers is the GDN's
input projections: separate `in_proj_qkv` (HF rows [all q | all k | all v]), `in_proj_z`,
`in_proj_b`, `in_proj_a` instead of Next's fused, per-key-head grouped `in_proj_qkvz` /
`in_proj_ba`. jtree holds `in_proj_qkv` grouped per key head ([q, k, v-group] for each key
head, `jtree.models.gated_deltanet`), so that a tensor-parallel column split is a split by key
heads as for Next; the table below permutes it on load and back on save (bit-exact). z, b and a
are ordered by value head, which is already grouped.

RoPE. transformers runs Qwen3.5's text model with multimodal RoPE (mrope): three position axes
(time, height, width), each rotating the frequencies `rope_parameters.mrope_section` assigns it
(interleaved). For text every token's three positions are equal (its 1-D position), so whatever
the assignment each frequency turns by that position: plain partial RoPE, which is what jtree
applies (at each token's position along its path). `mrope_section` must still be three sizes
that cover the rotary half-dimension exactly (the layout transformers and inference engines
assume); any other value, or a RoPE type other than default, is refused naming the field.
`save` writes `rope_parameters` without the mrope keys, as transformers' own Qwen3_5ForCausalLM
does (for text they change nothing).

Config. Field names and defaults are HF's `Qwen3_5TextConfig`'s; keys of released checkpoints that
do not change the text model's math are accepted: the multi-token-prediction keys (`mtp_*`; its
`mtp.*` tensors are read into a model built with MTP modules, `jtree.models.mtp`, and skipped
otherwise, as transformers skips them), `mamba_ssm_dtype` (only float32, which
is what jtree's recurrence state uses), `attn_output_gate` (only true: transformers always gates)
and an empty `mlp_only_layers`. The multimodal checkpoints (`Qwen3_5ForConditionalGeneration`,
text under `text_config` and `model.language_model.*`) are not read: extract the text model first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from jtree.config.architectures import Qwen3_5Config
from jtree.models.architectures import qwen3, qwen3_next
from jtree.models.hf_config import ROPE_KEYS, equals, read_config, rope_settings
from jtree.models.hf_mapping import NNX_TO_TORCH, HfMapping, Layout, TensorRule

# ---------------------------------------------------------------------- Hugging Face mapping

HF_NAME = "Qwen3_5ForCausalLM"

# HF key -> default when absent (transformers 5.24's Qwen3_5TextConfig defaults).
FIELDS: dict[str, Any] = {
    **qwen3.FIELDS,
    "num_key_value_heads": 4,
    "head_dim": 256,
    **qwen3_next.HYBRID_FIELDS,
}


def _empty(value: Any, hf: Mapping[str, Any]) -> str | None:
    return None if not value else "only an empty list is supported (every layer is the same kind)"


CHECKS = {
    "hidden_act": equals("silu"),
    "attention_dropout": equals(0.0),
    "attn_output_gate": equals(True),
    "mamba_ssm_dtype": equals("float32"),
    "mlp_only_layers": _empty,
}
# RoPE keys are read by `text_rope`; the multi-token-prediction head is not part of the causal LM.
INERT = ROPE_KEYS | {"mtp_num_hidden_layers", "mtp_use_dedicated_embeddings"}
MROPE_KEYS = ("mrope_section", "mrope_interleaved")


def text_rope(hf: Mapping[str, Any], head_dim: int) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) of the text model, after checking that its mrope keys
    (in `rope_parameters` or `rope_scaling`) reduce to 1-D RoPE on text (module docstring)."""
    plain = dict(hf)
    mrope: dict[str, Any] = {}
    for key in ("rope_parameters", "rope_scaling"):
        given = hf.get(key)
        if isinstance(given, Mapping) and any(k in given for k in MROPE_KEYS):
            plain[key] = {k: v for k, v in given.items() if k not in MROPE_KEYS}
            mrope.update({f"{key}.{k}": given[k] for k in MROPE_KEYS if k in given})
    theta, partial = rope_settings(plain, qwen3.DEFAULT_ROPE_THETA,
                                   qwen3_next.DEFAULT_PARTIAL_ROTARY)
    half = int(head_dim * partial) // 2
    for name, value in mrope.items():
        if name.endswith("mrope_interleaved") and not isinstance(value, bool):
            raise ValueError(f"config.json: {name} = {value!r}: expected true or false")
        if name.endswith("mrope_section") and not (
                isinstance(value, list) and len(value) == 3
                and all(isinstance(v, int) and v >= 0 for v in value) and sum(value) == half):
            raise ValueError(f"config.json: {name} = {value!r}: only three sizes summing to the "
                             f"rotary half-dimension {half} are supported (text positions then "
                             "reduce to 1-D RoPE)")
    return theta, partial


def grouped_qkv_columns(cfg: Any) -> np.ndarray:
    """The HF row of `in_proj_qkv.weight` ([all q | all k | all v]) behind each column of jtree's
    kernel ([q, k, v-group] per key head)."""
    nk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    per, key_dim = cfg.linear_num_value_heads // nk, nk * dk
    return np.concatenate([np.concatenate([
        h * dk + np.arange(dk), key_dim + h * dk + np.arange(dk),
        2 * key_dim + h * per * dv + np.arange(per * dv)]) for h in range(nk)])


# jtree kernel [hidden, grouped columns] <-> HF weight [rows in q | k | v order, hidden].
GROUPED_QKV = Layout(
    "grouped per key head, transposed",
    to_hf=lambda a, cfg: a[:, np.argsort(grouped_qkv_columns(cfg))].T,
    from_hf=lambda a, cfg: a.T[:, grouped_qkv_columns(cfg)],
)
GDN_TENSORS = (TensorRule(r"(.*\.linear_attn\.in_proj_qkv)\.kernel", r"\1.weight", GROUPED_QKV),
               *qwen3_next.GDN_TENSORS)


def config_values(hf: Mapping[str, Any], architecture: str, fields: Mapping[str, Any]
                  ) -> dict[str, Any]:
    """The jtree config fields of a Qwen3.5 text config.json (dense or MoE: `fields`)."""
    values = read_config(hf, architecture, fields=fields, checks=CHECKS, inert=INERT)
    head_dim = values["head_dim"]
    values["rope_theta"], values["partial_rotary_factor"] = text_rope(hf, head_dim)
    return values


def config_from_hf(hf: Mapping[str, Any]) -> Qwen3_5Config:
    return Qwen3_5Config(**config_values(hf, HF_NAME, FIELDS))


def hybrid_values_to_hf(cfg: Any, fields: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """config.json of a Qwen3.5 config (dense or MoE: `fields`), as transformers 5 writes it
    (RoPE in `rope_parameters`; Qwen3.5 has no transformers 4 form)."""
    out = {key: getattr(cfg, key) for key in fields}
    out.update(
        model_type=model_type,
        layer_types=list(cfg.layer_types),
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                         "partial_rotary_factor": cfg.partial_rotary_factor},
        hidden_act="silu",
        attention_dropout=0.0,
        use_cache=True,
    )
    return out


def config_to_hf(cfg: Qwen3_5Config) -> dict[str, Any]:
    return hybrid_values_to_hf(cfg, FIELDS, "qwen3_5_text")


HF = HfMapping(
    hf_name=HF_NAME,
    model_type="qwen3_5_text",
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    tensors=GDN_TENSORS + NNX_TO_TORCH,
    tied=qwen3.tied_head,
    mtp=qwen3_next.MTP,
)
