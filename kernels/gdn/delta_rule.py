"""The gated delta rule (Gated DeltaNet): recurrent reference, chunked form, and tree routing.

Per value head, with state S [d_k, d_v] and L2-normalised q, k (q also scaled by d_k**-0.5):

    S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,    o_t = S_t^T q_t

(Hugging Face `torch_recurrent_gated_delta_rule` / `torch_chunk_gated_delta_rule` with
`use_qk_l2norm_in_kernel=True`). Key heads are shared by `Hv // Hk` consecutive value heads.

KDA (Kimi Delta Attention, Kimi-Linear) is the same rule with one log decay per key channel,
g_t [d_k] instead of a scalar: S_t = (I - b_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T
(Hugging Face `recurrent_kimi_delta_attention` / `chunk_kimi_delta_attention`). Every entry point
takes g [..., Hv] (one decay per head) or [..., Hv, dk] (per key channel); only the decays inside
a chunk differ (`jtree.kernels.gdn.chunks`), and the scans and routes below run both
unchanged.

The chunked form (its per-chunk algebra: `jtree.kernels.gdn.chunks`) cuts the sequence into chunks
of C tokens. Everything inside a chunk that does not depend on the entering state (decays, the UT
transform of the delta rule, the masked q k^T) is computed for all chunks at once; a `lax.scan`
over chunks then applies the entering state. The scan carries a buffer of chunk-final states (slot
0: the initial state, slot c + 1: the state after chunk c) and each chunk reads its entering state
from a slot given by a table. A plain sequence reads slot c (the previous chunk). On a tree whose
node segments are cut into chunks, a node's first chunk reads its parent's last chunk instead, so
siblings start from the same parent state and the backward pass sums their gradients into it. The
backward pass (a custom VJP: a reverse scan) keeps one entering state per chunk, O(chunks x state),
never a copy of the buffer per step, and spends O(state) per chunk on routing.

The parallel tree scan (docs/design.md section 2, "GDN chunks as affine maps") computes the same
buffer without walking the chunks in order: every chunk's affine map S_out = M S_in + N, composed
along the parent pointers by pointer jumping (`jtree.kernels.gdn.tree_scan`), then every chunk's
outputs at once. `pick_scan` says which scan runs where.

The buffer may start with several initial states (slots 0 .. NI - 1, then chunk c writes slot
NI + c): a part of a tree that continues below tokens computed by an earlier part starts those
subtrees from the state the earlier part reached there, next to other trees of the same row that
start from zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jtree.kernels.gdn.chunks import (
    ChunkTerms,
    check_shapes,
    chunk_maps,
    chunk_step,
    delta_chunk_terms,
    over_chunks,
    prepared_qk,
    tokens_from_chunks,
    tree_chunk_terms,
)
from jtree.kernels.gdn.tree_scan import (
    accumulate_from_descendants,
    compose_along_parents,
    gather_slots,
    sum_into_slots,
)
from jtree.kernels.precision import accumulation_dtype
from jtree.kernels.varying_axes import varying_like

_HIGHEST = jax.lax.Precision.HIGHEST


def _einsum(spec: str, *args: jax.Array) -> jax.Array:
    return jnp.einsum(spec, *args, precision=_HIGHEST,
                      preferred_element_type=accumulation_dtype(*(a.dtype for a in args)))


def _zero_state(v: jax.Array, dk: int) -> jax.Array:
    return jnp.zeros((v.shape[0], v.shape[2], dk, v.shape[3]), accumulation_dtype(v.dtype))


def gated_delta_rule_recurrent(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Token-by-token reference. q, k [B, T, Hk, dk]; v [B, T, Hv, dv]; g (log decay, <= 0)
    [B, T, Hv] or, one per key channel (KDA), [B, T, Hv, dk]; beta [B, T, Hv]; initial_state
    [B, Hv, dk, dv] (zeros if None).

    Returns (o [B, T, Hv, dv] in v's dtype, final state [B, Hv, dk, dv] float32; float64 for
    float64 v, `accumulation_dtype`).
    """
    check_shapes(q, k, v, g, beta, initial_state)
    q, k = prepared_qk(q, k, v.shape[2])
    acc = accumulation_dtype(v.dtype)
    state = _zero_state(v, q.shape[-1]) if initial_state is None else initial_state.astype(acc)
    per_channel = g.ndim == 4

    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs
        decay = jnp.exp(g_t)
        s = s * (decay[..., None] if per_channel else decay[..., None, None])  # rows: key channels
        delta = (v_t - _einsum("bhkv,bhk->bhv", s, k_t)) * b_t[..., None]
        s = s + _einsum("bhk,bhv->bhkv", k_t, delta)
        return s, _einsum("bhkv,bhk->bhv", s, q_t)

    xs = tuple(jnp.moveaxis(x.astype(acc), 1, 0) for x in (q, k, v, g, beta))
    state, o = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(o, 0, 1).astype(v.dtype), state


