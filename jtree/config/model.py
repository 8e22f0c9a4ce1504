"""The `model` section of a run config: which architecture, its config, where its weights start,
and LoRA adapters; and the separate critic's network, resolved against the policy's."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, Literal

from jtree.config.architectures import Qwen3Config, architecture_config
from jtree.config.schema import (
    AT_LEAST_ONE,
    POSITIVE,
    check_domains,
    check_value,
    from_dict,
    within,
)


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

    @classmethod
    def from_config(cls, value: Any, path: str) -> ModelSpec:
        """`{architecture: name, **config fields}` -> ModelSpec, fields checked against the
        architecture's config class."""
        if not isinstance(value, Mapping):
            raise ValueError(f"{path}: expected a mapping, got {type(value).__name__}")
        arch, config_class, fields = _architecture_fields(value, path, cls.architecture)
        init_from = check_value(fields.pop("init_from", None), str | None, f"{path}.init_from")
        lora = check_value(fields.pop("lora", None), LoraConfig | None, f"{path}.lora")
        return cls(arch, from_dict(config_class, fields, path), init_from, lora)


def critic_network(spec: ModelSpec, critic: Any) -> Any:
    """The architecture config of the separate critic of `critic` (`jtree.config.objective.CriticConfig`)
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
        return arch, architecture_config(arch), fields
    except ValueError as e:
        raise ValueError(f"{path}.{e}") from None



@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """`model.lora`: adapters of rank `rank` scaled by `alpha / rank` on every linear kernel whose
    parameter path one of `targets` (regexes) is found in; `base_dtype` stores the frozen base in
    that dtype (None: the model's parameter dtype)."""

    rank: int = within(AT_LEAST_ONE, 8)
    alpha: float = within(POSITIVE, 16.0)
    targets: tuple[str, ...] = ()
    base_dtype: Literal["float32", "bfloat16"] | None = None

    def __post_init__(self) -> None:
        check_domains(self)
        if not self.targets:
            raise ValueError("targets: name at least one parameter path regex "
                             "(e.g. ['self_attn/(q|v)_proj'])")
        for i, target in enumerate(self.targets):
            try:
                re.compile(target)
            except re.error as e:
                raise ValueError(f"targets[{i}]: {target!r} is not a regex ({e})") from None

    @property
    def scale(self) -> float:
        return self.alpha / self.rank
