"""Varying-manual-axes bookkeeping for loop carries inside `shard_map`.

Under `shard_map(check_vma=True)`, a value computed from per-device inputs is typed as varying over
the mesh axes, while a constant (`jnp.zeros(...)`) is not. A `lax` loop whose carry starts as such a
constant and comes back varying is rejected. Kernels do not know the mesh axis names, so they mark
their initial carries as varying over whatever axes their inputs vary over (a no-op outside
`shard_map`).
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


def varying_like(tree: Any, *refs: Any) -> Any:
    """Cast every leaf of `tree` to vary over the union of the mesh axes the `refs` vary over."""
    axes = frozenset().union(*(_axes(r) for leaf in refs for r in jax.tree_util.tree_leaves(leaf)))

    def cast(x: Any) -> Any:
        missing = tuple(sorted(axes - _axes(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree_util.tree_map(cast, tree)