def _chunks_first(terms: ChunkTerms) -> ChunkTerms:
    return jax.tree_util.tree_map(lambda x: jnp.moveaxis(x, 1, 0), terms)


def _scan_forward(terms: ChunkTerms, src: jax.Array, initial_states: jax.Array):
    """`initial_states` [B, NI, H, dk, dv] (the terms' dtype). Scan over chunks in order; chunk c
    enters with buffer[src[:, c]] and stores its final state in buffer[NI + c]. Returns
    (o [B, NC, H, C, dv], buffer [B, NI + NC, H, dk, dv]).
    """
    b, nc = src.shape
    n_init = initial_states.shape[1]
    buffer = jnp.zeros((b, n_init + nc) + initial_states.shape[2:], initial_states.dtype)
    buffer = buffer.at[:, :n_init].set(initial_states)
    rows = jnp.arange(b)

    def body(buf, xs):
        t, src_c, c = xs
        o, s_out, _ = chunk_step(t, buf[rows, src_c])
        return jax.lax.dynamic_update_index_in_dim(buf, s_out, c + n_init, axis=1), o

    xs = (_chunks_first(terms), src.T, jnp.arange(nc, dtype=jnp.int32))
    buffer, o = jax.lax.scan(body, buffer, xs)
    return jnp.moveaxis(o, 0, 1), buffer


def _buffer_route(forward, backward):
    """A route (chunk terms, src, initial states) -> (o, buffer) as a custom VJP whose residuals
    are the terms, src and the buffer of chunk-final states: slot NI + c is written only by chunk
    c, so the buffer holds every chunk's entering state, O(chunks x state)."""
    route = jax.custom_vjp(forward)

    def fwd(terms, src, initial_states):
        o, buffer = forward(terms, src, initial_states)
        return (o, buffer), (terms, src, buffer)

    route.defvjp(fwd, backward)
    return route


def _route_bwd(res, cts):
    """The sequential scan's backward: a reverse scan carrying the buffer's cotangent, adding each
    chunk's entering-state cotangent into its source slot in place, O(state) per chunk. (Plain
    autodiff adds a buffer-sized scatter per step, O(chunks^2 x state) time, and XLA copies the
    carry when a slice of it is emitted per step, which is why nothing read from the buffer is a
    scan output here.)"""
    terms, src, buffer = res
    d_o, d_buffer = cts
    b, nc = src.shape
    n_init = buffer.shape[1] - nc
    rows = jnp.arange(b)
    entering = jnp.moveaxis(buffer[rows[:, None], src], 1, 0)  # [NC, B, H, dk, dv]

    def body(d_buf, xs):
        t, src_c, c, s, d_o_c = xs
        _, vjp = jax.vjp(chunk_step, t, s)
        d_s_out = jax.lax.dynamic_index_in_dim(d_buf, c + n_init, axis=1, keepdims=False)
        d_t, d_s = vjp((d_o_c, d_s_out, jnp.zeros_like(t.u)))
        return d_buf.at[rows, src_c].add(d_s), d_t

    xs = (_chunks_first(terms), src.T, jnp.arange(nc, dtype=jnp.int32), entering,
          jnp.moveaxis(d_o, 1, 0))
    d_buf = varying_like(d_buffer.astype(buffer.dtype), terms, src, buffer, d_o)
    d_buf, d_terms = jax.lax.scan(body, d_buf, xs, reverse=True)
    d_terms = jax.tree_util.tree_map(lambda x: jnp.moveaxis(x, 0, 1), d_terms)
    d_src = np.zeros(src.shape, jax.dtypes.float0)
    return d_terms, d_src, d_buf[:, :n_init]


_route_chunks = _buffer_route(_scan_forward, _route_bwd)


