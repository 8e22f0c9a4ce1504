"""The decoder stack on tree batches, its architectures and how to run it."""

from jtree.models.architectures import ARCHITECTURES, Architecture, architecture, create_model
from jtree.config.architectures import Qwen3Config
from jtree.config.architectures import Qwen3MoeConfig
from jtree.config.architectures import Qwen3NextConfig
from jtree.models.decoder import CausalLM
from jtree.config.architectures import DecoderSpec, LayerKind
from jtree.models.output import ModelOutput
from jtree.config.runtime import RuntimeConfig

__all__ = ["ARCHITECTURES", "Architecture", "CausalLM", "DecoderSpec", "LayerKind",
           "ModelOutput", "Qwen3Config", "Qwen3MoeConfig", "Qwen3NextConfig", "RuntimeConfig",
           "architecture", "create_model"]
