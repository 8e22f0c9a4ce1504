"""YAML run configs validated into dataclasses, with `key.path=value` overrides.

Unknown keys and wrong types fail with the dotted key path, so a typo in a config never silently
falls back to a default. The `model` section names its `architecture` (a key of
`jtree.models.architectures.ARCHITECTURES`) and is validated against that architecture's config
class, which holds only Hugging Face config fields; how to run the model (attention kernel,
dtypes, rematerialization) is the `runtime` section (`jtree.models.runtime.RuntimeConfig`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from jtree.chunk_tables import DEFAULT_CHUNK_SIZE
from jtree.models.architectures import architecture
from jtree.models.architectures.qwen3 import Qwen3Config
from jtree.models.lora import LoraConfig
from jtree.models.runtime import RuntimeConfig
from jtree.planner import check_steps_per_octave
from jtree.rfree.layout import ROW_STEPS_PER_OCTAVE
from jtree.sharding import MeshConfig
from jtree.train_step import Objective, OptimConfig


_YAML11_EXPONENT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Which architecture to build and its config (an instance of the architecture's class).
    `init_from`: a Hugging Face checkpoint directory to start from instead of a random init (its
    config.json must agree with the architecture fields given here). `lora`: train low-rank
    adapters on the kernels it targets instead of every parameter (`jtree.models.lora`)."""

    architecture: str = "qwen3"
    config: Any = dataclasses.field(default_factory=Qwen3Config)
    init_from: str | None = None
    lora: LoraConfig | None = None


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where training trees come from and how they are batched (`jtree.data`).

    `format`: `groups` (JSONL, one sequence per line with a group id; one tree per group),
    `trees` (JSONL, one explicit tree per line) or `chat` (JSONL, `{"messages": [...]}` per line,
    tokenized with `tokenizer`: `bytes` for the built-in byte tokenizer, else a local
    tokenizer.json or Hugging Face tokenizer directory). Each step trains on `trees_per_step`
    trees, spread over the data-parallel shards and `micro_batches` per shard, each micro-batch
    packed into `rows_per_micro_batch` rows of `seq_len` tokens (None: the fewest rows that hold
    every step of the run); a tree larger than `seq_len` is cut into parts by `partition_method`
    (`jtree.partition`). `on_bad_record`: `raise` (stop at file:line) or `skip` (count and
    report). `worker_count` > 0 linearizes in that many grain worker processes. Models with
    linear-attention layers (Qwen3-Next) get Gated DeltaNet chunk tables with chunks of
    `gdn_chunk_size` tokens and `gdn_chunks` chunks per row (None: the smallest bucket of
    `jtree.chunk_tables.default_chunk_count` that holds the step, so a run compiles for a few
    shapes; fix it to compile once, a step that needs more then fails naming it); other models
    ignore both. `row_steps_per_octave`: None gives every row `seq_len` tokens; a power of two k
    lets each step take the shortest row length that holds it in its rows from a ladder of k
    lengths per octave (multiples of 64; `jtree.planner`): less padding on small steps, up to k
    row shapes per octave to compile.
    """

    path: str = "data/sample_groups.jsonl"
    format: Literal["groups", "trees", "chat"] = "groups"
    seq_len: int = 1024
    trees_per_step: int = 8
    micro_batches: int = 1
    rows_per_micro_batch: int | None = None
    shuffle_seed: int = 0
    partition_method: Literal["heuristic", "dp_single", "dp_multi"] = "heuristic"
    on_bad_record: Literal["raise", "skip"] = "raise"
    tokenizer: str = "bytes"
    worker_count: int = 0
    gdn_chunk_size: int = DEFAULT_CHUNK_SIZE
    gdn_chunks: int | None = None
    row_steps_per_octave: int | None = None

    def __post_init__(self) -> None:
        if self.row_steps_per_octave is not None:
            check_steps_per_octave(self.row_steps_per_octave, "row_steps_per_octave")
        for name in ("seq_len", "trees_per_step", "micro_batches", "gdn_chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: {getattr(self, name)} must be >= 1")
        if self.rows_per_micro_batch is not None and self.rows_per_micro_batch < 1:
            raise ValueError(f"rows_per_micro_batch: {self.rows_per_micro_batch} must be >= 1")
        if self.gdn_chunks is not None and self.gdn_chunks < 1:
            raise ValueError(f"gdn_chunks: {self.gdn_chunks} must be >= 1")
        if self.worker_count < 0:
            raise ValueError(f"worker_count: {self.worker_count} must be >= 0")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints (`jtree.checkpoint`): saved every `every` steps and at the end into
    `dir` (None: no checkpoints), the last `keep` kept; `async_save` writes in the background.
    `on_corrupt`: what `--resume` does when the latest checkpoint is uncommitted, incomplete or
    unreadable: `fallback` (log it and resume from the newest intact one) or `raise`."""

    dir: str | None = None
    every: int = 100
    keep: int = 3
    async_save: bool = True
    on_corrupt: Literal["fallback", "raise"] = "fallback"

    def __post_init__(self) -> None:
        if self.every < 1 or self.keep < 1:
            raise ValueError(f"every ({self.every}) and keep ({self.keep}) must be >= 1")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The training run: length, mode, seed, logging.

    `metrics_jsonl`: a file that gets one JSON object per step; `tensorboard_dir`: scalars for
    TensorBoard (needs the `tensorboardX` package). `mode`: `tree`, `baseline` (every path its own
    sequence), or `auto`: each step in tree mode unless the cost model predicts a gain below
    `auto_min_gain` over the baseline, then in baseline mode (same loss either way; the choice and
    its reason are logged per step), or `redundancy_free`: trees larger than `capacity` tokens
    (default `data.seq_len`) split into parts that reuse their ancestors' cached prefixes
    (`jtree.rfree`; single device only), `prefix_backward` choosing how a part with children gets
    its backward (`residuals`, `recompute` or `auto`) and `row_steps_per_octave` how finely part
    rows are fitted to their tokens (`jtree.rfree.layout.row_length`: more steps, less padding,
    more shapes to compile). `host_malloc`: `keep` makes glibc keep freed
    host memory so CPU steps stop page-faulting their temporaries every step
    (`jtree.host_allocator`; the process keeps its peak host memory), `default` leaves malloc
    alone, `auto` keeps it on the CPU backend only. `kill_after_checkpoint`: fault injection for
    resume tests, the process SIGKILLs itself once the checkpoint of that step is committed.
    """

    steps: int = 20
    seed: int = 0
    mode: Literal["tree", "baseline", "auto", "redundancy_free"] = "tree"
    auto_min_gain: float = 1.05
    capacity: int | None = None
    prefix_backward: Literal["residuals", "recompute", "auto"] = "auto"
    row_steps_per_octave: int = ROW_STEPS_PER_OCTAVE
    host_malloc: Literal["auto", "keep", "default"] = "auto"
    log_every: int = 1
    compare_baseline: bool = True
    timing_repeats: int = 5
    metrics_jsonl: str | None = None
    tensorboard_dir: str | None = None
    kill_after_checkpoint: int | None = None


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A run config: one section per dataclass. `model` is what the checkpoint holds, `runtime`
    how it is run (attention kernel, dtypes, remat; never part of a checkpoint's config.json)."""

    model: ModelSpec = dataclasses.field(default_factory=ModelSpec)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    objective: Objective = dataclasses.field(default_factory=Objective)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        critic = self.objective.critic
        if critic is None or not critic.separate:
            return
        network = critic_network(self.model, critic)
        object.__setattr__(self, "objective", dataclasses.replace(
            self.objective, critic=dataclasses.replace(critic, network=network)))

    @property
    def critic_model_args(self) -> dict[str, Any]:
        """`jtree.models.create_model`'s critic arguments for this run: a `value_head` on the
        policy trunk (`objective.critic.model: head`) or a separate `critic` network."""
        critic = self.objective.critic
        return dict(value_head=critic is not None and not critic.separate,
                    critic=self.critic_network)

    @property
    def critic_network(self) -> Any:
        """The separate critic's architecture config (`objective.critic.model: separate`), None
        without one."""
        critic = self.objective.critic
        return critic.network if critic is not None and critic.separate else None


