"""The chunk algebra of the gated delta rule (`jtree.kernels.gdn.delta_rule`): what a chunk of
C tokens computes without the state entering it, one chunk's step from that state, and its
affine map, for one log decay per head (Gated DeltaNet, Mamba2) or per key channel (KDA).

A chunk's state-independent terms (`ChunkTerms`: decays, the UT transform of the delta rule, the
masked q k^T) are computed for all chunks at once, batched over leading axes; the routes of
`jtree.kernels.gdn.delta_rule` and `jtree.kernels.gdn.context` then carry states between chunks
with `chunk_step` (one chunk from its entering state) or `chunk_maps` (S_out = M S_in + N).
`tree_chunk_terms` gathers a tree's chunk table into these terms and `tokens_from_chunks`
scatters the chunks' outputs back onto the tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jtree.kernels.flat_tokens import normalized_last_axis
from jtree.kernels.precision import accumulation_dtype

_HIGHEST = jax.lax.Precision.HIGHEST


def _einsum(spec: str, *args: jax.Array) -> jax.Array:
    return jnp.einsum(spec, *args, precision=_HIGHEST,
                      preferred_element_type=accumulation_dtype(*(a.dtype for a in args)))


def check_shapes(q, k, v, g, beta, initial_state) -> None:
    """One-line errors for arguments of the gated delta rule's entry points whose shapes do not
    fit together (`jtree.kernels.gdn.delta_rule`, `tree_chunk_terms`)."""
    if q.ndim != 4 or q.shape != k.shape or v.ndim != 4 or q.shape[:2] != v.shape[:2]:
        raise ValueError(f"q, k must be [B, T, Hk, dk] and v [B, T, Hv, dv]; got q {q.shape}, "
                         f"k {k.shape}, v {v.shape}")
    if v.shape[2] % q.shape[2]:
        raise ValueError(f"key heads ({q.shape[2]}) must divide value heads ({v.shape[2]})")
    heads = v.shape[:3]
    if g.shape not in (heads, heads + (q.shape[3],)) or (beta is not None and beta.shape != heads):
        raise ValueError(f"g must be [B, T, Hv] = {heads} or [B, T, Hv, dk] = "
                         f"{heads + (q.shape[3],)} and beta [B, T, Hv]; got {g.shape}, "
                         f"{None if beta is None else beta.shape}")
    if beta is None and g.shape != heads:
        raise ValueError(f"g: a decay per key channel {g.shape} needs beta (the delta rule); "
                         f"without it (beta=None) g must be [B, T, Hv] = {heads}")
    want = (v.shape[0], v.shape[2], q.shape[3], v.shape[3])
    if initial_state is not None and initial_state.shape != want:
        raise ValueError(f"initial_state must be [B, Hv, dk, dv] = {want}; got {initial_state.shape}")


def prepared_qk(q: jax.Array, k: jax.Array, n_v_heads: int) -> tuple[jax.Array, jax.Array]:
    """fp32 L2-normalised q and k (eps 1e-6, as HF/FLA), q scaled by dk**-0.5, one per value head."""
    rep = n_v_heads // q.shape[2]
    q = jnp.repeat(normalized_last_axis(q, 1e-6, mean=False), rep, axis=2) * (q.shape[-1] ** -0.5)
    return q, jnp.repeat(normalized_last_axis(k, 1e-6, mean=False), rep, axis=2)


def _unit_lower_inverse(a: jax.Array) -> jax.Array:
    """(I + a)^-1 for strictly lower-triangular a [..., C, C], by block doubling.

    Blocks of size 1 are their own inverses; two neighbouring inverted blocks combine as
    [[A, 0], [B, D]]^-1 = [[A^-1, 0], [-D^-1 B A^-1, D^-1]]. That is log2(C) rounds of batched
    matmuls, exact like forward substitution (no matrix powers), and much faster than a
    triangular solve on CPU. C is padded to a power of two with identity rows.
    """
    c = a.shape[-1]
    p = 1 << (c - 1).bit_length()
    lead = a.shape[:-2]
    a = jnp.pad(a, [(0, 0)] * len(lead) + [(0, p - c), (0, p - c)])
    inv = jnp.ones(lead + (p, 1, 1), a.dtype)
    size = 1
    while size < p:
        nb = p // (2 * size)
        blocks = a.reshape(lead + (nb, 2 * size, nb, 2 * size))
        diag = jnp.einsum("...iaib->...iab", blocks)  # the nb diagonal blocks of size 2 * size
        pair = inv.reshape(lead + (nb, 2, size, size))
        top, bottom = pair[..., 0, :, :], pair[..., 1, :, :]
        lower = -_einsum("...ij,...jk,...kl->...il", bottom, diag[..., size:, :size], top)
        zeros = jnp.zeros_like(top)
        inv = jnp.concatenate([jnp.concatenate([top, zeros], -1),
                               jnp.concatenate([lower, bottom], -1)], -2)
        size *= 2
    return inv.reshape(lead + (p, p))[..., :c, :c]


class ChunkTerms(NamedTuple):
    """State-independent quantities of every chunk, [..., H, C, ...] ([B, NC] or [B * NC] chunks
    of C tokens in front)."""

    u: jax.Array  # UT-transformed beta * v (v without the delta rule) [.., C, dv]
    w: jax.Array | None  # UT-transformed beta * k * decay-to-token [.., C, dk]; None without
    #                      the delta rule (the state enters no v_new: `linear_chunk_terms`)
    q_decayed: jax.Array  # q * decay from chunk start       [.., C, dk]
    k_decayed: jax.Array  # k * decay to chunk end           [.., C, dk]
    attn: jax.Array  # causal q k^T with pairwise decays     [.., C, C]
    chunk_decay: jax.Array  # decay over the whole chunk    [.., dk] per key channel, or [..]


Pairs = Callable[[jax.Array, jax.Array], jax.Array]


def _decays(g: jax.Array, per_channel: bool) -> tuple[jax.Array, Pairs]:
    """Cumulative log decay of g [..., H, C] (or [..., H, C, dk] `per_channel`) along C, and
    `pairs(a, b)` [..., H, C, C]: sum_d a_id b_jd exp(cum_i - cum_j) (cum_id - cum_jd per
    channel) for j <= i, 0 above the diagonal. Every exponent is <= 0: masked before exp, so
    nothing overflows however strongly g decays."""
    if per_channel:
        cum = jnp.cumsum(g, axis=-2)
        return cum, functools.partial(_channel_pairs, cum=cum)
    c = g.shape[-1]
    cum = jnp.cumsum(g, axis=-1)
    lower = jnp.tril(jnp.ones((c, c), bool))
    pair_decay = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    return cum, lambda a, b: _einsum("...id,...jd->...ij", a, b) * pair_decay


def _sub_block(c: int) -> int:
    """The sub-block size of `_channel_pairs` for chunks of c tokens: the power of two nearest
    below sqrt(c) (8 for C = 64), which minimises its C (C / s + s) dk decay terms."""
    return 1 << ((c.bit_length() - 1) // 2)


def _channel_pairs(a: jax.Array, b: jax.Array, *, cum: jax.Array) -> jax.Array:
    """`_decays`'s pairs with one decay per key channel: a, b, cum [..., C, dk] -> [..., C, C].

    The direct form weights each pair's product channel by channel, a [C, C, dk] tensor of
    decays (Hugging Face's chunk reference): chunks x heads x C^2 x dk floats, too many at C = 64.
    Instead the chunk is cut into sub-blocks of s tokens. A pair i > j in different sub-blocks
    factors through the last token e of j's sub-block, cum_i - cum_j = (cum_i - cum_e) +
    (cum_e - cum_j) with both parts <= 0 (cum decreases along C): b_j exp(cum_e - cum_j) per key,
    a_i exp(cum_i - cum_e) per (query, earlier sub-block), [C, C / s, dk]; one contraction over d
    then gives every off-diagonal sub-block. Only the diagonal sub-blocks take the direct form,
    [C, s, dk]. So C (C / s + s) dk decay terms (16 C dk at C = 64, s = 8, four times fewer)
    for the same C^2 dk multiply-adds as the direct form, and no exponent is ever positive.
    """
    c, dk = cum.shape[-2:]
    s = _sub_block(c)
    nb = -(-c // s)
    pad = [(0, 0)] * (cum.ndim - 2) + [(0, nb * s - c), (0, 0)]
    # Padding tokens (dropped at the end) repeat the last cum, keeping cum non-increasing.
    a, b = (jnp.pad(x, pad).reshape(x.shape[:-2] + (nb, s, dk)) for x in (a, b))
    cum = jnp.pad(cum, pad, mode="edge").reshape(cum.shape[:-2] + (nb, s, dk))
    lower = jnp.tril(jnp.ones((s, s), bool))[..., None]
    inside = jnp.exp(jnp.where(lower, cum[..., :, None, :] - cum[..., None, :, :], -jnp.inf))
    diagonal = _einsum("...xid,...xjd,...xijd->...xij", a, b, inside)  # [..., nb, s, s]
    end = cum[..., -1, :]  # [..., nb, dk] cum at each sub-block's last token
    later = (jnp.arange(nb)[:, None] > jnp.arange(nb)[None, :])[:, None, :, None]
    a_to_end = a[..., :, :, None, :] * jnp.exp(jnp.where(
        later, cum[..., :, :, None, :] - end[..., None, None, :, :], -jnp.inf))
    b_from_end = b * jnp.exp(end[..., :, None, :] - cum)
    pairs = _einsum("...xiyd,...yjd->...xiyj", a_to_end, b_from_end)  # [..., nb, s, nb, s]
    same = jnp.eye(nb, dtype=bool)[:, None, :, None]
    pairs = jnp.where(same, diagonal[..., :, :, None, :], pairs)
    return pairs.reshape(pairs.shape[:-4] + (nb * s, nb * s))[..., :c, :c]


def _on_keys(x: jax.Array, per_channel: bool) -> jax.Array:
    """Decays [..., C] (one per head) or [..., C, dk] (per key channel) made to multiply keys
    [..., C, dk]."""
    return x if per_channel else x[..., None]


def _terms(q, k, cum, pairs: Pairs, u, w) -> ChunkTerms:
    """The chunk terms shared by both recurrences, from q, k [..., H, C, dk] and the decays."""
    per_channel = cum.ndim == q.ndim
    last = cum[..., -1:, :] if per_channel else cum[..., -1:]
    return ChunkTerms(
        u=u,
        w=w,
        q_decayed=q * _on_keys(jnp.exp(cum), per_channel),
        k_decayed=k * _on_keys(jnp.exp(last - cum), per_channel),
        attn=pairs(q, k),
        chunk_decay=jnp.exp(last[..., 0, :] if per_channel else last[..., 0]),
    )


def delta_chunk_terms(q, k, v, g, beta) -> ChunkTerms:
    """q, k [..., C, H, dk] (prepared), v [.., dv], g [..., C, H] or [..., C, H, dk] (per key
    channel), beta [..., C, H]; all fp32; the leading axes (chunks) are batch axes.

    Empty slots (g = beta = k = 0) leave the state unchanged, so chunks may be padded at the end.
    """
    per_channel = g.ndim == q.ndim
    q, k, v = (jnp.swapaxes(x, -3, -2) for x in (q, k, v))  # [..., H, C, d]
    g = jnp.swapaxes(g, -3, -2) if per_channel else jnp.swapaxes(g, -2, -1)  # [..., H, C(, dk)]
    beta = jnp.swapaxes(beta, -2, -1)  # [..., H, C]
    c = beta.shape[-1]
    cum, pairs = _decays(g, per_channel)
    k_beta = k * beta[..., None]
    strict = jnp.tril(jnp.ones((c, c), bool), -1)
    ut = jnp.where(strict, pairs(k_beta, k), 0.0)
    # (I + ut)^-1 applied to beta*v and to beta*k*exp(cum): the WY form of the delta rule.
    inv = _unit_lower_inverse(ut)
    u = _einsum("...ij,...jd->...id", inv, v * beta[..., None])
    w = _einsum("...ij,...jd->...id", inv, k_beta * _on_keys(jnp.exp(cum), per_channel))
    return _terms(q, k, cum, pairs, u, w)


def linear_chunk_terms(q, k, v, g) -> ChunkTerms:
    """The chunk terms of the gated linear recurrence without the delta rule,
    S_t = exp(g_t) S_{t-1} + k_t v_t^T, o_t = S_t^T q_t (Mamba2's SSD with q = C, k = B,
    v = dt x, g = dt A): the delta rule's terms with no UT transform (u = v, w = None), so
    `chunk_step`, `chunk_maps` and every route of `jtree.kernels.gdn.delta_rule` run it
    unchanged. Same axes as
    `delta_chunk_terms`, without beta."""
    q, k, v = (jnp.swapaxes(x, -3, -2) for x in (q, k, v))  # [..., H, C, d]
    cum, pairs = _decays(jnp.swapaxes(g, -2, -1), per_channel=False)
    return _terms(q, k, cum, pairs, v, None)


def chunk_step(t: ChunkTerms, s: jax.Array):
    """One chunk from entering state s [B, H, dk, dv]: (output [B, H, C, dv], final state, v_new).

    Computed with B and H merged into one batch axis: the sequential scan runs this on one row
    (B = 1) of a tree, and XLA:CPU's batched matmuls with a leading size-1 axis are much slower
    (the whole scan about 1.5x)."""
    lead = s.shape[:2]

    def merged(x: jax.Array) -> jax.Array:
        return x.reshape((-1,) + x.shape[2:])

    u, q_dec, k_dec, attn = map(merged, (t.u, t.q_decayed, t.k_decayed, t.attn))
    s = merged(s)
    v_new = u if t.w is None else u - _einsum("nck,nkv->ncv", merged(t.w), s)
    o = _einsum("nck,nkv->ncv", q_dec, s) + _einsum("ncd,ndv->ncv", attn, v_new)
    decay = merged(t.chunk_decay).reshape(s.shape[0], -1, 1)  # over the key channels, or one
    s_out = s * decay + _einsum("nck,ncv->nkv", k_dec, v_new)
    return tuple(x.reshape(lead + x.shape[1:]) for x in (o, s_out, v_new))


def chunk_maps(t: ChunkTerms) -> tuple[jax.Array, jax.Array]:
    """Every chunk's affine map S_out = M S_in + N (M [.., dk, dk], N [.., dk, dv]), read off
    `chunk_step`: S_out = Diag(decay) S_in + K_dec^T (U - W S_in), so M = Diag(decay) - K_dec^T W
    (the WY form, never a product of per-token matrices; decay per key channel, or one scalar)
    and N = K_dec^T U. Without the delta rule (w None) M = Diag(decay)."""
    eye = jnp.eye(t.k_decayed.shape[-1], dtype=t.k_decayed.dtype)
    m = t.chunk_decay.reshape(t.k_decayed.shape[:-2] + (-1, 1)) * eye
    if t.w is not None:
        m = m - _einsum("...ck,...cj->...kj", t.k_decayed, t.w)
    return m, _einsum("...ck,...cv->...kv", t.k_decayed, t.u)


def over_chunks(x: jax.Array) -> jax.Array:
    """[B, NC, ...] -> [B * NC, ...]: every chunk a batch entry of `chunk_step`."""
    return x.reshape((-1,) + x.shape[2:])


def tree_chunk_terms(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                     beta: jax.Array | None, chunk_tokens: jax.Array) -> ChunkTerms:
    """The state-independent terms of every chunk of a chunk table: q, k [R, S, Hk, dk] (raw,
    normalised here), v [R, S, Hv, dv], g [R, S, Hv] or [R, S, Hv, dk] (per key channel), beta
    [R, S, Hv]; `chunk_tokens` [R, NC, C] the token
    (an index into S) of each chunk slot, -1 for an empty one (its slot is zeros, which leaves the
    state unchanged). Shared by the single-device routes and the context-parallel one
    (`jtree.kernels.gdn.context`), which gives its slice's tokens.

    `beta=None`: the gated linear recurrence without the delta rule (`linear_chunk_terms`,
    Mamba2's SSD), q and k used as given (no normalisation or scale), each of the Hk groups
    shared by Hv // Hk consecutive heads."""
    check_shapes(q, k, v, g, beta, None)
    r, (nc, c) = v.shape[0], chunk_tokens.shape[1:]
    if beta is None:
        rep = v.shape[2] // q.shape[2]
        q, k = jnp.repeat(q, rep, axis=2), jnp.repeat(k, rep, axis=2)
    else:
        q, k = prepared_qk(q, k, v.shape[2])
    filled = (chunk_tokens >= 0).reshape(r, nc * c)
    gather_idx = jnp.where(filled, chunk_tokens.reshape(r, nc * c), 0)

    acc = accumulation_dtype(v.dtype)

    def to_chunks(x: jax.Array) -> jax.Array:
        x = x.astype(acc)
        idx = gather_idx.reshape(gather_idx.shape + (1,) * (x.ndim - 2))
        mask = filled.reshape(filled.shape + (1,) * (x.ndim - 2))
        picked = jnp.where(mask, jnp.take_along_axis(x, idx, axis=1), 0.0)
        return picked.reshape((r * nc, c) + x.shape[2:])

    # The chunk terms are per chunk: computed over one flat chunk axis, which XLA:CPU runs faster
    # than [R, NC] when R = 1 (one tree row; see `jtree.kernels.flat_tokens`).
    if beta is None:
        terms = linear_chunk_terms(*(to_chunks(x) for x in (q, k, v, g)))
    else:
        terms = delta_chunk_terms(*(to_chunks(x) for x in (q, k, v, g, beta)))
    return jax.tree_util.tree_map(lambda x: x.reshape((r, nc) + x.shape[1:]), terms)


def tokens_from_chunks(o: jax.Array, token_slot: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """The chunks' outputs o [R, NC, H, C, dv] back on the tokens: [R, S, H, dv] in `dtype`,
    token s reading flat slot `token_slot` [R, S] (c * C + j), 0 where it is -1."""
    r, nc, hv, c, dv = o.shape
    o = jnp.swapaxes(o, 2, 3).reshape(r, nc * c, hv, dv)
    has_slot = (token_slot >= 0)[..., None, None]
    o = jnp.take_along_axis(o, jnp.where(token_slot >= 0, token_slot, 0)[..., None, None], axis=1)
    return jnp.where(has_slot, o, 0.0).astype(dtype)
