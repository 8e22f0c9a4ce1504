"""Load and save Hugging Face checkpoint directories (config.json + safetensors) as jtree models.

Everything goes through the architecture table (`jtree.hf.architectures`): names, layouts, tied
tensors and placement. Loading validates the whole checkpoint against the model before converting
any weight: unknown architectures, unsupported config fields, missing, extra or misshapen tensors
fail with the tensor's or field's name. torch is never imported.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jtree.hf.architectures import architecture_of_config, architecture_of_hf_config, model_class
from jtree.hf.placement import ShardingFn, mesh_shardings, place
from jtree.hf.safetensors_io import INDEX_FILE, CheckpointTensors, write_checkpoint
from jtree.hf.spec import Architecture, Layout, dotted
from jtree.models.config import DTYPES

CONFIG_FILE = "config.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 2**30
# Files that make a checkpoint directory usable beyond its weights (tokenizer, generation).
COMPANION_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "tokenizer.model",
)
# config.json keys without effect on the math that generation needs: kept by `save(copy_from=)`.
_CARRIED_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def read_hf_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / CONFIG_FILE
    if not path.exists():
        raise ValueError(f"{directory}: no {CONFIG_FILE}")
    try:
        out = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e.msg})") from None
    if not isinstance(out, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return out


class Tensor(NamedTuple):
    """One parameter: its jtree name and shape, its HF name, layout and shape."""

    name: str
    shape: tuple[int, ...]
    hf_name: str
    layout: Layout
    hf_shape: tuple[int, ...]


def _abstract_params(arch: Architecture, config: Any) -> tuple[nnx.GraphDef, list]:
    """Graph definition and flat abstract parameters of `config`'s model, with no weights made."""
    cls = model_class(arch)
    abstract = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(abstract, nnx.Param)  # fails if the model has other state
    return graphdef, list(nnx.to_flat_state(params))


def _tensor_table(arch: Architecture, config: Any, flat: list) -> dict[str, Tensor]:
    """HF name -> Tensor for every parameter of the model, in parameter order."""
    out: dict[str, Tensor] = {}
    for path, var in flat:
        name = dotted(path)
        hf_name, layout = arch.tensor_rule(name)
        struct = jax.ShapeDtypeStruct(var.shape, var.dtype)
        hf_shape = tuple(jax.eval_shape(lambda a: layout.to_hf(a, config), struct).shape)
        if hf_name in out:
            raise ValueError(f"{arch.hf_name}: parameters {out[hf_name].name!r} and {name!r} "
                             f"both map to tensor {hf_name!r}")
        out[hf_name] = Tensor(name, tuple(var.shape), hf_name, layout, hf_shape)
    return out