def _parallel_forward(terms: ChunkTerms, src: jax.Array, initial_states: jax.Array):
    """`_scan_forward` (same arguments and results) by the parallel tree scan: every chunk's
    affine map, composed along the parent pointers in ceil(log2(depth)) rounds
    (`compose_along_parents`), gives every chunk's final state from the initial states; then all
    chunks' outputs at once from their entering states."""
    b, nc = src.shape
    flat = jax.tree_util.tree_map(over_chunks, terms)
    m, n = (x.reshape((b, nc) + x.shape[1:]) for x in chunk_maps(flat))
    m, n, root = compose_along_parents(m, n, src, initial_states.shape[1])
    s_out = _einsum("bchij,bchjv->bchiv", m, gather_slots(initial_states, root)) + n
    buffer = jnp.concatenate([initial_states, s_out], axis=1)
    o, _, _ = chunk_step(flat, over_chunks(gather_slots(buffer, src)))
    return o.reshape((b, nc) + o.shape[1:]), buffer


def _parallel_bwd(res, cts):
    """The cotangents of the entering states flow from descendants to ancestors by the transposed
    doubling (`accumulate_from_descendants`), then every chunk's terms get their cotangent at
    once. (Differentiating the rounds instead would keep every round's composed maps.)"""
    terms, src, buffer = res
    d_o, d_buffer = cts
    n_init = buffer.shape[1] - src.shape[1]
    d_buffer = varying_like(d_buffer.astype(buffer.dtype), terms, src, buffer, d_o)
    flat = jax.tree_util.tree_map(over_chunks, terms)
    entering = over_chunks(gather_slots(buffer, src))
    d_o_flat = over_chunks(d_o)
    # The entering states' cotangents from the chunks' own outputs and final-state slots, then
    # their sums over every descendant's.
    _, vjp_out = jax.vjp(lambda s: chunk_step(flat, s)[0], entering)
    m = chunk_maps(flat)[0]
    m = m.reshape(src.shape + m.shape[1:])
    direct = vjp_out(d_o_flat)[0].reshape(m.shape[:3] + entering.shape[-2:])
    direct = direct + _einsum("...ij,...iv->...jv", m, d_buffer[:, n_init:])
    d_entering = accumulate_from_descendants(m, direct, src, n_init)
    d_slots = d_buffer + sum_into_slots(d_entering, src, buffer.shape[1])
    _, vjp = jax.vjp(chunk_step, flat, entering)
    d_flat, _ = vjp((d_o_flat, over_chunks(d_slots[:, n_init:]), jnp.zeros_like(flat.u)))
    d_terms = jax.tree_util.tree_map(lambda d, t: d.reshape(t.shape), d_flat, terms)
    return d_terms, np.zeros(src.shape, jax.dtypes.float0), d_slots[:, :n_init]


_route_chunks_parallel = _buffer_route(_parallel_forward, _parallel_bwd)