def critic_network(spec: ModelSpec, critic: Any) -> Any:
    """The architecture config of the separate critic of `critic` (`jtree.critic.CriticConfig`)
    beside the policy `spec`: `network` unset is the policy's config; a mapping names its
    `architecture` (default: the policy's) and fields that override the policy's config (same
    architecture) or the architecture's defaults. Its vocabulary must be the policy's: it reads
    the same tokens. Errors name the key (`objective.critic.network.<field>`)."""
    path = "objective.critic.network"
    network = critic.network
    if network is None:
        return spec.config
    if not isinstance(network, Mapping):  # already resolved
        config = network
    else:
        arch, config_class, fields = _architecture_fields(network, path, spec.architecture)
        if arch == spec.architecture:
            fields = {**{f.name: getattr(spec.config, f.name)
                         for f in dataclasses.fields(config_class) if f.init}, **fields}
        config = from_dict(config_class, fields, path)
    if config.vocab_size != spec.config.vocab_size:
        raise ValueError(f"{path}.vocab_size: {config.vocab_size} is not the policy's "
                         f"model.vocab_size ({spec.config.vocab_size}): the critic reads the "
                         "policy's tokens")
    return config


def _architecture_fields(value: Mapping[str, Any], path: str, default: str
                         ) -> tuple[str, type, dict[str, Any]]:
    """(architecture name, its config class, the other fields) of a model section `value`
    at `path`, its `architecture` defaulting to `default`."""
    fields = dict(value)
    arch = fields.pop("architecture", default)
    try:
        return arch, architecture(arch).config_class, fields
    except ValueError as e:
        raise ValueError(f"{path}.{e}") from None


