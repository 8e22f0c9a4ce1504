"""The decoder stack on tree batches, its architectures and how to run it."""

from jtree.config.architectures import (
           DecoderSpec,
           LayerKind,
           Qwen3Config,
           Qwen3MoeConfig,
           Qwen3NextConfig,
)
from jtree.config.runtime import RuntimeConfig
from jtree.models.architectures import ARCHITECTURES, Architecture, architecture, create_model
from jtree.models.decoder import CausalLM
from jtree.models.output import ModelOutput

__all__ = ["ARCHITECTURES", "Architecture", "CausalLM", "DecoderSpec", "LayerKind",
           "ModelOutput", "Qwen3Config", "Qwen3MoeConfig", "Qwen3NextConfig", "RuntimeConfig",
           "architecture", "create_model"]
