"""Qwen3 (HF `Qwen3ForCausalLM`; its config and layer choice, attention + dense SwiGLU in every
layer with RMSNorm, are `jtree.config.architectures.Qwen3Config`): its Hugging Face config.json mapping and tensor names (every parameter is
stored under its own name, `jtree.models.hf_mapping.NNX_TO_TORCH`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jtree.config.architectures import Qwen3Config
from jtree.models.hf_config import REQUIRED, ROPE_KEYS, equals, read_config, rope_theta
from jtree.models.hf_mapping import NNX_TO_TORCH, HfMapping, tied_lm_head

# ---------------------------------------------------------------------- Hugging Face mapping

HF_NAME = "Qwen3ForCausalLM"

# HF key -> default when absent (transformers' Qwen3Config defaults).
FIELDS: dict[str, Any] = {
    "vocab_size": REQUIRED,
    "hidden_size": REQUIRED,
    "intermediate_size": REQUIRED,
    "num_hidden_layers": REQUIRED,
    "num_attention_heads": REQUIRED,
    "num_key_value_heads": None,  # None: num_attention_heads (no GQA)
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "max_position_embeddings": 32768,
    "initializer_range": 0.02,
}
DEFAULT_ROPE_THETA = 10000.0


def full_attention_only(value: Any, hf: Mapping[str, Any]) -> str | None:
    if value is None:
        return None
    if not isinstance(value, list) or any(t != "full_attention" for t in value):
        return "only full attention is supported (no sliding-window layers)"
    return None


CHECKS = {
    "hidden_act": equals("silu"),
    "attention_dropout": equals(0.0),
    "use_sliding_window": equals(False),
    "layer_types": full_attention_only,
}
# Only read by transformers when use_sliding_window is true, which the checks refuse.
INERT = frozenset({"sliding_window", "max_window_layers"}) | ROPE_KEYS


def config_from_hf(hf: Mapping[str, Any]) -> Qwen3Config:
    values = read_config(hf, HF_NAME, fields=FIELDS, checks=CHECKS, inert=INERT)
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    values["rope_theta"] = rope_theta(hf, DEFAULT_ROPE_THETA)
    return Qwen3Config(**values)


def config_to_hf(cfg: Qwen3Config) -> dict[str, Any]:
    """config.json fields in the form both transformers 4 and 5 read (top-level `rope_theta`)."""
    out = {key: getattr(cfg, key) for key in FIELDS}
    out.update(
        model_type="qwen3",
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


tied_head = tied_lm_head("model.embed_tokens.weight")


HF = HfMapping(
    hf_name=HF_NAME,
    model_type="qwen3",
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    tensors=NNX_TO_TORCH,
    tied=tied_head,
)
