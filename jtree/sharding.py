"""The device mesh ('data', 'model') and how parameters and batches are laid out on it.

Data parallelism splits the rows of every batch array over `data`; Megatron-style tensor
parallelism splits attention heads, MLP columns and the vocabulary over `model` (the model side of
it is the small hook in `jtree.models.layers`: `row_parallel`, `vocab_parallel_embed`,
`local_kv_heads`). Parameter layouts come from per-architecture rule lists: ordered
(regex over the '/'-joined parameter path, PartitionSpec) pairs, first match wins, and a parameter
that no rule matches is an error rather than a silent replica. A new architecture (MoE experts over
`model`, GDN heads) adds its own rule list to `SHARDING_RULES`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA, MODEL = "data", "model"
Rules = list[tuple[str, P]]


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh shape: `data` x `model` devices; -1 for `data` means all devices left over."""

    data: int = -1
    model: int = 1

    def __post_init__(self) -> None:
        if self.model < 1:
            raise ValueError(f"model: {self.model} must be >= 1")
        if self.data == 0 or self.data < -1:
            raise ValueError(f"data: {self.data} must be >= 1 or -1 (all remaining devices)")


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ('data', 'model') mesh over `devices` (default: every device of every process).

    The model axis varies fastest, so with several hosts a tensor-parallel group stays within a
    host and the data axis spans hosts.
    """
    devices = list(jax.devices() if devices is None else devices)
    data = cfg.data if cfg.data > 0 else len(devices) // cfg.model
    if data < 1 or data * cfg.model != len(devices):
        raise ValueError(
            f"mesh: data={cfg.data} x model={cfg.model} does not match the {len(devices)} devices "
            f"available ({jax.process_count()} process(es))"
        )
    grid = np.asarray(devices, dtype=object).reshape(data, cfg.model)
    return Mesh(grid, (DATA, MODEL), axis_types=(jax.sharding.AxisType.Auto,) * 2)


# ---------------------------------------------------------------------- parameter rules


def _divides(what: str, count: int, model: int) -> None:
    if count % model:
        raise ValueError(f"mesh.model={model} must divide {what} ({count})")


def qwen3_rules(cfg: Any, model: int) -> Rules:
    """Dense Qwen3: column-parallel q/k/v/gate/up, row-parallel o/down, vocab-parallel
    embedding and LM head. KV heads are split when the model axis divides them and replicated
    (each device keeps the head its queries read) when they divide the model axis."""
    _divides("num_attention_heads", cfg.num_attention_heads, model)
    _divides("intermediate_size", cfg.intermediate_size, model)
    _divides("vocab_size", cfg.vocab_size, model)
    if cfg.num_key_value_heads % model == 0:
        kv_kernel, kv_bias = P(None, MODEL), P(MODEL)
    elif model % cfg.num_key_value_heads == 0:
        kv_kernel, kv_bias = P(), P()
    else:
        raise ValueError(f"mesh.model={model} and num_key_value_heads "
                         f"({cfg.num_key_value_heads}) must divide one another")
    return [
        (r"embed_tokens/embedding$", P(MODEL, None)),
        (r"lm_head/kernel$", P(None, MODEL)),
        (r"self_attn/q_proj/kernel$", P(None, MODEL)),
        (r"self_attn/q_proj/bias$", P(MODEL)),
        (r"self_attn/[kv]_proj/kernel$", kv_kernel),
        (r"self_attn/[kv]_proj/bias$", kv_bias),
        (r"self_attn/o_proj/kernel$", P(MODEL, None)),
        (r"self_attn/o_proj/bias$", P()),
        (r"mlp/(gate|up)_proj/kernel$", P(None, MODEL)),
        (r"mlp/down_proj/kernel$", P(MODEL, None)),
        (r"(norm|layernorm)/weight$", P()),
    ]


SHARDING_RULES: dict[str, Callable[[Any, int], Rules]] = {"qwen3": qwen3_rules}


def param_path(path: tuple[Any, ...]) -> str:
    """'model/layers/0/self_attn/q_proj/kernel' for a flattened nnx.State key path."""
    parts = []
    for key in path:
        name = getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))
        if name != "value":  # nnx.Variable's own leaf
            parts.append(str(name))
    return "/".join(parts)


def param_specs(params: Any, rules: Rules, mesh: Mesh) -> Any:
    """A PartitionSpec for every parameter (same tree as `params`), checked against the mesh."""
    compiled = [(re.compile(pattern), spec) for pattern, spec in rules]

    def spec_for(path: tuple[Any, ...], leaf: Any) -> P:
        name = param_path(path)
        spec = next((s for pattern, s in compiled if pattern.search(name)), None)
        if spec is None:
            raise ValueError(f"{name}: no sharding rule matches this parameter")
        if len(spec) > len(leaf.shape):
            raise ValueError(f"{name}: spec {spec} has more axes than shape {leaf.shape}")
        for dim, axis in zip(leaf.shape, spec):
            if axis is not None and dim % mesh.shape[axis]:
                raise ValueError(f"{name}: dimension {dim} is not divisible by mesh.{axis}="
                                 f"{mesh.shape[axis]}")
        return spec

    return jax.tree_util.tree_map_with_path(spec_for, params)


def named(mesh: Mesh, specs: Any) -> Any:
    """NamedShardings for a tree of PartitionSpecs."""
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs,
                                  is_leaf=lambda x: isinstance(x, P))


def batch_spec(ndim: int) -> P:
    """Step inputs are [micro_batches, rows, ...]: rows are split over `data`."""
    return P(None, DATA, *([None] * (ndim - 2)))


def vary_over(tree: Any, axis: str) -> Any:
    """Mark values as varying over `axis` inside shard_map, so that gradients with respect to
    them stay per-device (summed explicitly once, after accumulating micro-batches) instead of
    being all-reduced on every micro-batch."""
    return jax.tree_util.tree_map(lambda x: jax.lax.pcast(x, axis, to="varying"), tree)
