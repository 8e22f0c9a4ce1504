"""Where loaded parameters go: the default device, a mesh by the training sharding rules, or a
caller-chosen sharding per parameter."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jtree.parallel.sharding import MODEL, param_rules, partition_spec

ShardingFn = Callable[[str, tuple[int, ...]], jax.sharding.Sharding]


def mesh_shardings(config: Any, mesh: Mesh) -> ShardingFn:
    """NamedShardings from the train step's rules for `config`'s model (`jtree.parallel.sharding`, the
    one source of truth: tensor parallel over the mesh axis "model", fully sharded over "fsdp",
    every other mesh axis holds replicas), so a loaded model lands exactly where training expects it. An impossible split or
    a missing axis raises, naming the parameter."""
    rules = param_rules(config, mesh.shape.get(MODEL, 1))

    def sharding(name: str, shape: tuple[int, ...]) -> jax.sharding.Sharding:
        return NamedSharding(mesh, partition_spec(name.replace(".", "/"), shape, rules, mesh.shape))

    return sharding


def place(value: np.ndarray, name: str, sharding_fn: ShardingFn | None) -> jax.Array:
    if sharding_fn is None:
        return jax.device_put(value)
    return jax.device_put(value, sharding_fn(name, tuple(value.shape)))
