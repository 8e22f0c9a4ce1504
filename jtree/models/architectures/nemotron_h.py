"""Nemotron-H (HF `NemotronHForCausalLM`): single-block layers of Mamba2, attention without RoPE,
a squared-ReLU MLP or (Nemotron 3) a MoE block (the config is
`jtree.config.architectures.NemotronHConfig`): its Hugging Face mapping.

Tensors. transformers names every layer's block `mixer` and its one norm `norm`
(`model.layers.N.mixer.in_proj.weight`, `model.layers.N.norm.weight`), the embedding
`model.embeddings` and the final norm `model.norm_f`, and saves `model.*` as `backbone.*` (the
Hub's names; both are read, `SavedPrefixRule`). jtree keeps the shared decoder's names for
the blocks it shares (`self_attn`, `mlp`, `input_layernorm`, `embed_tokens`, `norm`; the Mamba2
block is `mixer` already), so the tables below mostly rename. Two Mamba2 tensors are permuted:
HF's in_proj rows are [z | x | B | C | dt], each component of all heads (or groups) in turn, and
the conv's channels [x | B | C]; jtree holds both grouped by B/C group (`jtree.models.mamba2`,
so that a tensor-parallel split is a split by groups), and the tables permute on load and back
on save, bit-exact. Hub checkpoints with multi-token-prediction layers carry `mtp.*`, which the
causal LM does not use (transformers skips them too). A MoE layer's block (jtree's `mlp`, a
`SparseMoeBlock`) is HF's `mixer` too: the router `mixer.gate.weight` and
`mixer.gate.e_score_correction_bias` as they are, the shared expert
`mixer.shared_experts.{up,down}_proj`, and the routed experts one tensor per expert as the Hub
stores them (`mixer.experts.{e}.up_proj.weight`, `.down_proj.weight`; transformers' fused
`mixer.experts.up_proj` [E, I, H] loads too).

Config. Field names and defaults follow transformers 5.24's `NemotronHConfig`. The layer layout is
`layers_block_type` ("linear_attention" = Mamba2, "full_attention", "mlp", "moe"); the older
`hybrid_override_pattern` string (M, *, -, E) is read when it is absent. `n_routed_experts` is
jtree's `num_experts`; a MoE latent projection (`moe_latent_size`) and, with MoE layers,
`mlp_bias` (the shared expert's biases) are refused by name. Fields that the forward pass does
not read are accepted as inert: the initialisation's
(`time_step_max`, `time_step_floor`, `rescale_prenorm_residual`), the kernels'
(`use_mamba_kernels`, `mamba_ssm_cache_dtype`; `chunk_size` is kept and written back, since it
sets transformers' rounding), `time_step_limit` (transformers' mixer clamps dt
by `time_step_min` only), `expand` and `mamba_proj_bias` (its widths come from
`mamba_num_heads * mamba_head_dim`, its biases from `use_bias`), `residual_in_fp32`,
`n_shared_experts` and `moe_shared_expert_overlap` (transformers' block builds one shared expert
of `moe_shared_expert_intermediate_size` whatever they say), `output_router_logits` (it adds no
loss in transformers) and the multi-token-prediction fields.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jtree.config.architectures import NemotronHConfig
from jtree.models.hf_config import REQUIRED, equals, read_config, renamed
from jtree.models.hf_mapping import (
    NNX_TO_TORCH,
    SAME,
    TRANSPOSED,
    HfMapping,
    Layout,
    PerExpertRule,
    SavedPrefixRule,
    TensorRule,
    tied_lm_head,
)

HF_NAME = "NemotronHForCausalLM"

# HF key -> default when absent (transformers 5.24's NemotronHConfig defaults).
_FIELDS: dict[str, Any] = {
    "vocab_size": REQUIRED,
    "hidden_size": REQUIRED,
    "layers_block_type": None,  # None: from hybrid_override_pattern
    "num_attention_heads": 32,
    "num_key_value_heads": 8,  # an explicit null: num_attention_heads, as in transformers
    "head_dim": 128,
    "intermediate_size": 21504,
    "mlp_bias": False,
    "ssm_state_size": 128,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "n_groups": 8,
    "conv_kernel": 4,
    "time_step_min": 0.001,
    "use_conv_bias": True,
    "use_bias": False,
    "layer_norm_epsilon": 1e-5,
    "tie_word_embeddings": False,
    "max_position_embeddings": 4096,
    "initializer_range": 0.02,
    "chunk_size": 128,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 7688,
    "moe_shared_expert_intermediate_size": 7688,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
}
_ALIASES = {"n_routed_experts": "num_experts"}
_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def _layer_count(value: Any, hf: Mapping[str, Any]) -> str | None:
    types = hf.get("layers_block_type") or hf.get("hybrid_override_pattern") or ()
    if value is not None and value != len(types):
        return f"does not match the {len(types)} layers of layers_block_type"
    return None


_CHECKS = {
    "mlp_hidden_act": equals("relu2"),
    "mamba_hidden_act": equals("silu"),
    "attention_bias": equals(False),
    "attention_dropout": equals(0.0),
    "hidden_dropout": equals(0.0),
    "sliding_window": equals(None),
    "num_hidden_layers": _layer_count,
    "moe_latent_size": equals(None),
}
_INERT = frozenset({
    "hybrid_override_pattern", "time_step_max", "time_step_floor", "time_step_limit",
    "rescale_prenorm_residual", "use_mamba_kernels", "mamba_ssm_cache_dtype",
    "expand", "mamba_proj_bias", "residual_in_fp32", "num_logits_to_keep",
    "n_shared_experts", "moe_shared_expert_overlap", "output_router_logits",
    "num_nextn_predict_layers", "mtp_layers_block_type", "mtp_hybrid_override_pattern"})


def grouped_conv_channels(cfg: NemotronHConfig) -> np.ndarray:
    """The HF channel ([x of all heads | B of all groups | C of all groups]) behind each of
    jtree's conv channels ([x of the group's heads | B_g | C_g] for each group g)."""
    p, n, g = cfg.mamba_head_dim, cfg.ssm_state_size, cfg.n_groups
    width, inner = cfg.mamba_num_heads // g * p, cfg.mamba_num_heads * p
    return np.concatenate([np.concatenate([
        i * width + np.arange(width), inner + i * n + np.arange(n),
        inner + g * n + i * n + np.arange(n)]) for i in range(g)])


def grouped_in_proj_columns(cfg: NemotronHConfig) -> np.ndarray:
    """The HF row of in_proj ([z | x B C | dt], each over all heads or groups) behind each of
    jtree's columns ([z of the group's heads | its conv channels | dt of its heads] for each
    group)."""
    g, per = cfg.n_groups, cfg.mamba_num_heads // cfg.n_groups
    inner = cfg.mamba_num_heads * cfg.mamba_head_dim
    conv = grouped_conv_channels(cfg).reshape(g, -1)
    dt = inner + conv.size
    return np.concatenate([np.concatenate([
        i * per * cfg.mamba_head_dim + np.arange(per * cfg.mamba_head_dim), inner + conv[i],
        dt + i * per + np.arange(per)]) for i in range(g)])


def _grouped(index: Callable[[NemotronHConfig], np.ndarray], axis: int, base: Layout) -> Layout:
    """`base` (the NNX -> torch layout) with jtree's `axis` holding HF's in `index(cfg)` order."""
    def to_hf(a: Any, cfg: NemotronHConfig) -> Any:
        order = np.argsort(index(cfg))
        return base.to_hf(a[order] if axis == 0 else a[:, order], cfg)

    def from_hf(a: Any, cfg: NemotronHConfig) -> Any:
        a = base.from_hf(a, cfg)
        return a[index(cfg)] if axis == 0 else a[:, index(cfg)]

    return Layout(f"grouped by B/C group, {base.name}", to_hf, from_hf)


# The Mamba2 tensors jtree holds grouped by B/C group (module docstring).
_MAMBA2_GROUPED = (
    TensorRule(r"(.*\.mixer\.in_proj)\.kernel", r"\1.weight",
               _grouped(grouped_in_proj_columns, 1, TRANSPOSED)),
    TensorRule(r"(.*\.mixer\.in_proj)\.bias", r"\1.bias",
               _grouped(grouped_in_proj_columns, 0, SAME)),
    TensorRule(r"(.*\.mixer\.conv1d)\.(weight|bias)", r"\1.\2",
               _grouped(grouped_conv_channels, 0, SAME)),
)

# The MoE block's (module docstring): before the generic rules, which would keep the router's
# names and miss the shared expert's.
_LAYER = r"(model\.layers\.\d+)"
_MOE = (
    TensorRule(_LAYER + r"\.mlp\.gate\.(weight|e_score_correction_bias)", r"\1.mixer.gate.\2"),
    TensorRule(_LAYER + r"\.mlp\.shared_expert\.(up|down)_proj\.kernel",
               r"\1.mixer.shared_experts.\2_proj.weight", TRANSPOSED),
    *(PerExpertRule(_LAYER + rf"\.mlp\.experts\.{name}",
                    (rf"\1.mixer.experts.{{e}}.{name}.weight",),
                    fused_name=rf"\1.mixer.experts.{name}") for name in ("up_proj", "down_proj")),
)

# jtree's shared-decoder names -> transformers' (`mixer` for every block, one `norm` per layer);
# the Mamba2 block's bare parameters stay as they are; the rest is the NNX -> torch rule. Saved
# as transformers saves them, `model.*` as `backbone.*`.
_IN_MEMORY = (
    *_MOE,
    TensorRule(r"model\.embed_tokens\.embedding", "model.embeddings.weight"),
    TensorRule(r"model\.norm\.weight", "model.norm_f.weight"),
    TensorRule(r"(model\.layers\.\d+)\.input_layernorm\.weight", r"\1.norm.weight"),
    TensorRule(r"(model\.layers\.\d+)\.(?:self_attn|mlp)\.(\w+)\.kernel", r"\1.mixer.\2.weight",
               TRANSPOSED),
    TensorRule(r"(model\.layers\.\d+)\.(?:self_attn|mlp)\.(\w+)\.bias", r"\1.mixer.\2.bias"),
    TensorRule(r".*\.mixer\.(A_log|dt_bias|D)", r"\g<0>"),
    *_MAMBA2_GROUPED,
) + NNX_TO_TORCH
TENSORS = tuple(SavedPrefixRule(rule, "model.", "backbone.") for rule in _IN_MEMORY)


def config_from_hf(hf: Mapping[str, Any]) -> NemotronHConfig:
    hf = renamed(hf, _ALIASES)
    values = read_config(hf, HF_NAME, fields=_FIELDS, checks=_CHECKS, inert=_INERT)
    if values["layers_block_type"] is None:
        pattern = hf.get("hybrid_override_pattern")
        if pattern is None:
            raise ValueError(f"config.json: missing field 'layers_block_type' ({HF_NAME})")
        unknown = sorted(set(pattern) - set(_PATTERN))
        if unknown:
            raise ValueError(f"config.json: hybrid_override_pattern: {unknown[0]!r} is not one "
                             f"of {sorted(_PATTERN)}")
        values["layers_block_type"] = [_PATTERN[c] for c in pattern]
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    return NemotronHConfig(**values)


def config_to_hf(cfg: NemotronHConfig) -> dict[str, Any]:
    out = {key: getattr(cfg, key) for key in _FIELDS}
    out["n_routed_experts"] = out.pop("num_experts")
    out.update(model_type="nemotron_h", layers_block_type=list(cfg.layers_block_type),
               mlp_hidden_act="relu2", mamba_hidden_act="silu", attention_bias=False,
               num_nextn_predict_layers=0, use_cache=True)
    return out


HF = HfMapping(
    hf_name=HF_NAME,
    model_type="nemotron_h",
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    tensors=TENSORS,
    tied=tied_lm_head("backbone.embeddings.weight"),
    ignored=(r"mtp\..*",),
)
