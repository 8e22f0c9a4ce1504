"""YAML run configs validated into dataclasses, with `key.path=value` overrides.

Unknown keys and wrong types fail with the dotted key path, so a typo in a config never silently
falls back to a default.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from jtree.models.config import Qwen3Config
from jtree.train import Objective, OptimConfig


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where training trees come from and how they are batched.

    `format`: `groups` (JSONL, one sequence per line with a group id; one tree per group) or
    `trees` (JSONL, one explicit tree per line). Each step trains on `trees_per_step` trees packed
    into rows of `seq_len` tokens, split into `micro_batches` equal parts.
    """

    path: str = "data/sample_groups.jsonl"
    format: Literal["groups", "trees"] = "groups"
    seq_len: int = 1024
    trees_per_step: int = 8
    micro_batches: int = 1
    rows_per_micro_batch: int | None = None
    shuffle_seed: int = 0


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The training run: length, mode, seed, logging."""

    steps: int = 20
    seed: int = 0
    mode: Literal["tree", "baseline"] = "tree"
    log_every: int = 1
    compare_baseline: bool = True
    timing_repeats: int = 5


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: Qwen3Config = dataclasses.field(default_factory=Qwen3Config)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    objective: Objective = dataclasses.field(default_factory=Objective)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)


def _check_value(value: Any, hint: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
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
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    try:
        return from_dict(TrainConfig, apply_overrides(data, overrides))
    except ValueError as e:
        raise ValueError(f"{path or 'config'}: {e}") from None
