"""Run configs: typed, frozen sections read from YAML, every key checked against its type.

The bottom layer of jtree besides the kernels: it imports nothing else of jtree, so any layer may
read its own section, and a config is read without loading a step, a planner or a model.
"""

from jtree.config.architectures import (
    ARCHITECTURE_CONFIGS,
    DecoderSpec,
    LayerKind,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
    architecture_config,
)
from jtree.config.model import LoraConfig, ModelSpec
from jtree.config.objective import CriticConfig, Objective, OptimConfig
from jtree.config.run import (
    CheckpointConfig,
    DataConfig,
    MeshConfig,
    RunConfig,
    TrainConfig,
    config_values,
    load_config,
)
from jtree.config.runtime import RuntimeConfig
from jtree.config.schema import apply_overrides, from_dict

__all__ = [
    "ARCHITECTURE_CONFIGS", "CheckpointConfig", "CriticConfig", "DataConfig", "DecoderSpec",
    "LayerKind", "LoraConfig", "MeshConfig", "ModelSpec", "Objective", "OptimConfig",
    "Qwen3Config", "Qwen3MoeConfig", "Qwen3NextConfig", "RunConfig", "RuntimeConfig",
    "TrainConfig", "apply_overrides", "architecture_config", "config_values", "from_dict",
    "load_config",
]
