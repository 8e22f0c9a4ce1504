"""Where loaded parameters go: the default device, a mesh by the architecture's partition table,
or a caller-chosen sharding per parameter."""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jtree.hf.spec import Architecture

ShardingFn = Callable[[str, tuple[int, ...]], jax.sharding.Sharding]


def mesh_shardings(arch: Architecture, mesh: Mesh) -> ShardingFn:
    """NamedShardings from `arch.partition` (Megatron-style over the mesh axis "model"; every
    other mesh axis holds replicas). A split dimension must divide evenly; an error names the
    parameter otherwise."""

    def sharding(name: str, shape: tuple[int, ...]) -> jax.sharding.Sharding:
        spec = arch.partition_spec(name)
        for dim, axis in zip(shape, spec):
            if axis is None:
                continue
            if axis not in mesh.shape:
                raise ValueError(f"parameter {name!r}: mesh axes {tuple(mesh.shape)} have no "
                                 f"axis {axis!r} (partition table of {arch.hf_name})")
            if dim % mesh.shape[axis]:
                raise ValueError(f"parameter {name!r}: dimension {dim} of shape {shape} does not "
                                 f"divide over mesh axis {axis!r} of size {mesh.shape[axis]}")
        return NamedSharding(mesh, PartitionSpec(*spec))

    return sharding


def place(value: np.ndarray, name: str, sharding_fn: ShardingFn | None) -> jax.Array:
    if sharding_fn is None:
        return jax.device_put(value)
    return jax.device_put(value, sharding_fn(name, tuple(value.shape)))