def gated_delta_rule_chunked(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
    *,
    chunk_size: int = 64,
) -> tuple[jax.Array, jax.Array]:
    """Chunked form of `gated_delta_rule_recurrent` (same arguments and results)."""
    check_shapes(q, k, v, g, beta, initial_state)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    b, t, hv, dv = v.shape
    q, k = prepared_qk(q, k, hv)
    pad = -t % chunk_size
    nc = (t + pad) // chunk_size
    acc = accumulation_dtype(v.dtype)

    def chunked(x: jax.Array) -> jax.Array:
        x = jnp.pad(x.astype(acc), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return x.reshape((b, nc, chunk_size) + x.shape[2:])

    terms = delta_chunk_terms(*(chunked(x) for x in (q, k, v, g, beta)))
    state = (_zero_state(v, q.shape[-1]) if initial_state is None
             else initial_state.astype(acc))
    src = jnp.broadcast_to(jnp.arange(nc, dtype=jnp.int32), (b, nc))
    o, buffer = _route_chunks(terms, src, varying_like(state, terms)[:, None])
    o = jnp.swapaxes(o, 2, 3).reshape(b, nc * chunk_size, hv, dv)[:, :t]
    return o.astype(v.dtype), buffer[:, nc]


GDN_SCANS = ("auto", "sequential", "parallel")


def pick_scan(scan: str, platform: str) -> str:
    """The scan `tree_gated_delta_rule` runs for `scan` (one of `GDN_SCANS`) on `platform`
    (`jax.default_backend()` when traced).

    "auto" picks "parallel" on accelerators and "sequential" on CPU. The sequential scan is one
    dependent step per chunk (a few [C, dk] x [dk, dv] products): on a GPU or TPU each step is a
    launch too small to fill the device, which the parallel scan replaces by ceil(log2(depth))
    rounds of batched [dk, dk] compositions over all chunks. On CPU a step costs little more than
    its flops, so the compositions' extra ~2 x log2(depth) dk^3 flops per chunk make the parallel
    scan the slower one on every layout measured (one tree row of 128 chunks as well as 16 rows of
    8; docs/benchmarks.md, dk = 64, C = 64), and the reference stays. The accelerator side of
    the rule is reasoned, not measured (no accelerator here).
    """
    if scan not in GDN_SCANS:
        raise ValueError(f"scan: {scan!r} is not one of {GDN_SCANS}")
    if scan != "auto":
        return scan
    return "sequential" if platform == "cpu" else "parallel"


def tree_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array | None,
    *,
    chunk_tokens: jax.Array,
    chunk_src: jax.Array,
    token_slot: jax.Array,
    initial_state: jax.Array | None = None,
    initial_states: jax.Array | None = None,
    scan: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule on rows of DFS-ordered trees, each token seeing only its path.

    q, k [R, S, Hk, dk], v [R, S, Hv, dv], g [R, S, Hv] (or [R, S, Hv, dk]: KDA's decay per
    key channel), beta [R, S, Hv] per row token; `beta=None` runs
    the gated linear recurrence without the delta rule instead, S_t = exp(g_t) S_{t-1} +
    k_t v_t^T, o_t = S_t^T q_t with q, k as given (Mamba2's SSD: `tree_chunk_terms`), through the
    same routes. The chunk tables (see
    `jtree.layout.linearize`): `chunk_tokens` [R, NC, C] row-local token of each chunk slot (-1: empty;
    a chunk holds tokens of one node), `chunk_src` [R, NC] the buffer slot a chunk's entering state
    comes from (0: `initial_state` or zeros; c' + 1: the state after chunk c', i.e. the previous
    chunk of the node or the parent's last chunk), `token_slot` [R, S] flat slot c * C + j of
    each token (-1: in no chunk; its output is 0).

    `initial_states` [R, NI, Hv, dk, dv] (instead of `initial_state`) gives NI initial slots:
    `chunk_src` values 0 .. NI - 1 pick one of them and NI + c' the state after chunk c'.

    `scan` routes the states over the chunks: "sequential" (one chunk after another, the
    reference), "parallel" (the parallel tree scan: affine chunk maps composed along the parent
    pointers) or "auto" (`pick_scan`). Both give the same results up to rounding.

    Returns (o [R, S, Hv, dv] in v's dtype, buffer [R, NI + NC, Hv, dk, dv] of the initial and
    chunk-final states).
    """
    check_shapes(q, k, v, g, beta, initial_state)
    route = {"sequential": _route_chunks, "parallel": _route_chunks_parallel}[
        pick_scan(scan, jax.default_backend())]
    if initial_state is not None and initial_states is not None:
        raise ValueError("give initial_state or initial_states, not both")
    want = (v.shape[0], None, v.shape[2], q.shape[3], v.shape[3])
    if initial_states is not None and (initial_states.ndim != 5 or initial_states.shape[0] != want[0]
                                       or initial_states.shape[2:] != want[2:]):
        raise ValueError(f"initial_states must be [R, NI, Hv, dk, dv] = [{want[0]}, NI, "
                         f"{want[2]}, {want[3]}, {want[4]}]; got {initial_states.shape}")
    r, s, hv, dv = v.shape
    if chunk_tokens.ndim != 3 or chunk_tokens.shape[0] != r or chunk_src.shape != chunk_tokens.shape[:2]:
        raise ValueError(f"chunk_tokens must be [R, NC, C] and chunk_src [R, NC]; got "
                         f"{chunk_tokens.shape}, {chunk_src.shape} for {r} rows")
    if token_slot.shape != (r, s):
        raise ValueError(f"token_slot must be [R, S] = {(r, s)}; got {token_slot.shape}")
    terms = tree_chunk_terms(q, k, v, g, beta, chunk_tokens)
    acc = accumulation_dtype(v.dtype)
    if initial_states is not None:
        states = initial_states.astype(acc)
    elif initial_state is not None:
        states = initial_state.astype(acc)[:, None]
    else:
        states = _zero_state(v, q.shape[-1])[:, None]
    # Inside shard_map a zero initial state must vary like the chunks it meets, so that its
    # cotangent (the custom VJP's) has the type of the argument.
    o, buffer = route(terms, chunk_src, varying_like(states, terms, chunk_src))
    return tokens_from_chunks(o, token_slot, v.dtype), buffer
