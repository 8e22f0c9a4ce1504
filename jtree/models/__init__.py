"""The Qwen3 model family on tree batches."""

from jtree.models.config import Qwen3Config
from jtree.models.qwen3 import Qwen3

__all__ = ["Qwen3", "Qwen3Config"]
