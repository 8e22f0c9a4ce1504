"""A CPU lowering of `jax.lax.ragged_dot` whose buffers are those of an accelerator's grouped
matmul, for `jtree.memory.plan`'s compiles on a CPU host.

On TPU, `ragged_dot` lowers to XLA's native ragged dot (a grouped matmul: temporaries the size
of its output). On CPU, jax lowers it through a dense reference that expands the ragged operand
to [groups, rows, features] (every group's mask of every row): for a MoE layer with 16 experts per
device and 32k x 8 assignments that is tens of GiB per layer. XLA:GPU (jax-cuda12-plugin 0.10.2)
expands it the same way: compiled for an H100, no ragged dot is left in the module
(docs/memory.md, "Every shipped config on the target its comment names"), which is why GPUs
run the experts as a loop over row tiles instead (`jtree.kernels.grouped_matmul`, buffers of the
rows' size as here): this lowering gives a TPU's buffer sizes and, up to that loop's padding, a
GPU's.
Under `grouped_matmul_lowering()` the CPU lowering instead loops over the groups (`lax.scan`),
multiplying the rows of one group at a time into an output-sized accumulator (or
stacking the per-group results when the ragged dimension is contracted, as in the weight
gradient): the same result (`tests/memory/test_memory_plan.py` compares values and gradients),
with a TPU's buffer sizes. The step is only compiled under it, never run.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax._src.interpreters import mlir as mlir_internal
from jax._src.lax.lax import _ragged_dot_general_impl, ragged_dot_general_p
from jax.interpreters import mlir


def grouped_ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                       ragged_dot_dimension_numbers: Any, precision: Any = None,
                       preferred_element_type: Any = None, group_offset: Any = None,
                       out_sharding: Any = None) -> jax.Array:
    """`ragged_dot_general` one group at a time. Batch dimensions, per-batch group sizes and
    group offsets (which `jtree.models.moe` does not use) go to jax's own dense lowering."""
    dn = ragged_dot_dimension_numbers
    (l_contract, r_contract), (l_batch, r_batch) = dn.dot_dimension_numbers
    if l_batch or r_batch or group_sizes.ndim != 1 or group_offset is not None:
        return _ragged_dot_general_impl(
            lhs, rhs, group_sizes, dn, precision=precision,
            preferred_element_type=preferred_element_type, group_offset=group_offset,
            out_sharding=out_sharding)
    ragged = dn.lhs_ragged_dimensions[0]
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    row = jax.lax.broadcasted_iota(group_sizes.dtype, lhs.shape, ragged)
    dot = functools.partial(jax.lax.dot_general, precision=precision,
                            preferred_element_type=preferred_element_type)

    def rows_of(g: jax.Array) -> jax.Array:
        return jnp.where((row >= starts[g]) & (row < ends[g]), lhs, jnp.zeros((), lhs.dtype))

    groups = jnp.arange(group_sizes.shape[0])
    if ragged in l_contract:  # [groups, lhs free, rhs free]: one product per group
        return jax.lax.map(lambda g: dot(rows_of(g), rhs, ((l_contract, r_contract), ((), ()))),
                           groups)
    (g_dim,) = dn.rhs_group_dimensions
    r_contract = tuple(d - (d > g_dim) for d in r_contract)

    def product(g: jax.Array) -> jax.Array:
        weights = jax.lax.dynamic_index_in_dim(rhs, g, g_dim, keepdims=False)
        return dot(rows_of(g), weights, ((l_contract, r_contract), ((), ())))

    # The first group's product starts the sum: a fresh zeros carry would not vary over the
    # manual mesh axes inside `shard_map` the way the products do.
    return jax.lax.fori_loop(1, group_sizes.shape[0], lambda g, acc: acc + product(g),
                             product(jnp.zeros((), groups.dtype)))

@contextlib.contextmanager
def grouped_matmul_lowering() -> Iterator[None]:
    """Lower `ragged_dot` on CPU with `grouped_ragged_dot` inside the block (what is traced and
    lowered there), and restore jax's own CPU lowering after."""
    table = mlir_internal._platform_specific_lowerings["cpu"]
    saved = table.get(ragged_dot_general_p)
    mlir.register_lowering(ragged_dot_general_p,
                           mlir.lower_fun(grouped_ragged_dot, multiple_results=False),
                           platform="cpu", cacheable=False)
    try:
        yield
    finally:
        if saved is None:
            del table[ragged_dot_general_p]
        else:
            table[ragged_dot_general_p] = saved
