"""Typed config parsing: mappings (YAML) into frozen dataclasses, checked key by key.

Unknown keys and wrong types fail with the dotted key path, so a typo in a config never silently
falls back to a default. A numeric setting declares its domain beside its field (`within`, e.g.
a learning rate > 0): a value outside it would still run, only wrongly (a negative learning rate
climbs the loss), so it is refused when the section is built (`check_domains`), naming the key
and, through `load_config`, where the value came from.

A dataclass that needs more than its fields' types to be read (the model section, whose fields
depend on the architecture it names) gives a `from_config(value, path)` classmethod, which the
parser calls instead.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import yaml

_YAML11_EXPONENT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")

# The field metadata key of a setting's domain.
DOMAIN = "domain"


@dataclasses.dataclass(frozen=True)
class Domain:
    """The values a numeric setting may take: an interval (either end open, closed or absent)
    plus the single values in `also` (the mesh's -1: every device left over)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    also: tuple[float, ...] = ()

    def holds(self, value: float) -> bool:
        if value in self.also:
            return True
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def __str__(self) -> str:
        if self.low is not None and self.high is not None:
            text = (f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}"
                    f"{')' if self.high_open else ']'}")
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {self.low:g}"
        else:
            text = f"{'<' if self.high_open else '<='} {self.high:g}"
        return " or ".join([text, *(f"{v:g}" for v in self.also)])


POSITIVE = Domain(low=0, low_open=True)
NON_NEGATIVE = Domain(low=0)
AT_LEAST_ONE = Domain(low=1)
UNIT_INTERVAL = Domain(low=0, high=1)


def within(domain: Domain, default: Any) -> Any:
    """A dataclass field with `default` whose values must lie in `domain` (None, where the type
    allows it, means unset and is always allowed)."""
    return dataclasses.field(default=default, metadata={DOMAIN: domain})


class DomainError(ValueError):
    """A setting outside its domain: `key` (dotted, as far as it is known), `value`, `domain`."""

    def __init__(self, key: str, value: Any, domain: Domain):
        self.key, self.value, self.domain = key, value, domain
        super().__init__(f"{key}: {value!r} must be {domain}")

    def under(self, path: str) -> DomainError:
        """The same error with `path` (the section's key) in front of the key."""
        return DomainError(f"{path}.{self.key}" if path else self.key, self.value, self.domain)

    def sourced(self, source: str) -> ValueError:
        """The error as a run config reports it: key=value, where the value came from (a YAML
        file's name or `override`), and the domain."""
        return ValueError(f"{self.key}={self.value!r} ({source}): must be {self.domain}")


def check_domains(section: Any) -> None:
    """Refuse the first field of dataclass instance `section` outside its declared domain (a
    list's every entry: layer indices); every section with numeric settings calls this first in
    its `__post_init__`."""
    for field in dataclasses.fields(section):
        domain = field.metadata.get(DOMAIN)
        value = getattr(section, field.name)
        if domain is None or value is None:
            continue
        for i, item in enumerate(value) if isinstance(value, (list, tuple)) else [(None, value)]:
            if not domain.holds(item):
                raise DomainError(field.name if i is None else f"{field.name}[{i}]", item, domain)


def check_value(value: Any, hint: Any, path: str) -> Any:
    """`value` read as type `hint` (dataclasses through `from_dict`, unions, literals, tuples,
    scalars), or a ValueError naming `path`."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if isinstance(hint, type) and hasattr(hint, "from_config"):
        return hint.from_config(value, path)
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, path)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors: list[ValueError] = []
        for a in args:
            if a is type(None):
                continue
            try:
                return check_value(value, a, path)
            except ValueError as e:
                errors.append(e)
        if len(errors) == 1:
            raise errors[0]
        raise ValueError(f"{path}: {value!r} matches no type of {hint}")
    if origin is Literal:
        if value not in args:
            raise ValueError(f"{path}: {value!r} is not one of {args}")
        return value
    if origin in (tuple, list, Sequence):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{path}: expected a list, got {type(value).__name__}")
        item = args[0] if args else Any
        return tuple(check_value(v, item, f"{path}[{i}]") for i, v in enumerate(value))
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
        k: check_value(v, hints[k], f"{path}.{k}" if path else k) for k, v in data.items()
    }
    try:
        return cls(**kwargs)
    except DomainError as e:
        raise e.under(path) from None
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
