"""The architecture registry: one record per architecture, looked up by jtree name (configs,
checkpoints), by Hugging Face name (`architectures` in config.json) or by config class.

A record holds everything that is particular to an architecture: its config class (Hugging Face
field names only) whose `decoder()` gives the layer choice of the shared decoder stack
(`jtree.models.decoder`), and its Hugging Face mapping (`jtree.models.hf_mapping.HfMapping`: config.json
fields and tensor names). Sharding rules (`jtree.parallel.sharding.param_rules`) and FLOP counts
(`jtree.layout.flop_model.FlopModel.for_config`) follow from the layer choice, per layer kind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from flax import nnx

from jtree.config.architectures import ARCHITECTURE_CONFIGS, architecture_config
from jtree.config.runtime import RuntimeConfig
from jtree.models.architectures import (
    deepseek_v3,
    gpt_oss,
    kimi_linear,
    llama,
    nemotron_h,
    qwen2,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
)
from jtree.models.decoder import CausalLM
from jtree.models.hf_mapping import HfMapping


@dataclasses.dataclass(frozen=True)
class Architecture:
    """`name` (the `model.architecture` of run configs), its config class and HF mapping."""

    name: str
    config_class: type
    hf: HfMapping


ARCHITECTURES: dict[str, Architecture] = {
    name: Architecture(name, ARCHITECTURE_CONFIGS[name], module.HF)
    for name, module in (("qwen3", qwen3), ("qwen3_moe", qwen3_moe), ("qwen3_next", qwen3_next),
                         ("llama", llama), ("qwen2", qwen2), ("qwen3_5", qwen3_5),
                         ("qwen3_5_moe", qwen3_5_moe), ("gpt_oss", gpt_oss),
                         ("deepseek_v3", deepseek_v3), ("nemotron_h", nemotron_h),
                         ("kimi_linear", kimi_linear))}


def architecture(name: str) -> Architecture:
    """The record named `name`."""
    architecture_config(name)  # the one error for an unknown name
    return ARCHITECTURES[name]


def architecture_of_config(config: Any) -> Architecture:
    """The record whose config class is exactly `type(config)`."""
    for arch in ARCHITECTURES.values():
        if type(config) is arch.config_class:
            return arch
    raise ValueError(f"config: {type(config).__name__} is not the config class of an "
                     f"architecture (known: {sorted(ARCHITECTURES)})")


def architecture_of_hf_config(hf_config: Mapping[str, Any]) -> Architecture:
    """The record named by `architectures` in config.json (checked against `model_type`)."""
    by_hf_name = {a.hf.hf_name: a for a in ARCHITECTURES.values()}
    names = hf_config.get("architectures")
    if not isinstance(names, list) or len(names) != 1:
        raise ValueError(f"config.json: architectures = {names!r}: expected one architecture "
                         f"name (supported: {sorted(by_hf_name)})")
    arch = by_hf_name.get(names[0])
    if arch is None:
        raise ValueError(f"config.json: architecture {names[0]!r} is not supported "
                         f"(supported: {sorted(by_hf_name)})")
    model_type = hf_config.get("model_type")
    if model_type is not None and model_type != arch.hf.model_type:
        raise ValueError(f"config.json: model_type = {model_type!r} does not match architecture "
                         f"{arch.hf.hf_name} (expects {arch.hf.model_type!r})")
    return arch


def create_model(name: str, config: Any, runtime: RuntimeConfig = RuntimeConfig(), *,
                 seed: int = 0, value_head: bool = False, critic: Any = None,
                 mtp_depth: int = 0) -> CausalLM:
    """A randomly initialized model of architecture `name` with `config` (an instance of the
    record's config class), run as `runtime` says; `value_head` adds PPO's critic head,
    `critic` (an architecture config) PPO's critic as a model of its own (`CausalLM`),
    `mtp_depth` > 0 multi-token-prediction modules of that depth (`jtree.models.mtp`)."""
    arch = architecture(name)
    if not isinstance(config, arch.config_class):
        raise ValueError(f"architecture {name!r} needs a {arch.config_class.__name__}, "
                         f"got {type(config).__name__}")
    return CausalLM(config, runtime, rngs=nnx.Rngs(seed), value_head=value_head, critic=critic,
                    mtp_depth=mtp_depth)
