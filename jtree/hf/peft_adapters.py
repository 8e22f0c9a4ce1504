"""LoRA adapters written unmerged, in the format of Hugging Face peft: `adapter_config.json` and
`adapter_model.safetensors`, which `peft.PeftModel.from_pretrained(base, directory)` loads onto
the base model, and which servers that take peft adapters (vLLM, SGLang) read.

Why a second export next to `--merge-lora`: a merged model is a full copy of the weights per
fine-tune, while adapters are r x (in + out) numbers per targeted kernel, served many at a time
over one base.

The math is the same: peft's LoRA layer computes W x + (lora_alpha / r) B_pt A_pt x with
A_pt = lora_A.weight [r, in] and B_pt = lora_B.weight [out, r], torch's [out, in] order. jtree
holds A [in, r] and B [r, out] beside the kernel W [in, out] (`jtree.models.lora`), so
A_pt = A^T and B_pt = B^T, and `lora_alpha` and `r` are the run's `alpha` and `rank`.

Tensor names come from the architecture's Hugging Face mapping (`jtree.models.hf_mapping`): the kernel at
`model.layers.0.self_attn.q_proj.kernel` is the HF tensor `model.layers.0.self_attn.q_proj.weight`,
so its module is `model.layers.0.self_attn.q_proj` and its adapters are
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` / `.lora_B.weight` (peft's
saved names: its wrapper's `base_model.model.` prefix, the adapter name left out). A scanned
model's stacked adapters are written per layer. `target_modules` lists the targeted modules by
their full names, which peft matches exactly, so an adapter lands on no module it was not
trained for. torch is never imported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
from safetensors.numpy import save_file

from jtree.config.model import LoraConfig
from jtree.config.runtime import DTYPES
from jtree.models import architectures
from jtree.models.hf_mapping import dotted
from jtree.models.lora import KERNEL, LoraParams
from jtree.parallel.layer_stack import layer_groups, unstack_flat

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # peft's PeftModelForCausalLM -> LoraModel -> the HF model
# PPO's critic (a value head on the trunk, or a model of its own): not part of the HF causal LM
# the adapters apply to, so adapters on its kernels are left out, as the model export leaves it.
CRITIC_PARTS = ("value_head", "critic")


def _key(part: Any) -> str | int:
    """A tree path entry as an nnx path entry: adapters are nested dicts keyed by the strings of
    the kernel's path ('0' for layer 0), nnx paths index layers by int."""
    name = str(getattr(part, "key", part))
    return int(name) if name.isdigit() else name


def _adapter_pairs(adapters: Any) -> list[tuple[tuple, tuple[np.ndarray, np.ndarray]]]:
    """(kernel path, (A, B)) for every targeted kernel of the causal LM, in parameter order."""
    pairs: dict[tuple, dict[str, np.ndarray]] = {}
    for path, x in jax.tree_util.tree_flatten_with_path(adapters)[0]:
        *stem, which = (_key(p) for p in path)
        if stem[0] in CRITIC_PARTS:
            continue
        pairs.setdefault((*stem, KERNEL), {})[which] = np.asarray(x)
    return [(path, (ab["lora_a"], ab["lora_b"])) for path, ab in pairs.items()]


def _module_name(arch: Any, config: Any, kernel: str, din: int, dout: int) -> str:
    """The HF module whose `weight` [out, in] is the kernel at `kernel` [in, out] transposed;
    an error naming the kernel when the architecture stores it any other way (peft's adapter
    then would not be the run's)."""
    storages = arch.storages(kernel, (din, dout), config)
    storage = storages[0]
    probe = np.arange(din * dout, dtype=np.float32).reshape(din, dout)
    if (len(storage.hf_names) != 1 or not storage.hf_names[0].endswith(".weight")
            or not np.array_equal(np.asarray(storage.part(probe, 0)), probe.T)):
        raise ValueError(f"peft adapters: kernel {kernel!r} is not stored as a transposed "
                         f"torch Linear weight ({storage.hf_names[0]!r}), which peft's LoRA "
                         "needs")
    return storage.hf_names[0][: -len(".weight")]


def peft_adapter_tensors(params: LoraParams, config: Any, dtype: str | None = None
                         ) -> dict[str, np.ndarray]:
    """The adapters of a LoRA run as peft's saved tensors, by name (see the module docstring),
    in `dtype` (default: the adapters' own)."""
    arch = architectures.architecture_of_config(config).hf
    per_layer = unstack_flat(_adapter_pairs(params.adapters), layer_groups(config.decoder().layers),
                             lambda ab, r: (ab[0][r], ab[1][r]))
    out = {}
    for path, (a, b) in per_layer:
        module = _module_name(arch, config, dotted(path), a.shape[-2], b.shape[-1])
        for name, value in (("lora_A", a.T), ("lora_B", b.T)):
            value = value if dtype is None else value.astype(DTYPES[dtype])
            out[f"{PEFT_PREFIX}{module}.{name}.weight"] = np.ascontiguousarray(value)
    return out


def peft_adapter_config(lora: LoraConfig, modules: list[str],
                        base_model: str | None = None) -> dict[str, Any]:
    """adapter_config.json of adapters on `modules` (full HF module names): plain LoRA (no
    dropout, no bias, no rsLoRA or DoRA scaling), the fields peft and the servers read."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "target_modules": modules,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def save_peft_adapters(params: LoraParams, lora: LoraConfig, config: Any, path: str | Path, *,
                       dtype: str | None = None, base_model: str | None = None,
                       overwrite: bool = False) -> None:
    """Write the adapters of a LoRA run (`params`, trained with `lora` on a model of `config`) to
    the directory `path` as peft does: adapter_config.json and adapter_model.safetensors.
    `base_model` is recorded as `base_model_name_or_path` (what `AutoModelForCausalLM` loads
    under the adapters when given the adapter directory alone)."""
    if not isinstance(params, LoraParams):
        raise ValueError("peft adapters: the parameters are not a model.lora run's")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"peft adapters: dtype = {dtype!r} is not one of {tuple(DTYPES)}")
    if not np.isclose(params.scale, lora.alpha / lora.rank, rtol=1e-12, atol=0):
        raise ValueError(f"peft adapters: the run's adapter scale {params.scale} is not "
                         f"alpha / rank = {lora.alpha} / {lora.rank} of model.lora")
    tensors = peft_adapter_tensors(params, config, dtype)
    if not tensors:
        raise ValueError("peft adapters: model.lora.targets select only the critic's kernels, "
                         "which the causal LM does not have")
    ranks = {v.shape[0] for k, v in tensors.items() if k.endswith(".lora_A.weight")}
    if ranks != {lora.rank}:
        raise ValueError(f"peft adapters: adapters of rank {sorted(ranks)}, model.lora.rank is "
                         f"{lora.rank}")
    modules = [k[len(PEFT_PREFIX): -len(".lora_A.weight")] for k in tensors
               if k.endswith(".lora_A.weight")]
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    files = [directory / ADAPTER_CONFIG_FILE, directory / ADAPTER_WEIGHTS_FILE]
    if not overwrite and any(f.exists() for f in files):
        raise ValueError(f"{directory}: already holds peft adapters; pass overwrite=True to "
                         "replace them")
    save_file(tensors, str(files[1]), metadata={"format": "pt"})
    config_json = peft_adapter_config(lora, modules, base_model)
    files[0].write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
