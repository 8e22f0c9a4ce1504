"""How a Hugging Face architecture maps onto a jtree model, as data.

Each architecture record (`jtree.models.architectures`) holds one `HfMapping`: how its
`config.json` becomes the jtree architecture config (and back), which HF tensor every jtree
parameter is stored as and in which layout (transposed, permuted, ...), which HF tensors are
tied to others, and where the multi-token-prediction modules are kept. Placement on a device mesh is not here: it follows the train step's rules
(`jtree.parallel.sharding`, via `jtree.hf.placement`). Loader, saver and the PyTorch comparison only read
these tables, so adding an architecture (or a per-architecture permutation such as a grouped
projection) is a new record, not a new code path.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

Array = Any  # numpy or jax array: layouts use only array methods, so both work (and eval_shape)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a jtree array is stored in the HF checkpoint.

    `to_hf(array, config)` gives the HF tensor, `from_hf(tensor, config)` its inverse. Both must
    use array methods only (`.T`, `.reshape`, `.transpose`) so they run on numpy arrays, jax
    arrays and abstract shapes alike.
    """

    name: str
    to_hf: Callable[[Array, Any], Array]
    from_hf: Callable[[Array, Any], Array]


SAME = Layout("same", lambda a, cfg: a, lambda a, cfg: a)
# nnx.Linear stores kernel [in, out]; torch.nn.Linear stores weight [out, in].
TRANSPOSED = Layout("transposed", lambda a, cfg: a.T, lambda a, cfg: a.T)


@dataclasses.dataclass(frozen=True)
class Storage:
    """How one jtree parameter is stored in a checkpoint: as the HF tensors `hf_names` of shapes
    `hf_shapes`. `part(array, i)` is HF tensor i cut from the jtree array (array methods only, so
    numpy and jax arrays both work); `join(tensors)` rebuilds the jtree array from all of them, in
    `hf_names` order, as host numpy arrays."""

    hf_names: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    part: Callable[[Array, int], Array]
    join: Callable[[Sequence[Array]], Array]


@dataclasses.dataclass(frozen=True)
class TensorRule:
    """jtree parameters whose dotted path fully matches `pattern` are stored as the HF tensor
    `re.sub(pattern, hf_name, path)` in `layout`. The first matching rule of a table wins."""

    pattern: str
    hf_name: str
    layout: Layout = SAME

    def storages(self, path: str, shape: tuple[int, ...], config: Any) -> list[Storage]:
        struct = jax.ShapeDtypeStruct(shape, jax.numpy.float32)
        hf_shape = tuple(jax.eval_shape(lambda a: self.layout.to_hf(a, config), struct).shape)
        return [Storage(
            (re.sub(self.pattern, self.hf_name, path),), (hf_shape,),
            part=lambda a, i: self.layout.to_hf(a, config),
            join=lambda tensors: self.layout.from_hf(tensors[0], config),
        )]


@dataclasses.dataclass(frozen=True)
class PerExpertRule:
    """A stacked experts parameter [E, P * n, ...] (transformers 5's fused module layout) stored
    one tensor per expert and part, as on the Hub: rows [p * n, (p + 1) * n) of expert e are the HF
    tensor `hf_names[p]` (after `re.sub(pattern, ., path)`) with `{e}` replaced by e. E.g.
    `experts.gate_up_proj` [E, 2I, H] -> `experts.{e}.gate_proj.weight` and
    `experts.{e}.up_proj.weight` [I, H]. Checkpoints holding the fused tensor
    `re.sub(pattern, fused_name, path)` as it is load too; saving writes the per-expert form."""

    pattern: str
    hf_names: tuple[str, ...]
    fused_name: str = r"\g<0>"

    def storages(self, path: str, shape: tuple[int, ...], config: Any) -> list[Storage]:
        n_parts = len(self.hf_names)
        experts, rows = shape[0], shape[1] // n_parts
        if shape[1] % n_parts:
            raise ValueError(f"parameter {path!r}: axis 1 of {shape} does not split into "
                             f"{n_parts} parts")
        names = tuple(re.sub(self.pattern, t, path).replace("{e}", str(e))
                      for e in range(experts) for t in self.hf_names)
        part_shape = (rows,) + tuple(shape[2:])

        def part(a: Array, i: int) -> Array:
            e, p = divmod(i, n_parts)
            return a[e, p * rows:(p + 1) * rows]

        def join(tensors: Sequence[Array]) -> Array:
            per_expert = [np.concatenate(tensors[e * n_parts:(e + 1) * n_parts], axis=0)
                          for e in range(experts)]
            return np.stack(per_expert)

        per_expert = Storage(names, (part_shape,) * len(names), part, join)
        fused = TensorRule(self.pattern, self.fused_name).storages(path, shape, config)[0]
        return [per_expert, fused]


