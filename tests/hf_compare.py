"""Copy weights between Hugging Face PyTorch models and jtree NNX models by parameter name.

jtree mirrors HF names; NNX `Linear.kernel` is HF `weight` transposed and `Embed.embedding` is HF
`embed_tokens.weight`. Every other parameter has HF's name and layout.
"""

from __future__ import annotations

import numpy as np
from flax import nnx


def hf_name(path: tuple) -> tuple[str, bool]:
    """(HF parameter name, whether the array is transposed) of an NNX parameter path."""
    name = ".".join(map(str, path))
    if name.endswith(".kernel"):
        return name[: -len(".kernel")] + ".weight", True
    if name.endswith(".embedding"):
        return name[: -len(".embedding")] + ".weight", False
    return name, False


def copy_hf_weights(model: nnx.Module, hf_state: dict[str, np.ndarray]) -> None:
    """Overwrite every parameter of `model` with the same-named HF tensor (all must exist)."""
    state = nnx.state(model, nnx.Param)
    flat = nnx.to_flat_state(state)
    used = set()
    for path, var in flat:
        name, transpose = hf_name(path)
        value = np.asarray(hf_state[name], np.float32)
        value = value.T if transpose else value
        if value.shape != var[...].shape:
            raise ValueError(f"{name}: HF shape {value.shape} != jtree shape {var[...].shape}")
        var.value = value
        used.add(name)
    unused = set(hf_state) - used
    if unused:
        raise ValueError(f"HF parameters without a jtree counterpart: {sorted(unused)}")
    nnx.update(model, nnx.from_flat_state(flat))
