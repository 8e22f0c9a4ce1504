"""Sums along paths on the DFS layout: for every token, the sum of a per-token value over its
ancestors and itself, in O(S) without an S x S matrix (docs/design.md section 2, "Path sums").

Token j is visible from token i iff j <= i < end[j] (the attention mask's rule), so the ancestor
sum is A(i) = sum_{j <= i} x_j - sum_{j: end[j] <= i} x_j: every value enters the running sum at
its own position and leaves it at the end of its subtree. Scattering -x_j to end[j] and taking one
cumulative sum of that net stream gives A directly; its partial sums are themselves path sums, so
no two large cumulative sums are subtracted in the forward pass. The gradient (autodiff's
transpose: a reverse cumulative sum read at j and at end[j]) is the subtree sum
D(j) = sum_{j <= i < end[j]} g_i, also O(S).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def path_sum(x: jax.Array, end: jax.Array) -> jax.Array:
    """[..., S] -> [..., S]: out[i] = sum of x[j] over j <= i < end[j] (i's path prefix, i
    included). `end` is the layout's subtree end (int32, j < end[j] <= S)."""
    s = x.shape[-1]
    flat_x = x.reshape(-1, s)
    flat_end = end.reshape(-1, s)

    def row(values: jax.Array, ends: jax.Array) -> jax.Array:
        exits = jnp.zeros(s + 1, values.dtype).at[ends].add(values)  # end[j] = S: never leaves
        return jnp.cumsum(values - exits[:s])

    return jax.vmap(row)(flat_x, flat_end).reshape(x.shape)
