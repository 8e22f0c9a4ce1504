"""Llama (HF `LlamaForCausalLM`, Llama 3 and 3.1 included; the config and layer choice are
`jtree.config.architectures.LlamaConfig`): its Hugging Face config.json mapping and tensor names.

Tensors are stored under jtree's own names (`jtree.models.hf_mapping.NNX_TO_TORCH`), as for Qwen3;
there is no q/k norm. Config: `head_dim` absent means hidden_size / num_attention_heads, as in
transformers. RoPE is read from the top-level `rope_theta` with `rope_scaling` (transformers 4,
the Hub's Llama 3.1) or from `rope_parameters` (transformers 5); of the scaled types only
`llama3` is implemented, and `save` writes the transformers 4 form, which both read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jtree.config.architectures import Llama3RopeScaling, LlamaConfig
from jtree.models.architectures import qwen3
from jtree.models.hf_config import REQUIRED, ROPE_KEYS, equals, read_config, rope_config, whole_head
from jtree.models.hf_mapping import NNX_TO_TORCH, HfMapping

# ---------------------------------------------------------------------- Hugging Face mapping

HF_NAME = "LlamaForCausalLM"

# HF key -> default when absent (transformers' LlamaConfig defaults).
FIELDS: dict[str, Any] = {
    "vocab_size": REQUIRED,
    "hidden_size": REQUIRED,
    "intermediate_size": REQUIRED,
    "num_hidden_layers": REQUIRED,
    "num_attention_heads": REQUIRED,
    "num_key_value_heads": None,  # None: num_attention_heads (no GQA)
    "head_dim": None,  # None: hidden_size // num_attention_heads
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "max_position_embeddings": 2048,
    "initializer_range": 0.02,
}
DEFAULT_ROPE_THETA = 10000.0
LLAMA3_KEYS = frozenset(f.name for f in dataclasses.fields(Llama3RopeScaling))
ROPE_TYPES = {"default": frozenset(), "llama3": LLAMA3_KEYS}

CHECKS = {
    "hidden_act": equals("silu"),
    "attention_dropout": equals(0.0),
    # transformers no longer splits the projections by it; any other value was meant to.
    "pretraining_tp": equals(1),
}


def config_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    values = read_config(hf, HF_NAME, fields=FIELDS, checks=CHECKS, inert=ROPE_KEYS)
    complete_heads(values)
    theta, partial, rope_type, params = rope_config(hf, DEFAULT_ROPE_THETA, 1.0, ROPE_TYPES)
    whole_head(partial)
    values["rope_theta"] = theta
    if rope_type == "llama3":
        missing = sorted(LLAMA3_KEYS - set(params))
        if missing:
            raise ValueError(f"config.json: rope_scaling.{missing[0]} is missing (rope_type "
                             "'llama3' needs it)")
        values["rope_scaling"] = Llama3RopeScaling(**params)
    return LlamaConfig(**values)


def complete_heads(values: dict[str, Any]) -> None:
    """transformers' defaults that depend on other fields: no GQA, head_dim = hidden / heads."""
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    if values["head_dim"] is None:
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]


def config_to_hf(cfg: LlamaConfig) -> dict[str, Any]:
    """config.json fields in the form both transformers 4 and 5 read (top-level `rope_theta`,
    `rope_scaling` with its `rope_type`)."""
    out = {key: getattr(cfg, key) for key in FIELDS}
    scaling = cfg.rope_scaling
    out.update(
        model_type="llama",
        rope_theta=cfg.rope_theta,
        rope_scaling=None if scaling is None else {"rope_type": "llama3",
                                                   **dataclasses.asdict(scaling)},
        hidden_act="silu",
        attention_dropout=0.0,
        pretraining_tp=1,
        use_cache=True,
    )
    return out


HF = HfMapping(
    hf_name=HF_NAME,
    model_type="llama",
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    tensors=NNX_TO_TORCH,
    tied=qwen3.tied_head,
)
