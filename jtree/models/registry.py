"""Architectures by name, so configs and checkpoints can pick the model class."""

from __future__ import annotations

from typing import Any

from flax import nnx

from jtree.models.config import Qwen3Config
from jtree.models.moe_config import Qwen3MoeConfig, Qwen3NextConfig
from jtree.models.qwen3 import Qwen3
from jtree.models.qwen3_moe import Qwen3Moe
from jtree.models.qwen3_next import Qwen3Next

ARCHITECTURES: dict[str, tuple[type, type]] = {
    "qwen3": (Qwen3Config, Qwen3),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3Moe),
    "qwen3_next": (Qwen3NextConfig, Qwen3Next),
}


def create_model(architecture: str, config: Any, *, seed: int = 0) -> nnx.Module:
    """A randomly initialized model of `architecture` (a key of ARCHITECTURES)."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture: {architecture!r} is not one of {sorted(ARCHITECTURES)}")
    config_cls, model_cls = ARCHITECTURES[architecture]
    if not isinstance(config, config_cls):
        raise ValueError(f"architecture {architecture!r} needs a {config_cls.__name__}, "
                         f"got {type(config).__name__}")
    return model_cls(config, rngs=nnx.Rngs(seed))
