"""Load and save Hugging Face checkpoint directories (config.json + safetensors) as jtree models.

Everything goes through the architecture records' Hugging Face mappings
(`jtree.models.architectures`, `jtree.models.hf_mapping.HfMapping`): names, layouts (one
jtree parameter may be several HF tensors, e.g. one per expert), tied and ignored tensors, and
placement. Loading validates the whole checkpoint against the model before converting any weight:
unknown architectures, unsupported config fields, missing, extra or misshapen tensors fail with
the tensor's or field's name. torch is never imported.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jtree.config.runtime import DTYPES, RuntimeConfig
from jtree.hf.placement import ShardingFn, mesh_shardings, place
from jtree.hf.safetensors_io import INDEX_FILE, CheckpointTensors, write_checkpoint
from jtree.models import architectures
from jtree.models.decoder import CausalLM
from jtree.models.hf_mapping import HfMapping, Storage, dotted, with_config_fields
from jtree.parallel.layer_stack import layer_groups, layer_paths, layer_sharding, unstack_flat

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


def read_model_config(directory: str | Path) -> Any:
    """The architecture config (an instance of the record's config class) of the model the
    checkpoint directory's config.json describes."""
    hf_config = read_hf_config(directory)
    return architectures.architecture_of_hf_config(hf_config).hf.config_from_hf(hf_config)


class Param(NamedTuple):
    """A jtree parameter (dotted name, shape) and the ways it may be stored, the saved one first."""

    name: str
    shape: tuple[int, ...]
    storages: list[Storage]


def _abstract_params(config: Any, runtime: RuntimeConfig, mtp_depth: int = 0
                     ) -> tuple[nnx.GraphDef, list]:
    """Graph definition and flat abstract parameters of `config`'s model (with MTP modules of
    `mtp_depth`), with no weights made."""
    mtp = architectures.architecture_of_config(config).hf.mtp
    if mtp_depth and mtp is None:
        raise ValueError(f"mtp_depth: {type(config).__name__} checkpoints carry no "
                         "multi-token-prediction tensors that jtree reads")
    if mtp_depth and mtp.max_depth is not None and mtp_depth > mtp.max_depth:
        raise ValueError(f"mtp_depth: {mtp_depth} > {mtp.max_depth}, the most MTP depths "
                         f"{type(config).__name__} checkpoints give jtree (each of their depths "
                         "has its own fc and input norms; jtree's depths share one)")
    abstract = nnx.eval_shape(lambda: CausalLM(config, runtime, rngs=nnx.Rngs(0),
                                               mtp_depth=mtp_depth))
    graphdef, params = nnx.split(abstract, nnx.Param)  # fails if the model has other state
    return graphdef, list(nnx.to_flat_state(params))


def carries_mtp(config: Any) -> bool:
    """Whether checkpoints of `config`'s architecture have a place for multi-token-prediction
    tensors (Qwen3-Next's and Qwen3.5's `mtp.*`, DeepSeek-V3's layer `num_hidden_layers`;
    `HfMapping.mtp`), which `load(..., mtp_depth=...)` reads and `save` writes."""
    return architectures.architecture_of_config(config).hf.mtp is not None


def mtp_depth_in(path: str | Path) -> int:
    """How many MTP layers the checkpoint directory `path` carries beside its shared fc, up to
    the most its architecture maps (`MtpTensors.max_depth`): the largest `mtp_depth` `load` can
    read from it (0: none)."""
    config = read_model_config(path)
    mtp = architectures.architecture_of_config(config).hf.mtp
    if mtp is None:
        return 0
    with CheckpointTensors(path) as ckpt:
        names = set(ckpt.names())
    if with_config_fields(mtp.fc, config) not in names:
        return 0
    depth = 0
    while mtp.max_depth is None or depth < mtp.max_depth:
        layer = with_config_fields(mtp.layer, config, depth=depth)
        if not any(n.startswith(layer) for n in names):
            break
        depth += 1
    return depth


def _mtp_copies(arch: HfMapping, config: Any) -> dict[str, str]:
    """The MTP modules' copies of main-model tensors (copy -> the stored tensor it equals)."""
    if arch.mtp is None:
        return {}
    tied = arch.tied(config)
    out = {}
    for copy, source in arch.mtp.copies.items():
        source = with_config_fields(source, config)
        out[with_config_fields(copy, config)] = tied.get(source, source)
    return out


def _param_table(arch: HfMapping, config: Any, flat: list) -> list[Param]:
    """Every parameter of the model, in parameter order, with its storages."""
    out, owner = [], {}
    for path, var in flat:
        name = dotted(path)
        storages = arch.storages(name, tuple(var.shape), config)
        for hf_name in {n for s in storages for n in s.hf_names}:
            if owner.setdefault(hf_name, name) != name:
                raise ValueError(f"{arch.hf_name}: parameters {owner[hf_name]!r} and {name!r} "
                                 f"both map to tensor {hf_name!r}")
        out.append(Param(name, tuple(var.shape), storages))
    return out


def _names_list(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def choose_storage(param: Param, available: set[str] | frozenset[str]) -> Storage | None:
    """The first storage of `param` whose tensors are all in `available` (None if there is none).
    This is how a checkpoint's layout is detected, per parameter, from its tensor names."""
    for storage in param.storages:
        if all(n in available for n in storage.hf_names):
            return storage
    return None


def _closest_storage(param: Param, available: set[str]) -> Storage:
    """The storage most of whose tensors are present (the saved one on a tie): the one whose
    missing tensors an error should name."""
    return max(param.storages, key=lambda s: sum(n in available for n in s.hf_names))


def _validate(ckpt: CheckpointTensors, arch: HfMapping, config: Any, params: list[Param],
              mtp_depth: int) -> list[Storage]:
    """The storage of every parameter in this checkpoint, after checking names, shapes, dtypes,
    tied tensors and (with MTP modules, `mtp_depth` > 0) the MTP modules' copies."""
    where = ckpt.directory
    tied = arch.tied(config)
    present = set(ckpt.names())
    chosen, missing = [], []
    for param in params:
        storage = choose_storage(param, present)
        if storage is None:
            storage = _closest_storage(param, present)
            missing += [n for n in storage.hf_names if n not in present]
        chosen.append(storage)
    if missing:
        raise ValueError(f"{where}: {arch.hf_name} checkpoint is missing tensor(s) "
                         f"{_names_list(missing)}")
    used = {n for s in chosen for n in s.hf_names}
    extra = sorted(n for n in present - used - set(tied) if not arch.is_ignored(n, config))
    if extra:
        raise ValueError(f"{where}: unexpected tensor(s) {_names_list(extra)} for "
                         f"{arch.hf_name} with this config.json")
    for storage in chosen:
        for hf_name, hf_shape in zip(storage.hf_names, storage.hf_shapes):
            got = ckpt.shape(hf_name)
            if got != hf_shape:
                raise ValueError(f"{where}: tensor {hf_name!r} has shape {got}, config.json "
                                 f"implies {hf_shape} ({ckpt.where(hf_name)})")
            if ckpt.dtype(hf_name) not in FLOAT_DTYPES:
                raise ValueError(f"{where}: tensor {hf_name!r} has dtype {ckpt.dtype(hf_name)}; "
                                 "only floating-point weights and MXFP4 pairs are read (no "
                                 "other quantized checkpoints)")
    for alias, source in tied.items():
        if alias in present and not np.array_equal(ckpt.read(alias), ckpt.read(source)):
            raise ValueError(f"{where}: tensor {alias!r} differs from {source!r}, but config.json "
                             "ties them (tie_word_embeddings)")
    for copy, source in (_mtp_copies(arch, config) if mtp_depth else {}).items():
        if copy in present and not np.array_equal(ckpt.read(copy), ckpt.read(source)):
            raise ValueError(f"{where}: tensor {copy!r} differs from {source!r}, of which the "
                             "multi-token-prediction module holds a copy")
    return chosen


def load(
    path: str | Path,
    runtime: RuntimeConfig = RuntimeConfig(),
    *,
    mesh: Mesh | None = None,
    shardings: ShardingFn | None = None,
    mtp_depth: int = 0,
) -> tuple[Any, CausalLM]:
    """Read a Hugging Face checkpoint directory into `(config, model)`: the architecture config
    of the record config.json names, and the model run as `runtime` says
    (`runtime.param_dtype` is the storage dtype every weight is cast to, `runtime.dtype` the
    activation dtype, e.g. float32 and bfloat16 for fp32 master weights with bf16 compute).
    Experts load from one tensor per expert (Hub) or the fused transformers 5
    tensors, detected per parameter from the tensor names. With `mesh`, parameters are placed by
    the train step's sharding rules (tensor parallel over the axis "model", `jtree.parallel.sharding`), so
    a loaded model is where training expects it; `shardings` instead gives any
    `jax.sharding.Sharding` per (jtree parameter name, shape). `mtp_depth` > 0 also reads
    the multi-token-prediction modules (`jtree.models.mtp`) from the checkpoint's `mtp.*`
    tensors (Qwen3-Next's and Qwen3.5's `mtp.*`, DeepSeek-V3's layer `num_hidden_layers`,
    `HfMapping.mtp`); otherwise those are skipped.
    """
    if mesh is not None and shardings is not None:
        raise ValueError("load: pass mesh or shardings, not both")
    directory = Path(path)
    config = read_model_config(directory)
    arch = architectures.architecture_of_config(config).hf
    _, per_layer = _abstract_params(config, dataclasses.replace(runtime, scan_layers=False),
                                    mtp_depth)
    params = _param_table(arch, config, per_layer)
    graphdef, flat = _abstract_params(config, runtime, mtp_depth)
    groups = layer_groups(config.decoder().layers)
    sharding_fn = mesh_shardings(config, mesh) if mesh is not None else shardings
    leaves = []
    with CheckpointTensors(directory) as ckpt:
        stored = {param.name: (param, storage) for param, storage
                  in zip(params, _validate(ckpt, arch, config, params, mtp_depth))}

        def read(name: str, dtype: np.dtype, sharding: jax.sharding.Sharding | None) -> jax.Array:
            param, storage = stored[name]
            value = storage.join([ckpt.read(n).astype(dtype, copy=False)
                                  for n in storage.hf_names])
            return place(value, name, sharding_fn if sharding is None else lambda *_: sharding)

        for p, var in flat:
            layers = layer_paths(p, groups)
            if layers is None:
                leaves.append((p, var.replace(read(dotted(p), var.dtype, None))))
                continue
            # A scanned model's stacked parameter: its layers are read and placed one by one
            # (as the stacked value's shards of them), then stacked on the devices.
            sharding = None if sharding_fn is None else sharding_fn(dotted(p), tuple(var.shape))
            one = None if sharding is None else layer_sharding(sharding, scanned=False)
            values = [read(dotted(lp), var.dtype, one) for lp in layers]
            stacked = (jnp.stack(values) if sharding is None
                       else jax.jit(jnp.stack, out_shardings=sharding)(values))
            leaves.append((p, var.replace(stacked)))
            del values
    return config, nnx.merge(graphdef, nnx.from_flat_state(leaves))


def to_hf_tensors(params: nnx.State | nnx.Module, config: Any, dtype: str | None = None, *,
                  names: set[str] | frozenset[str] | None = None) -> dict[str, np.ndarray]:
    """Parameters (or anything with their structure, such as gradients) as HF-named host arrays
    in HF layout, optionally cast to `dtype`. Tied HF tensors are not repeated.

    By default every parameter is laid out as `save` writes it (experts one tensor per expert);
    with `names` (e.g. a transformers model's `named_parameters()`), in the layout whose tensor
    names are all in `names` (experts fused, as transformers 5 holds them in memory).
    """
    arch = architectures.architecture_of_config(config).hf
    if isinstance(params, nnx.Module):
        params = nnx.state(params, nnx.Param)
    out = {}
    for p, var in _per_layer(params, config):
        value = np.asarray(var.get_value())
        param = Param(dotted(p), value.shape, arch.storages(dotted(p), value.shape, config))
        storage = param.storages[0] if names is None else choose_storage(param, names)
        if storage is None:
            raise ValueError(f"to_hf_tensors: no layout of parameter {param.name!r} has all its "
                             f"tensors in `names` (e.g. {param.storages[0].hf_names[0]!r})")
        for i, hf_name in enumerate(storage.hf_names):
            part = np.asarray(storage.part(value, i))
            out[hf_name] = part if dtype is None else part.astype(DTYPES[dtype])
    return out


class _LayerOf(NamedTuple):
    """Entry `index` of a scanned model's stacked parameter: one layer's, taken off the device
    only when it is written."""

    stacked: nnx.Variable
    index: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.stacked.shape[1:])

    @property
    def dtype(self) -> np.dtype:
        return self.stacked.dtype

    def get_value(self) -> jax.Array:
        return self.stacked.get_value()[self.index]


def _per_layer(params: nnx.State, config: Any) -> list[tuple[tuple, Any]]:
    """Flat (path, variable) pairs of `params` under per-layer (Hugging Face) names: a scanned
    model's stacked parameters as one `_LayerOf` per layer (`jtree.parallel.layer_stack`)."""
    return unstack_flat(list(nnx.to_flat_state(params)), layer_groups(config.decoder().layers),
                        _LayerOf)


class _HostCopy:
    """The host copy of the parameter being written, kept while its tensors are produced (a
    parameter's tensors are consecutive, so each parameter leaves the device once)."""

    def __init__(self) -> None:
        self._name, self._value = None, None

    def __call__(self, name: str, var: nnx.Variable | _LayerOf) -> np.ndarray:
        if name != self._name:
            self._name, self._value = None, None  # drop the previous copy first
            self._value, self._name = np.asarray(var.get_value()), name
        return self._value


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
    model: CausalLM,
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
    ids are carried over, so the result is a complete model for transformers. MTP modules are
    written where the architecture's checkpoints keep them (`HfMapping.mtp`), with the copies
    of main-model tensors those hold.
    """
    arch = architectures.architecture_of_config(config).hf
    if type(model.config) is not type(config):
        raise ValueError(f"save: model is a {type(model.config).__name__} model, config is a "
                         f"{type(config).__name__}")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"save: dtype = {dtype!r} is not one of {tuple(DTYPES)}")
    mtp_depth = 0 if model.mtp is None else model.mtp.depth
    _, flat_expected = _abstract_params(
        config, dataclasses.replace(model.runtime, scan_layers=False), mtp_depth)
    expected = _param_table(arch, config, flat_expected)
    params = {dotted(p): var for p, var in _per_layer(nnx.state(model, nnx.Param), config)}
    extra = sorted(set(params) - {t.name for t in expected})
    if extra:
        raise ValueError(f"save: model parameter {extra[0]!r} is not part of {arch.hf_name} "
                         "with this config")
    host = _HostCopy()
    tensors = []
    for t in expected:
        var = params.get(t.name)
        storage = t.storages[0]
        if var is None:
            raise ValueError(f"save: model has no parameter {t.name!r} "
                             f"(tensor {storage.hf_names[0]!r})")
        if tuple(var.shape) != t.shape:
            raise ValueError(f"save: parameter {t.name!r} has shape {tuple(var.shape)}, config "
                             f"implies {t.shape}")
        strict = any(re.fullmatch(p, t.name) for p in arch.float32)
        out_dtype = np.dtype(DTYPES[dtype] if dtype and not strict else var.dtype)
        for i, (hf_name, hf_shape) in enumerate(zip(storage.hf_names, storage.hf_shapes)):

            def produce(name=t.name, var=var, storage=storage, i=i, out_dtype=out_dtype):
                return np.asarray(storage.part(host(name, var), i)).astype(out_dtype)

            tensors.append((hf_name, hf_shape, out_dtype, produce))
    if mtp_depth:
        written = {t[0]: t[1:] for t in tensors}
        tensors += [(copy, *written[source])
                    for copy, source in _mtp_copies(arch, config).items()]
    hf_config = {"architectures": [arch.hf_name], **arch.config_to_hf(config),
                 "torch_dtype": tensors[0][2].name}
    if mtp_depth and arch.mtp.count_key is not None:
        hf_config[arch.mtp.count_key] = mtp_depth
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