@dataclasses.dataclass(frozen=True)
class SavedPrefixRule:
    """`rule`, except that checkpoints store the names it gives under `memory_prefix` (the
    module names of transformers' model in memory) with `saved_prefix` instead: transformers
    writes Nemotron-H's `model.*` as `backbone.*`, the Hub's form. That form is saved (and
    read); the in-memory names are read too, and are what `to_hf_tensors(names=)` picks when
    comparing with a transformers model."""

    rule: TensorRule
    memory_prefix: str
    saved_prefix: str

    @property
    def pattern(self) -> str:
        return self.rule.pattern

    def storages(self, path: str, shape: tuple[int, ...], config: Any) -> list[Storage]:
        in_memory = self.rule.storages(path, shape, config)
        saved = [dataclasses.replace(s, hf_names=tuple(
            self.saved_prefix + n[len(self.memory_prefix):] if n.startswith(self.memory_prefix)
            else n for n in s.hf_names)) for s in in_memory]
        return saved + in_memory


@dataclasses.dataclass(frozen=True)
class SavedRenamedRule:
    """`rule`, except that checkpoints store the names it gives (transformers' names in memory)
    with the regex substitutions `renames` applied in order: transformers converts Kimi-Linear's
    Hub names (`block_sparse_moe.*`, the forget gate's tensors directly under `self_attn`) on
    load and back on save. The saved form is written (and read); the in-memory names are read
    too, and are what `to_hf_tensors(names=)` picks when comparing with a transformers model."""

    rule: TensorRule | PerExpertRule
    renames: tuple[tuple[str, str], ...]

    @property
    def pattern(self) -> str:
        return self.rule.pattern

    def storages(self, path: str, shape: tuple[int, ...], config: Any) -> list[Storage]:
        def saved_name(name: str) -> str:
            for pattern, replacement in self.renames:
                name = re.sub(pattern, replacement, name)
            return name

        in_memory = self.rule.storages(path, shape, config)
        saved = [dataclasses.replace(s, hf_names=tuple(map(saved_name, s.hf_names)))
                 for s in in_memory]
        return [s for s, m in zip(saved, in_memory) if s.hf_names != m.hf_names] + in_memory


@dataclasses.dataclass(frozen=True)
class SplitRule:
    """A jtree parameter stored as `len(hf_names)` equal blocks of its axis 0, HF tensor i being
    `re.sub(pattern, hf_names[i], path)` (Kimi-Linear's conv weight over [q | k | v], which the
    Hub holds as `q_conv1d`, `k_conv1d`, `v_conv1d`), or whole as `re.sub(pattern, whole_name,
    path)` (transformers' in-memory form). Saving writes the blocks."""

    pattern: str
    hf_names: tuple[str, ...]
    whole_name: str

    def storages(self, path: str, shape: tuple[int, ...], config: Any) -> list[Storage]:
        n = len(self.hf_names)
        if shape[0] % n:
            raise ValueError(f"parameter {path!r}: axis 0 of {shape} does not split into {n} "
                             "parts")
        rows = shape[0] // n
        split = Storage(
            tuple(re.sub(self.pattern, name, path) for name in self.hf_names),
            ((rows,) + tuple(shape[1:]),) * n,
            part=lambda a, i: a[i * rows:(i + 1) * rows],
            join=lambda tensors: np.concatenate(tensors, axis=0))
        whole = TensorRule(self.pattern, self.whole_name).storages(path, shape, config)[0]
        return [split, whole]


