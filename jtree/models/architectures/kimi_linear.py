"""Kimi-Linear (HF `KimiLinearForCausalLM`, model_type `kimi_linear`; the config and layer choice
are `jtree.config.architectures.KimiLinearConfig`): its Hugging Face config.json mapping and
tensor names.

Tensors. jtree's modules carry transformers' in-memory names (KDA's `self_attn.q_proj`,
`self_attn.conv1d`, `self_attn.forget_gate.f_a_proj` / `f_b_proj` / `dt_bias` / `A_log`, MLA's
as DeepSeek-V3's, the MoE block's `mlp.gate`, `mlp.experts.gate_up_proj`,
`mlp.shared_experts`). The Hub's checkpoints, and transformers' `save_pretrained`, use the names
transformers converts from on load: every `mlp.` (dense MLPs included) is `block_sparse_moe.`,
the experts are one `w1` (gate), `w3` (up) and `w2` (down) per expert, the forget gate's tensors
sit directly under `self_attn`, and the conv weight is three tensors `q_conv1d`, `k_conv1d`,
`v_conv1d`. `save` writes that form; `load` reads it and the in-memory one. `A_log` is held [H]
(HF's [1, 1, H, 1]). The router weight, its selection bias and `dt_bias` stay float32 whatever
the run's dtype, in memory and in a save (transformers' `_keep_in_fp32_modules_strict`).

Config. transformers writes several fields under its `attribute_map` names (`num_experts`,
`num_expert_group`, `num_experts_per_token`, `num_shared_experts`, `moe_renormalize`,
`model_max_length`); both spellings are read. The Hub's `linear_attn_config` (1-based
`full_attn_layers` / `kda_layers`, `num_heads`, `head_dim`, `short_conv_kernel_size`) and
`first_k_dense_replace` give `layer_types`, the KDA shapes and `mlp_layer_types` as transformers
reads them; given alongside the explicit fields they must agree. RoPE keys are accepted and
unused: the model has no rotary embedding (transformers' neither). Other remote-code keys are
refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jtree.config.architectures import KimiLinearConfig
from jtree.models.architectures import qwen3
from jtree.models.architectures.deepseek_v3 import CHECKS as DEEPSEEK_CHECKS
from jtree.models.hf_config import ROPE_KEYS, read_config, renamed
from jtree.models.hf_mapping import (
    NNX_TO_TORCH,
    TRANSPOSED,
    HfMapping,
    Layout,
    PerExpertRule,
    SavedRenamedRule,
    SplitRule,
    TensorRule,
)

HF_NAME = "KimiLinearForCausalLM"

# HF key (as jtree names it) -> default when absent (transformers 5.24's KimiLinearConfig).
FIELDS: dict[str, Any] = {
    "vocab_size": 163840,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "moe_intermediate_size": 1024,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "num_key_value_heads": None,  # None: num_attention_heads
    "n_shared_experts": 1,
    "num_experts": 256,
    "routed_scaling_factor": 2.446,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "max_position_embeddings": 1048576,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "linear_head_dim": 128,
    "linear_num_heads": 32,
    "linear_conv_kernel_dim": 4,
    "layer_types": None,
    "mlp_layer_types": None,
}
# transformers' attribute_map: the names it writes -> jtree's (its in-memory attributes).
_ALIASES = {"num_local_experts": "num_experts", "num_expert_group": "n_group",
            "num_experts_per_token": "num_experts_per_tok",
            "num_shared_experts": "n_shared_experts", "moe_renormalize": "norm_topk_prob",
            "model_max_length": "max_position_embeddings"}
_LINEAR_ATTN_KEYS = {"num_heads": "linear_num_heads", "head_dim": "linear_head_dim",
                     "short_conv_kernel_size": "linear_conv_kernel_dim"}
# `output_router_logits` only returns the router logits in transformers (no loss is added).
INERT = frozenset({"output_router_logits", "linear_attn_config", "first_k_dense_replace"}) | (
    ROPE_KEYS)


def _agree(values: dict[str, Any], key: str, value: Any, source: str) -> None:
    """Set `values[key]` from `source` unless the config gave it another value."""
    given = values.get(key)
    if given is not None and (list(given) if isinstance(given, (list, tuple)) else given) != (
            list(value) if isinstance(value, (list, tuple)) else value):
        raise ValueError(f"config.json: {source} gives {key} = {value!r}, but {key} = "
                         f"{given!r}")
    values[key] = value


def _linear_attn_config(hf: Mapping[str, Any], values: dict[str, Any]) -> None:
    """The Hub's `linear_attn_config` into `values` (module docstring)."""
    given = hf.get("linear_attn_config")
    if not given:
        return
    extra = sorted(set(given) - set(_LINEAR_ATTN_KEYS) - {"full_attn_layers", "kda_layers"})
    if extra:
        raise ValueError(f"config.json: linear_attn_config.{extra[0]} is not supported")
    explicit = {key: hf.get(key) for key in _LINEAR_ATTN_KEYS.values()}
    for key, name in _LINEAR_ATTN_KEYS.items():
        if key in given:
            values[name] = explicit[name]
            _agree(values, name, given[key], f"linear_attn_config.{key}")
    if "full_attn_layers" in given and "kda_layers" in given:
        types: list[str | None] = [None] * values["num_hidden_layers"]
        for kind, layers in (("full_attention", given["full_attn_layers"]),
                             ("linear_attention", given["kda_layers"])):
            for layer in layers:  # 1-based
                if not 1 <= layer <= len(types):
                    raise ValueError(f"config.json: linear_attn_config names layer {layer} of "
                                     f"{len(types)}")
                types[layer - 1] = kind
        if None in types:
            raise ValueError(f"config.json: linear_attn_config leaves layer "
                             f"{types.index(None) + 1} with no type")
        _agree(values, "layer_types", types, "linear_attn_config")


