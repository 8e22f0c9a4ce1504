"""Varying-manual-axes bookkeeping for kernels traced inside `shard_map`.

Under `shard_map(check_vma=True)`, a value computed from per-device inputs is typed as varying over
the mesh axes, while a constant (`jnp.zeros(...)`) is not. Two places need that type spelled out:
- a `lax` loop whose carry starts as such a constant and comes back varying is rejected;
- a `pallas_call` / `plgpu.kernel` cannot infer its outputs' type: each output's
  `ShapeDtypeStruct` must say which axes it varies over, and a `custom_vjp` rejects cotangents
  whose type differs from its primal inputs'.
Kernels do not know the mesh axis names, so they type carries and outputs as varying over whatever
axes their inputs vary over (a no-op outside `shard_map`).
"""

from __future__ import annotations

from typing import Any

import jax


def _axes(x: Any) -> frozenset[str]:
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", None) or ())  # earlier releases


def _union(refs: Any) -> frozenset[str]:
    return frozenset().union(*(_axes(r) for r in jax.tree_util.tree_leaves(refs)))


def varying_like(tree: Any, *refs: Any) -> Any:
    """Cast every leaf of `tree` to vary over the union of the mesh axes the `refs` vary over."""
    axes = _union(refs)

    def cast(x: Any) -> Any:
        missing = tuple(sorted(axes - _axes(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree_util.tree_map(cast, tree)


def varying_struct(shape: tuple[int, ...], dtype: Any, *refs: Any) -> jax.ShapeDtypeStruct:
    """A kernel output's type: `shape`, `dtype`, varying over the union of the axes the `refs`
    (the kernel's inputs) vary over."""
    return jax.ShapeDtypeStruct(shape, dtype,
                                manual_axis_type=jax.sharding.ManualAxisType(varying=_union(refs)))


def summed_like(x: jax.Array, ref: Any) -> jax.Array:
    """`x`, a cotangent of the primal `ref`, summed over the mesh axes it varies over and `ref`
    does not (the transpose of the implicit broadcast of an invariant input, e.g. a replicated
    parameter used with per-device data; a no-op outside `shard_map`)."""
    extra = tuple(sorted(_axes(x) - _axes(ref)))
    return jax.lax.psum(x, extra) if extra else x
