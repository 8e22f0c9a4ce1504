"""The Qwen3 model family on tree batches."""

from jtree.models.config import Qwen3Config
from jtree.models.output import ModelOutput
from jtree.models.qwen3 import Qwen3
from jtree.models.registry import ARCHITECTURES, create_model

__all__ = ["ARCHITECTURES", "ModelOutput", "Qwen3", "Qwen3Config", "create_model"]