def _names_list(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _validate(ckpt: CheckpointTensors, arch: Architecture, config: Any,
              expected: Mapping[str, Tensor]) -> None:
    where = ckpt.directory
    tied = arch.tied(config)
    present = set(ckpt.names())
    missing = sorted(set(expected) - present)
    if missing:
        raise ValueError(f"{where}: {arch.hf_name} checkpoint is missing tensor(s) "
                         f"{_names_list(missing)}")
    extra = sorted(present - set(expected) - set(tied))
    if extra:
        raise ValueError(f"{where}: unexpected tensor(s) {_names_list(extra)} for "
                         f"{arch.hf_name} with this config.json")
    for hf_name, t in expected.items():
        got = ckpt.shape(hf_name)
        if got != t.hf_shape:
            raise ValueError(f"{where}: tensor {hf_name!r} has shape {got}, config.json implies "
                             f"{t.hf_shape} ({ckpt.file_of[hf_name]})")
        if ckpt.dtype(hf_name) not in FLOAT_DTYPES:
            raise ValueError(f"{where}: tensor {hf_name!r} has dtype {ckpt.dtype(hf_name)}; only "
                             "floating-point weights are supported (no quantized checkpoints)")
    for alias, source in tied.items():
        if alias in present and not np.array_equal(ckpt.read(alias), ckpt.read(source)):
            raise ValueError(f"{where}: tensor {alias!r} differs from {source!r}, but config.json "
                             "ties them (tie_word_embeddings)")


def load(
    path: str | Path,
    dtype: str = "float32",
    *,
    compute_dtype: str | None = None,
    attention_impl: str = "auto",
    mesh: Mesh | None = None,
    shardings: ShardingFn | None = None,
) -> tuple[Any, nnx.Module]:
    """Read a Hugging Face checkpoint directory into `(config, model)`.

    `dtype` is the parameter (storage) dtype every weight is cast to, `compute_dtype` the
    activation dtype (default: `dtype`), e.g. `dtype="float32", compute_dtype="bfloat16"` for fp32
    master weights with bf16 compute. With `mesh`, parameters are placed by the train step's
    sharding rules (tensor parallel over the axis "model", see `jtree.sharding`); `shardings`
    instead gives any `jax.sharding.Sharding` per (jtree parameter name, shape).
    """
    if mesh is not None and shardings is not None:
        raise ValueError("load: pass mesh or shardings, not both")
    for field, value in (("dtype", dtype), ("compute_dtype", compute_dtype or dtype)):
        if value not in DTYPES:
            raise ValueError(f"load: {field} = {value!r} is not one of {tuple(DTYPES)}")
    directory = Path(path)
    hf_config = read_hf_config(directory)
    arch = architecture_of_hf_config(hf_config)
    runtime = {"attention_impl": attention_impl, "dtype": compute_dtype or dtype,
               "param_dtype": dtype}
    config = arch.config_from_hf(hf_config, runtime)
    graphdef, flat = _abstract_params(arch, config)
    expected = _tensor_table(arch, config, flat)
    sharding_fn = mesh_shardings(arch, config, mesh) if mesh is not None else shardings
    leaves = []
    with CheckpointTensors(directory) as ckpt:
        _validate(ckpt, arch, config, expected)
        for (p, var), t in zip(flat, expected.values()):
            value = t.layout.from_hf(ckpt.read(t.hf_name).astype(var.dtype, copy=False), config)
            leaves.append((p, var.replace(place(value, t.name, sharding_fn))))
    return config, nnx.merge(graphdef, nnx.from_flat_state(leaves))


def to_hf_tensors(params: nnx.State | nnx.Module, config: Any, dtype: str | None = None
                  ) -> dict[str, np.ndarray]:
    """Parameters (or anything with their structure, such as gradients) as HF-named host arrays
    in HF layout, optionally cast to `dtype`. Tied HF tensors are not repeated."""
    arch = architecture_of_config(config)
    if isinstance(params, nnx.Module):
        params = nnx.state(params, nnx.Param)
    out = {}
    for p, var in nnx.to_flat_state(params):
        hf_name, layout = arch.tensor_rule(dotted(p))
        value = np.asarray(layout.to_hf(np.asarray(var.get_value()), config))
        out[hf_name] = value if dtype is None else value.astype(DTYPES[dtype])
    return out


def _prepare_directory(directory: Path, overwrite: bool) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    old = [directory / CONFIG_FILE, directory / INDEX_FILE, *directory.glob("*.safetensors")]
    old = [f for f in old if f.exists()]
    if old and not overwrite:
        raise ValueError(f"{directory}: already holds a checkpoint ({old[0].name}); pass "
                         "overwrite=True to replace it")
    for f in old:
        f.unlink()


def save(
    model: nnx.Module,
    config: Any,
    path: str | Path,
    *,
    dtype: str | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    copy_from: str | Path | None = None,
    overwrite: bool = False,
) -> None:
    """Write `model` as a Hugging Face checkpoint directory that `from_pretrained` loads.

    Weights are stored in `dtype` (default: the model's parameter dtype), in one
    `model.safetensors` or in shards of at most `max_shard_size` bytes with an index. `copy_from`
    names the directory the model was loaded from: its tokenizer and generation files and token
    ids are carried over, so the result is a complete model for transformers.
    """
    arch = architecture_of_config(config)
    if not isinstance(model, model_class(arch)):
        raise ValueError(f"save: model is a {type(model).__name__}, config describes "
                         f"{model_class(arch).__name__}")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"save: dtype = {dtype!r} is not one of {tuple(DTYPES)}")
    _, flat_expected = _abstract_params(arch, config)
    expected = _tensor_table(arch, config, flat_expected)
    params = {dotted(p): var for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    extra = sorted(set(params) - {t.name for t in expected.values()})
    if extra:
        raise ValueError(f"save: model parameter {extra[0]!r} is not part of {arch.hf_name} "
                         "with this config")
    tensors = []
    for t in expected.values():
        var = params.get(t.name)
        if var is None:
            raise ValueError(f"save: model has no parameter {t.name!r} (tensor {t.hf_name!r})")
        if tuple(var.shape) != t.shape:
            raise ValueError(f"save: parameter {t.name!r} has shape {tuple(var.shape)}, config "
                             f"implies {t.shape}")
        out_dtype = np.dtype(DTYPES[dtype] if dtype else var.dtype)

        def produce(var=var, layout=t.layout, out_dtype=out_dtype):
            return np.asarray(layout.to_hf(np.asarray(var.get_value()), config)).astype(out_dtype)

        tensors.append((t.hf_name, t.hf_shape, out_dtype, produce))
    hf_config = {"architectures": [arch.hf_name], **arch.config_to_hf(config),
                 "torch_dtype": tensors[0][2].name}
    if copy_from is not None:
        source_config = read_hf_config(copy_from)
        hf_config.update({k: source_config[k] for k in _CARRIED_KEYS if k in source_config})
    directory = Path(path)
    _prepare_directory(directory, overwrite)
    write_checkpoint(directory, tensors, max_shard_size=max_shard_size)
    if copy_from is not None and Path(copy_from).resolve() != directory.resolve():
        for name in COMPANION_FILES:
            if (Path(copy_from) / name).is_file():
                shutil.copyfile(Path(copy_from) / name, directory / name)
    (directory / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
