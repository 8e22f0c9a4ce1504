"""gpt-oss (HF `GptOssForCausalLM`, model_type `gpt_oss`; the config and layer choice are
`jtree.config.architectures.GptOssConfig`): its Hugging Face config.json mapping and tensor names.

Tensors. Attention keeps jtree's own names (`NNX_TO_TORCH`) plus the per-head `self_attn.sinks`.
The router is HF's `mlp.router` (jtree's MoE block calls it `gate`). The experts differ from
Qwen3-MoE's in layout, so they are permuted on load and back on save (bit-exact):

- `mlp.experts.gate_up_proj`: HF [E, hidden, 2 I] with gate and up *interleaved* along the last
  axis (gate = [..., 0::2], up = [..., 1::2]); jtree holds [E, 2 I, hidden], gate rows first, the
  layout its experts' grouped matmuls and expert-parallel split read (`INTERLEAVED_GATE_UP`).
  `gate_up_proj_bias` [E, 2 I] is interleaved the same way.
- `mlp.experts.down_proj`: HF [E, I, hidden], jtree [E, hidden, I] (transposed per expert);
  `down_proj_bias` [E, hidden] as is.

Released checkpoints store the experts' two matrices quantized as MXFP4 (`*_blocks`, `*_scales`):
`jtree.hf.safetensors_io` dequantizes them on the host into the HF tensors above
(`jtree.hf.mxfp4`), so they load like a bf16 checkpoint; `save` writes unquantized tensors and
no `quantization_config`.

Config. transformers 5's `rope_parameters` or the Hub's top-level `rope_theta` with `rope_scaling`
(YaRN, `truncate: false` on the released models) are read; `save` writes the Hub's form. As in
transformers, a config.json with neither means the released models' YaRN (factor 32 over 4096
positions, not truncated), so plain RoPE is saved as `rope_type: default`. The Hub's
`experts_per_token` must equal `num_experts_per_tok`; `initial_context_length`, which transformers
does not read (YaRN reads `original_max_position_embeddings`), and `hidden_act`, which gpt-oss's
experts do not use (their activation is the clamped SwiGLU), are accepted as they are.
`num_local_experts` is jtree's `num_experts`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jtree.config.architectures import GptOssConfig, YarnRopeScaling
from jtree.models.architectures import llama, qwen3
from jtree.models.hf_config import (
    ROPE_KEYS,
    equals,
    read_config,
    renamed,
    rope_config,
    whole_head,
)
from jtree.models.hf_mapping import NNX_TO_TORCH, HfMapping, Layout, TensorRule

HF_NAME = "GptOssForCausalLM"

# HF key -> default when absent (transformers 5's GptOssConfig defaults): Llama's attention
# fields without `mlp_bias`, and the MoE, SwiGLU and window fields.
FIELDS: dict[str, Any] = {
    **{key: default for key, default in llama.FIELDS.items() if key != "mlp_bias"},
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "attention_bias": True,
    "num_experts": 128,
    "num_experts_per_tok": 4,
    "router_aux_loss_coef": 0.001,
    "output_router_logits": False,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "sliding_window": 128,
    "layer_types": None,  # None: alternating, sliding first (GptOssConfig)
}
DEFAULT_ROPE_THETA = 150000.0
YARN_KEYS = frozenset(f.name for f in dataclasses.fields(YarnRopeScaling))
ROPE_TYPES = {"default": frozenset(), "yarn": YARN_KEYS}
# transformers 5 writes `num_local_experts`, the name jtree's MoE code reads is `num_experts`.
_ALIASES = {"num_local_experts": "num_experts"}


def _same_as_top_k(value: Any, hf: Mapping[str, Any]) -> str | None:
    if value is None or value == hf.get("num_experts_per_tok", FIELDS["num_experts_per_tok"]):
        return None
    return "must equal num_experts_per_tok"


def _mxfp4(value: Any, hf: Mapping[str, Any]) -> str | None:
    if value is None or (isinstance(value, Mapping) and value.get("quant_method") == "mxfp4"):
        return None
    return "only the released checkpoints' MXFP4 experts (quant_method 'mxfp4') are read"


CHECKS = {
    "attention_dropout": equals(0.0),
    "experts_per_token": _same_as_top_k,
    "quantization_config": _mxfp4,
}
INERT = frozenset({"hidden_act", "initial_context_length"}) | ROPE_KEYS


def yarn_scaling(params: Mapping[str, Any]) -> YarnRopeScaling:
    """The YaRN scaling of a config.json's `rope_scaling` / `rope_parameters` of type 'yarn'
    (its keys as `rope_config` returns them); `factor` and `original_max_position_embeddings`
    are required, as transformers requires them."""
    for key in ("factor", "original_max_position_embeddings"):
        if key not in params:
            raise ValueError(f"config.json: rope_scaling.{key} is missing (rope_type 'yarn' "
                             "needs it)")
    return YarnRopeScaling(**params)


def yarn_to_hf(scaling: YarnRopeScaling) -> dict[str, Any]:
    """`scaling` as config.json's `rope_scaling`: its given keys, `truncate` only when off
    (transformers' default is on, and configs that leave it on omit it)."""
    return {"rope_type": "yarn",
            **{k: v for k, v in dataclasses.asdict(scaling).items()
               if v is not None and (k, v) != ("truncate", True)}}


def config_from_hf(hf: Mapping[str, Any]) -> GptOssConfig:
    hf = renamed(hf, _ALIASES)
    values = read_config(hf, HF_NAME, fields=FIELDS, checks=CHECKS, inert=INERT)
    llama.complete_heads(values)
    theta, partial, rope_type, params = rope_config(hf, DEFAULT_ROPE_THETA, 1.0, ROPE_TYPES)
    whole_head(partial)
    values["rope_theta"] = theta
    if hf.get("rope_parameters") is None and hf.get("rope_scaling") is None:
        # transformers' GptOssConfig then applies its default, the released models' YaRN
        values["rope_scaling"] = YarnRopeScaling(factor=32.0, original_max_position_embeddings=4096,
                                                 truncate=False)
    elif rope_type == "default":
        values["rope_scaling"] = None
    elif rope_type == "yarn":
        values["rope_scaling"] = yarn_scaling(params)
    if values["layer_types"] is not None:
        values["layer_types"] = tuple(values["layer_types"])
    return GptOssConfig(**values)


def config_to_hf(cfg: GptOssConfig) -> dict[str, Any]:
    """config.json fields in the Hub's form (top-level `rope_theta`, `rope_scaling` with its
    `rope_type`, `num_local_experts`), which transformers 4.55+ and 5 read."""
    out = {key: getattr(cfg, key) for key in FIELDS}
    out["num_local_experts"] = out.pop("num_experts")
    out["layer_types"] = list(cfg.layer_types)
    scaling = cfg.rope_scaling
    out.update(
        model_type="gpt_oss",
        rope_theta=cfg.rope_theta,
        # (an absent or null rope_scaling means transformers' default YaRN, not plain RoPE)
        rope_scaling={"rope_type": "default"} if scaling is None else yarn_to_hf(scaling),
        hidden_act="silu",
        attention_dropout=0.0,
        use_cache=True,
    )
    return out


def _interleave(a: Any, axis_from_end: int) -> Any:
    """[..., 2 n, ...] gate rows then up rows -> gate, up alternating along that axis (the axis
    `axis_from_end` from the end: -1 for a bias, -2 for a weight)."""
    shape = a.shape
    k = len(shape) + axis_from_end
    n = shape[k] // 2
    split = a.reshape(*shape[:k], 2, n, *shape[k + 1:])
    order = list(range(len(split.shape)))
    order[k], order[k + 1] = k + 1, k
    return split.transpose(*order).reshape(shape)


def _deinterleave(a: Any, axis_from_end: int) -> Any:
    """The inverse of `_interleave`."""
    shape = a.shape
    k = len(shape) + axis_from_end
    n = shape[k] // 2
    split = a.reshape(*shape[:k], n, 2, *shape[k + 1:])
    order = list(range(len(split.shape)))
    order[k], order[k + 1] = k + 1, k
    return split.transpose(*order).reshape(shape)


def _per_expert_t(a: Any) -> Any:
    return a.transpose(0, 2, 1)


# jtree [E, 2I, hidden] gate rows first <-> HF [E, hidden, 2I] gate/up interleaved columns.
INTERLEAVED_GATE_UP = Layout(
    "interleaved_gate_up",
    lambda a, cfg: _per_expert_t(_interleave(a, -2)),
    lambda t, cfg: _deinterleave(_per_expert_t(t), -2))
INTERLEAVED_BIAS = Layout("interleaved_bias", lambda a, cfg: _interleave(a, -1),
                          lambda t, cfg: _deinterleave(t, -1))
PER_EXPERT_TRANSPOSED = Layout("per_expert_transposed", lambda a, cfg: _per_expert_t(a),
                               lambda t, cfg: _per_expert_t(t))

TENSORS = (
    TensorRule(r"(.*)\.mlp\.gate\.(weight|bias)", r"\1.mlp.router.\2"),
    TensorRule(r".*\.experts\.gate_up_proj", r"\g<0>", INTERLEAVED_GATE_UP),
    TensorRule(r".*\.experts\.gate_up_proj_bias", r"\g<0>", INTERLEAVED_BIAS),
    TensorRule(r".*\.experts\.down_proj", r"\g<0>", PER_EXPERT_TRANSPOSED),
    TensorRule(r".*\.experts\.down_proj_bias", r"\g<0>"),
    TensorRule(r".*\.self_attn\.sinks", r"\g<0>"),
) + NNX_TO_TORCH


HF = HfMapping(
    hf_name=HF_NAME,
    model_type="gpt_oss",
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    tensors=TENSORS,
    tied=qwen3.tied_head,
)