def _model_spec(value: Any, path: str) -> ModelSpec:
    """`{architecture: name, **config fields}` -> ModelSpec, fields checked against the
    architecture's config class."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{path}: expected a mapping, got {type(value).__name__}")
    arch, config_class, fields = _architecture_fields(value, path, ModelSpec.architecture)
    init_from = _check_value(fields.pop("init_from", None), str | None, f"{path}.init_from")
    lora = _check_value(fields.pop("lora", None), LoraConfig | None, f"{path}.lora")
    return ModelSpec(arch, from_dict(config_class, fields, path), init_from, lora)


def _check_value(value: Any, hint: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is ModelSpec:
        return _model_spec(value, path)
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, path)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _check_value(value, a, path)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if len(errors) == 1 else f"{path}: {value!r} matches no type of {hint}")
    if origin is Literal:
        if value not in args:
            raise ValueError(f"{path}: {value!r} is not one of {args}")
        return value
    if origin in (tuple, list, Sequence):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{path}: expected a list, got {type(value).__name__}")
        item = args[0] if args else Any
        return tuple(_check_value(v, item, f"{path}[{i}]") for i, v in enumerate(value))
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{path}: expected true/false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{path}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str) and _YAML11_EXPONENT.match(value):
            return float(value)  # YAML 1.1 reads 1e-5 (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{path}: expected a string, got {value!r}")
        return value
    raise TypeError(f"{path}: unsupported config type {hint}")


def from_dict(cls: type, data: Mapping[str, Any] | None, path: str = "") -> Any:
    """Build dataclass `cls` from a mapping, checking keys and types recursively."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ValueError(f"{path or '<root>'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - names)
    if unknown:
        where = f"{path}." if path else ""
        raise ValueError(f"{where}{unknown[0]}: unknown config key (known: {sorted(names)})")
    kwargs = {
        k: _check_value(v, hints[k], f"{path}.{k}" if path else k) for k, v in data.items()
    }
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ValueError(f"{path or '<root>'}: {e}") from None


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (values parsed as YAML) to a nested dict, returning a copy."""
    out = yaml.safe_load(yaml.safe_dump(data)) or {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r}: expected key.path=value")
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {p} is not a section")
        node[parts[-1]] = yaml.safe_load(raw)
    return out


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read a YAML config (or start from defaults when `path` is None) and apply overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    try:
        return from_dict(TrainConfig, apply_overrides(data, overrides))
    except ValueError as e:
        raise ValueError(f"{path or 'config'}: {e}") from None


def config_values(cfg: TrainConfig) -> dict[str, Any]:
    """Every setting of `cfg` under the dotted key an override names it by (`model.hidden_size`,
    `data.seq_len`), its value as JSON reads it back (tuples as lists), so a config saved with a
    checkpoint compares equal to the config that wrote it."""
    out: dict[str, Any] = {}
    for field in dataclasses.fields(cfg):
        section = getattr(cfg, field.name)
        values = dataclasses.asdict(section)
        if isinstance(section, ModelSpec):  # the architecture's fields sit directly under model.
            values = {"architecture": section.architecture, "init_from": section.init_from,
                      "lora": values["lora"], **values["config"]}
        for key, value in values.items():
            out[f"{field.name}.{key}"] = json.loads(json.dumps(value))
    return out
