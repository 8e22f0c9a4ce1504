"""Qwen2 and Qwen2.5 (HF `Qwen2ForCausalLM`; the config and layer choice, biases on q/k/v only
and no q/k norm, are `jtree.config.architectures.Qwen2Config`): its Hugging Face config.json
mapping and tensor names (jtree's own, `jtree.models.hf_mapping.NNX_TO_TORCH`, as for Qwen3).

Released Qwen2.5 configs carry the sliding-window fields with `use_sliding_window: false`, which
turns them off in transformers; `use_sliding_window: true` is refused (windows on trees are not
implemented), and so is a `layer_types` naming a sliding layer. `head_dim` is not a field of HF's
Qwen2 config: hidden_size / num_attention_heads unless a config.json sets it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jtree.config.architectures import Qwen2Config
from jtree.models.architectures import llama, qwen3
from jtree.models.hf_config import read_config, rope_theta
from jtree.models.hf_mapping import NNX_TO_TORCH, HfMapping

# ---------------------------------------------------------------------- Hugging Face mapping

HF_NAME = "Qwen2ForCausalLM"

# HF key -> default when absent (transformers' Qwen2Config defaults).
FIELDS: dict[str, Any] = {
    **{key: default for key, default in llama.FIELDS.items()
       if key not in ("attention_bias", "mlp_bias")},
    "num_key_value_heads": 32,
    "max_position_embeddings": 32768,
}


def config_from_hf(hf: Mapping[str, Any]) -> Qwen2Config:
    values = read_config(hf, HF_NAME, fields=FIELDS, checks=qwen3.CHECKS, inert=qwen3.INERT)
    llama.complete_heads(values)
    values["rope_theta"] = rope_theta(hf, qwen3.DEFAULT_ROPE_THETA)
    return Qwen2Config(**values)


def config_to_hf(cfg: Qwen2Config) -> dict[str, Any]:
    """config.json fields in the form both transformers 4 and 5 read (top-level `rope_theta`)."""
    out = {key: getattr(cfg, key) for key in FIELDS}
    out.update(
        model_type="qwen2",
        rope_theta=cfg.rope_theta,
        rope_scaling=None,
        hidden_act="silu",
        attention_dropout=0.0,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=cfg.num_hidden_layers,
        use_cache=True,
    )
    return out


HF = HfMapping(
    hf_name=HF_NAME,
    model_type="qwen2",
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    tensors=NNX_TO_TORCH,
    tied=qwen3.tied_head,
)
