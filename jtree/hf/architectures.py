"""The table of supported Hugging Face architectures, looked up by config.json or jtree config."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jtree.hf.qwen3 import QWEN3
from jtree.hf.qwen3_moe import QWEN3_MOE
from jtree.hf.qwen3_next import QWEN3_NEXT
from jtree.hf.spec import Architecture
from jtree.models.registry import ARCHITECTURES as MODEL_CLASSES

ARCHITECTURES: dict[str, Architecture] = {a.hf_name: a for a in (QWEN3, QWEN3_MOE, QWEN3_NEXT)}


def architecture_of_hf_config(hf_config: Mapping[str, Any]) -> Architecture:
    """The entry named by `architectures` in config.json (checked against `model_type`)."""
    names = hf_config.get("architectures")
    if not isinstance(names, list) or len(names) != 1:
        raise ValueError(f"config.json: architectures = {names!r}: expected one architecture "
                         f"name (supported: {sorted(ARCHITECTURES)})")
    arch = ARCHITECTURES.get(names[0])
    if arch is None:
        raise ValueError(f"config.json: architecture {names[0]!r} is not supported "
                         f"(supported: {sorted(ARCHITECTURES)})")
    model_type = hf_config.get("model_type")
    if model_type is not None and model_type != arch.model_type:
        raise ValueError(f"config.json: model_type = {model_type!r} does not match architecture "
                         f"{arch.hf_name} (expects {arch.model_type!r})")
    return arch


def architecture_of_config(config: Any) -> Architecture:
    """The entry whose jtree config class is exactly `type(config)`."""
    for arch in ARCHITECTURES.values():
        if type(config) is MODEL_CLASSES[arch.model_key][0]:
            return arch
    raise ValueError(f"config: {type(config).__name__} has no Hugging Face architecture in "
                     f"jtree.hf (supported: {sorted(ARCHITECTURES)})")


def model_class(arch: Architecture) -> type:
    return MODEL_CLASSES[arch.model_key][1]
