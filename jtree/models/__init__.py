"""The decoder stack on tree batches, its architectures and how to run it."""

from jtree.models.architectures import ARCHITECTURES, Architecture, architecture, create_model
from jtree.models.architectures.qwen3 import Qwen3Config
from jtree.models.architectures.qwen3_moe import Qwen3MoeConfig
from jtree.models.architectures.qwen3_next import Qwen3NextConfig
from jtree.models.decoder import CausalLM, DecoderSpec, LayerKind
from jtree.models.output import ModelOutput
from jtree.models.runtime import RuntimeConfig

__all__ = ["ARCHITECTURES", "Architecture", "CausalLM", "DecoderSpec", "LayerKind",
           "ModelOutput", "Qwen3Config", "Qwen3MoeConfig", "Qwen3NextConfig", "RuntimeConfig",
           "architecture", "create_model"]
