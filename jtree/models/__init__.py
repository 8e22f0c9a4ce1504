"""The Qwen3 model family on tree batches."""

from jtree.models.config import Qwen3Config
from jtree.models.moe_config import Qwen3MoeConfig, Qwen3NextConfig
from jtree.models.output import ModelOutput
from jtree.models.qwen3 import Qwen3
from jtree.models.qwen3_moe import Qwen3Moe
from jtree.models.qwen3_next import Qwen3Next
from jtree.models.registry import ARCHITECTURES, create_model

__all__ = ["ARCHITECTURES", "ModelOutput", "Qwen3", "Qwen3Config", "Qwen3Moe", "Qwen3MoeConfig",
           "Qwen3Next", "Qwen3NextConfig", "create_model"]
