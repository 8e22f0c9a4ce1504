"""Hugging Face checkpoints on the jtree side (no torch needed): random tiny models to save, their
parameters by name, edited copies of a saved checkpoint, and weights copied in by HF name.

jtree mirrors HF names; NNX `Linear.kernel` is HF `weight` transposed and `Embed.embedding` is HF
`embed_tokens.weight`. Every other parameter has HF's name and layout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from jtree.config.architectures import Qwen3Config
from jtree.hf.safetensors_io import SINGLE_FILE
from jtree.models import CausalLM
from tests.models_util import tiny_config, tiny_lm


def random_model(seed: int = 0, runtime: dict | None = None,
                 **overrides) -> tuple[Qwen3Config, CausalLM]:
    """A tiny Qwen3 whose every parameter (norms and biases included) is random, so a swapped or
    mis-transposed tensor cannot go unnoticed."""
    cfg = tiny_config(**overrides)
    graphdef, params = nnx.split(tiny_lm(cfg, seed, **(runtime or {})), nnx.Param)
    rng = np.random.default_rng(seed)
    flat = [(p, v.replace(jnp.asarray(np.asarray(v.get_value(), np.float32)
                                      + rng.normal(0, 0.2, v.shape), v.dtype)))
            for p, v in nnx.to_flat_state(params)]
    return cfg, nnx.merge(graphdef, nnx.from_flat_state(flat))


def param_arrays(model: nnx.Module) -> dict[str, np.ndarray]:
    """Every parameter of `model` by its dotted NNX path."""
    return {".".join(map(str, p)): np.asarray(v.get_value())
            for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def assert_same_params(a: nnx.Module, b: nnx.Module) -> None:
    """The same parameter names, dtypes and values, bit for bit."""
    pa, pb = param_arrays(a), param_arrays(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert pa[k].dtype == pb[k].dtype, k
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)


def copy_checkpoint(src: Path, dst: Path, *, edit_tensors: Callable[[dict], object] | None = None,
                    edit_config: Callable[[dict], object] | None = None) -> Path:
    """A copy of a single-file checkpoint with its tensors and/or config.json edited (how the
    tests make the damaged or unusual checkpoints that loading must refuse or accept)."""
    dst.mkdir(exist_ok=True)
    tensors = load_file(str(src / SINGLE_FILE))
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, str(dst / SINGLE_FILE), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


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


# Hub checkpoints of Qwen3-Next and Qwen3.5 carry one MTP layer (`mtp_num_hidden_layers: 1`)
# named like a full-attention decoder layer under `mtp.layers.0.`, plus these four tensors
# (vLLM's qwen3_next_mtp.py / qwen3_5_mtp.py read the same names).
MTP_EXTRA = {"mtp.fc.weight": "fc", "mtp.norm.weight": "norm",
             "mtp.pre_fc_norm_hidden.weight": "hidden",
             "mtp.pre_fc_norm_embedding.weight": "embedding"}


def _with_random_mtp(tensors: dict, layer_prefix: str, extras: list[str], fc: str, hidden: int,
                     seed: int) -> None:
    """Add random MTP tensors: the last decoder layer's tensors renamed to `layer_prefix`, the
    fc `fc` [hidden, 2 hidden] and the norms `extras` [hidden]."""
    rng = np.random.default_rng(seed)
    last = decoder_layers(tensors) - 1
    for name in [n for n in tensors if n.startswith(f"model.layers.{last}.")]:
        tensors[name.replace(f"model.layers.{last}.", layer_prefix)] = rng.normal(
            size=tensors[name].shape).astype(np.float32)
    for name in extras:
        tensors[name] = rng.normal(size=(hidden, 2 * hidden) if name == fc else (hidden,)
                                   ).astype(np.float32)


def decoder_layers(tensors: dict) -> int:
    """How many decoder layers `model.layers.N` the checkpoint's tensors hold."""
    return 1 + max(int(n.split(".")[2]) for n in tensors if n.startswith("model.layers."))


def with_mtp_tensors(tensors: dict, hidden: int, seed: int = 5) -> None:
    """Add random Hub-named MTP tensors: the last (full-attention) layer's tensors renamed to
    `mtp.layers.0.`, and the fc [hidden, 2 hidden] and three norms."""
    _with_random_mtp(tensors, "mtp.layers.0.", list(MTP_EXTRA), "mtp.fc.weight", hidden, seed)


# DeepSeek-V3's MTP module is one more decoder layer, `model.layers.{num_hidden_layers}.`, with
# these tensors (HF name under that prefix -> jtree's `mtp.` module) beside the layer's own, and
# copies of the main embedding and head (`embed_tokens`, `shared_head.head`): the DeepSeek-V3
# repository's README_WEIGHTS.md; vLLM's deepseek_mtp.py reads the same names.
DEEPSEEK_MTP_EXTRA = {"enorm.weight": "pre_fc_norm_embedding",
                      "hnorm.weight": "pre_fc_norm_hidden", "eh_proj.weight": "fc",
                      "shared_head.norm.weight": "norm"}


def with_deepseek_mtp_layer(tensors: dict, hidden: int, seed: int = 5) -> str:
    """Add a random Hub-form DeepSeek-V3 MTP layer: the last (MoE) decoder layer's tensors, the
    four of `DEEPSEEK_MTP_EXTRA` and the two copies, under `model.layers.{num_hidden_layers}.`,
    which is returned."""
    prefix = f"model.layers.{decoder_layers(tensors)}."
    _with_random_mtp(tensors, prefix, [prefix + n for n in DEEPSEEK_MTP_EXTRA],
                     prefix + "eh_proj.weight", hidden, seed)
    tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].copy()
    tensors[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].copy()
    return prefix