class _ConfigFields(dict):
    """`str.format_map` mapping: `{name}` is the architecture config's field `name`."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config

    def __missing__(self, key: str) -> Any:
        return getattr(self.config, key)


def with_config_fields(template: str, config: Any, **extra: Any) -> str:
    """`template` with each `{field}` replaced by `config`'s field of that name, or by `extra`'s
    value (names that depend on the config, such as DeepSeek-V3's MTP layer index
    `{num_hidden_layers}`)."""
    fields = _ConfigFields(config)
    fields.update(extra)
    return template.format_map(fields)


@dataclasses.dataclass(frozen=True)
class StoredAs:
    """jtree parameters whose dotted path fully matches `pattern` are stored as the parameter
    `re.sub(pattern, as_path, path)` (its `{field}`s filled from the config,
    `with_config_fields`) is stored by the rules after this one: a module that the checkpoint
    keeps under another module's names, e.g. DeepSeek-V3's MTP layer `mtp.layers.0.*` as the
    decoder layer `model.layers.{num_hidden_layers}.*`, with every layout that layer has."""

    pattern: str
    as_path: str

    def stored_path(self, path: str, config: Any) -> str:
        return with_config_fields(re.sub(self.pattern, self.as_path, path), config)


@dataclasses.dataclass(frozen=True)
class MtpTensors:
    """Where an architecture's checkpoints keep the multi-token-prediction modules
    (`jtree.models.mtp`), which its causal LM does not use. Names are templates: `{field}` is
    the architecture config's field, `{depth}` the MTP layer's index (0 for depth 1). The
    tensor rules (`HfMapping.tensors`) say which tensor each MTP parameter is; this says where
    they all are, so that `jtree.hf` reads and writes them without knowing any name.

    - `prefix`: every MTP tensor's name starts with it; skipped unless the model being loaded
      has MTP modules.
    - `fc`: the tensor of the shared input projection; a checkpoint without it has none.
    - `layer`: the name prefix of the MTP layer of index `{depth}`.
    - `max_depth`: the most depths a jtree model can take from such a checkpoint (None: as
      many as it holds). jtree's depths share one fc and its input norms (Qwen3-Next's
      layout); where every depth has its own (DeepSeek-V3), only the first one maps.
    - `copies`: tensors of the MTP modules that are exact copies of main-model tensors
      (copy -> source; a source that `HfMapping.tied` ties to another tensor means that
      one). Loading checks the copies it finds; saving writes them all, as the Hub's
      checkpoints hold them.
    - `count_key`: the config.json key holding the number of MTP layers, which `save` sets to
      the saved model's depth (None: no such key is written).
    """

    prefix: str
    fc: str
    layer: str
    max_depth: int | None = None
    copies: Mapping[str, str] = dataclasses.field(default_factory=dict)
    count_key: str | None = None


Rule = TensorRule | PerExpertRule | SavedPrefixRule | SavedRenamedRule | SplitRule | StoredAs


def tied_lm_head(embedding: str) -> Callable[[Any], dict[str, str]]:
    """`HfMapping.tied` for a model whose `lm_head.weight` is tied to the embedding tensor
    `embedding` when its config says `tie_word_embeddings`."""
    def tied(cfg: Any) -> dict[str, str]:
        return {"lm_head.weight": embedding} if cfg.tie_word_embeddings else {}
    return tied


@dataclasses.dataclass(frozen=True)
class HfMapping:
    """One HF architecture (the `architectures[0]` of config.json) against its jtree record.

    - `config_from_hf(hf_config)`: the jtree architecture config; refuses fields it cannot
      honour. How to run the model (`jtree.config.runtime`) is never part of config.json.
    - `config_to_hf(config)`: the config.json dict (without `architectures`/`torch_dtype`).
    - `tensors`: parameter name and layout table (`TensorRule`: one HF tensor per parameter;
      `PerExpertRule`: one per expert and part).
    - `tied(config)`: HF tensors that the HF model ties to another one (alias -> source), which a
      checkpoint may omit or contain as an exact copy.
    - `ignored`: HF tensors a checkpoint may hold that the causal LM does not use (Nemotron-H's
      multi-token-prediction modules `mtp.*`, which transformers skips too); never read.
    - `mtp`: where the checkpoints keep the multi-token-prediction modules that jtree reads
      into a model built with them (`MtpTensors`); None: jtree reads none. Skipped, as
      transformers skips them, when the model has no MTP modules.
    - `float32`: jtree parameter names (regexes) that `save` writes in float32 whatever dtype it
      is asked for (transformers' `_keep_in_fp32_modules_strict`: DeepSeek-V3's router).
    """

    hf_name: str
    model_type: str
    config_from_hf: Callable[[Mapping[str, Any]], Any]
    config_to_hf: Callable[[Any], dict[str, Any]]
    tensors: tuple[Rule, ...]
    tied: Callable[[Any], Mapping[str, str]]
    ignored: tuple[str, ...] = ()
    mtp: MtpTensors | None = None
    float32: tuple[str, ...] = ()

    def storages(self, path: str, shape: tuple[int, ...], config: Any) -> list[Storage]:
        """The ways the jtree parameter at dotted `path` may be stored, the saved one first."""
        stored = path
        for rule in self.tensors:
            if not re.fullmatch(rule.pattern, stored):
                continue
            if isinstance(rule, StoredAs):  # the new path goes on through the rules after it
                stored = rule.stored_path(stored, config)
                continue
            return rule.storages(stored, tuple(shape), config)
        raise ValueError(f"{self.hf_name}: jtree parameter {path!r} matches no tensor rule")

    def is_ignored(self, hf_name: str, config: Any) -> bool:
        """Whether the HF tensor `hf_name` is one the causal LM of `config` does not read."""
        if self.mtp is not None and hf_name.startswith(
                with_config_fields(self.mtp.prefix, config)):
            return True
        return any(re.fullmatch(p, hf_name) for p in self.ignored)


def dotted(path: Sequence[Any]) -> str:
    """('model', 'layers', 0, 'mlp') -> 'model.layers.0.mlp' (nnx state paths to names)."""
    return ".".join(str(p) for p in path)


# The Flax NNX layers' names and layouts against their torch.nn counterparts: nnx.Linear `kernel`
# [in, out] is torch `weight` [out, in]; nnx.Embed `embedding` is torch `weight` as is; norm
# weights and biases keep name and layout. Models with HF parameter names need nothing more.
NNX_TO_TORCH = (
    TensorRule(r"(.*)\.kernel", r"\1.weight", TRANSPOSED),
    TensorRule(r"(.*)\.embedding", r"\1.weight"),
    TensorRule(r".*\.(weight|bias)", r"\g<0>"),
)
