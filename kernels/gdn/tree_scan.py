"""Affine state maps combined along a tree's parent pointers by pointer jumping (docs/design.md
section 2, "GDN chunks as affine maps").

A chunk c of the gated delta rule changes the state entering it, S_in, into S_out = M_c S_in + N_c
(M_c [H, dk, dk], N_c [H, dk, dv]). Chunks are numbered per row and read their entering state from
a buffer slot given by `src` (the chunk tables of `jtree.layout.gdn_tables`): slots 0 .. NI - 1 hold
initial states, slot NI + c the state after chunk c. Following `src` from a chunk gives its chain of
ancestor chunks, ending at an initial slot.

Pointer jumping replaces the one-chunk-at-a-time scan by ceil(log2(depth)) rounds of batched
compositions, depth being the longest chain in chunks: every round composes each chunk's map with
the map of the chunk its pointer reaches, then follows that chunk's pointer, so the distance
covered doubles. The backward pass needs the transpose, which sends cotangents from descendants to
ancestors; it is the same doubling with sums over children instead of a chain
(`accumulate_from_descendants`). Both functions take plain arrays, not the chunk terms of
`jtree.kernels.gdn.delta_rule`, so that a context-parallel version can run them on maps exchanged between
devices. The number of rounds is data-dependent (a `lax.while_loop` that stops when every pointer
has reached an initial slot): a row of flat, one-chunk trees takes none, whatever its chunk count.
A while loop has no reverse-mode derivative, which is why `jtree.kernels.gdn.delta_rule` gives the parallel
route a custom VJP built on `accumulate_from_descendants`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jtree.kernels.precision import accumulation_dtype

_HIGHEST = jax.lax.Precision.HIGHEST


def _matmul(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(spec, a, b, precision=_HIGHEST,
                      preferred_element_type=accumulation_dtype(a.dtype, b.dtype))


def gather_slots(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B, N, ...] at per-row indices idx [B, K]: [B, K, ...]."""
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def compose_along_parents(m: jax.Array, n: jax.Array, src: jax.Array, n_initial: int
                          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Every chunk's map from the initial state at the top of its ancestor chain.

    m [B, NC, H, dk, dk], n [B, NC, H, dk, dv] the chunks' own maps; src [B, NC] their entering
    slots. Returns (m', n', root) with S_out[c] = m'[c] @ initial[root[c]] + n'[c], root [B, NC]
    an initial slot (< n_initial).
    """
    def not_done(carry) -> jax.Array:
        return jnp.any(carry[2] >= n_initial)

    def round_(carry):
        m, n, ptr = carry
        linked = ptr >= n_initial
        up = jnp.where(linked, ptr - n_initial, 0)
        m_up, n_up, ptr_up = gather_slots(m, up), gather_slots(n, up), gather_slots(ptr, up)
        keep = linked[..., None, None, None]
        # (M, N) after (M_up, N_up) = (M M_up, M N_up + N).
        n = jnp.where(keep, _matmul("...ij,...jv->...iv", m, n_up) + n, n)
        m = jnp.where(keep, _matmul("...ij,...jk->...ik", m, m_up), m)
        return m, n, jnp.where(linked, ptr_up, ptr)

    carry = (m, n, src)
    return jax.lax.while_loop(not_done, round_, carry)


def sum_into_slots(x: jax.Array, src: jax.Array, n_slots: int) -> jax.Array:
    """[B, n_slots, ...]: slot s gets the sum of x[c] over the chunks c with src[c] = s (the
    cotangent a buffer slot receives from the chunks that enter from it)."""
    b = src.shape[0]
    out = jnp.zeros((b, n_slots) + x.shape[2:], x.dtype)
    return out.at[jnp.arange(b)[:, None], src].add(x)


def accumulate_from_descendants(m: jax.Array, a: jax.Array, src: jax.Array, n_initial: int
                                ) -> jax.Array:
    """The transpose of the chain composition: x = a + T x, where (T x)[j] = M_j^T times the sum
    of x over j's child chunks (those entering from slot n_initial + j).

    With x the cotangent of each chunk's entering state and a its direct part, this is the
    backward of `compose_along_parents`. x[j] = sum over descendants k of j (k = j included) of
    P(j, k)^T a[k], P(j, k) the product of the maps of the chunks from j down to k's parent. Since
    x = (I + T)(I + T^2)(I + T^4) ... a, round r adds T^(2^r) x, which sends each chunk's x to its
    ancestor 2^r chunks up through the product of the 2^r maps in between; the pointers and
    products then double as in the forward rounds.
    """
    linked = src >= n_initial
    up = jnp.where(linked, src - n_initial, 0)
    # P(k): the map from the state entering the chunk `up` points to, to the state entering k.
    p = jnp.where(linked[..., None, None, None], gather_slots(m, up), 0.0)

    def not_done(carry) -> jax.Array:
        return jnp.any(carry[3])

    def round_(carry):
        x, p, up, linked = carry
        sent = jnp.where(linked[..., None, None, None], _matmul("...ij,...iv->...jv", p, x), 0.0)
        x = x + sum_into_slots(sent, up, x.shape[1])
        p = _matmul("...ij,...jk->...ik", p, gather_slots(p, up))
        return x, p, gather_slots(up, up), linked & gather_slots(linked, up)

    carry = (a, p, up, linked)
    return jax.lax.while_loop(not_done, round_, carry)[0]