def config_from_hf(hf: Mapping[str, Any]) -> KimiLinearConfig:
    hf = renamed(hf, _ALIASES)
    values = read_config(hf, HF_NAME, fields=FIELDS, checks=DEEPSEEK_CHECKS, inert=INERT)
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    _linear_attn_config(hf, values)
    dense = hf.get("first_k_dense_replace")
    if dense is not None:
        _agree(values, "mlp_layer_types", ["dense" if i < dense else "sparse"
                                           for i in range(values["num_hidden_layers"])],
               "first_k_dense_replace")
    for key in ("layer_types", "mlp_layer_types"):
        if values[key] is not None:
            values[key] = tuple(values[key])
    return KimiLinearConfig(**values)


def config_to_hf(cfg: KimiLinearConfig) -> dict[str, Any]:
    """config.json fields as transformers writes them (its attribute_map names, the derived
    `head_dim` and `qk_head_dim`, explicit layer type lists)."""
    out = {key: getattr(cfg, key) for key in FIELDS}
    for alias, name in _ALIASES.items():
        if alias != "num_local_experts":
            out[alias] = out.pop(name)
    out.update(
        model_type="kimi_linear",
        layer_types=list(cfg.layer_types),
        mlp_layer_types=list(cfg.mlp_layer_types),
        head_dim=cfg.qk_rope_head_dim,
        qk_head_dim=cfg.qk_head_dim,
        hidden_act="silu",
        attention_dropout=0.0,
        pretraining_tp=1,
        use_cache=True,
    )
    return out


# HF's [1, 1, H, 1] A_log, held [H].
_HEADS_LAST_BUT_ONE = Layout("[1, 1, H, 1]", lambda a, cfg: a.reshape(1, 1, -1, 1),
                             lambda a, cfg: a.reshape(-1))
_SAVED = ((r"\.mlp\.", ".block_sparse_moe."), (r"\.forget_gate\.", "."))
_EXPERTS = r"(.*)\.mlp\.experts\."

TENSORS = (
    SplitRule(r"(.*\.self_attn)\.conv1d\.weight",
              (r"\1.q_conv1d.weight", r"\1.k_conv1d.weight", r"\1.v_conv1d.weight"),
              r"\1.conv1d.weight"),
    SavedRenamedRule(TensorRule(r".*\.forget_gate\.A_log", r"\g<0>", _HEADS_LAST_BUT_ONE),
                     _SAVED),
    PerExpertRule(_EXPERTS + "gate_up_proj", (r"\1.block_sparse_moe.experts.{e}.w1.weight",
                                              r"\1.block_sparse_moe.experts.{e}.w3.weight"),
                  r"\1.mlp.experts.gate_up_proj"),
    PerExpertRule(_EXPERTS + "down_proj", (r"\1.block_sparse_moe.experts.{e}.w2.weight",),
                  r"\1.mlp.experts.down_proj"),
    SavedRenamedRule(TensorRule(r"(.*)\.mlp\.shared_expert\.(\w+)\.kernel",
                                r"\1.mlp.shared_experts.\2.weight", TRANSPOSED), _SAVED),
    SavedRenamedRule(TensorRule(r".*\.(e_score_correction_bias|dt_bias)", r"\g<0>"), _SAVED),
) + tuple(SavedRenamedRule(rule, _SAVED) for rule in NNX_TO_TORCH)

HF = HfMapping(
    hf_name=HF_NAME,
    model_type="kimi_linear",
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    tensors=TENSORS,
    tied=qwen3.tied_head,
    float32=(r".*\.mlp\.gate\.(weight|e_score_correction_bias)", r".*\.forget_gate\.dt_bias"),
)
