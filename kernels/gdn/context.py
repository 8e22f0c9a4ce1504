"""Gated DeltaNet and its path conv1d on a row split over a context-parallel mesh axis.

Runs inside `shard_map`: device k of the axis (its name a parameter) holds the slice
[k L, (k + 1) L) of a row of c L tokens (CP_CONVENTION: DFS order, gaps allowed, every index
global). The host tables come from `jtree.layout.context_gdn_tables`.

The recurrence (docs/kernels.md, "Gated DeltaNet under context parallelism"). A chunk's effect on
the state is affine, S_out = M S_in + N (docs/design.md section 2, "GDN chunks as affine maps"), and
chunks never span devices, so each device

1. computes its chunks' (M, N) and composes them along its local parent chains
   (`compose_along_parents`): every local chunk's map from the state entering the top of its local
   chain, a "local root" slot: zeros, or the final state of a chunk of an earlier device;
2. all-gathers the composed maps of its exported chunks (those that chunks of other devices enter
   from: `context_exports`), c E maps in all, never the chunks' activations;
3. resolves the boundary graph (each exported map points at the boundary slot its local chain
   starts from, always an earlier device's) by the same pointer jumping, every device redundantly:
   the exported chunks' final states, which a node whose parent is any number of devices back
   reads like one whose parent is on the previous device;
4. applies: every local chunk's entering state, then all outputs at once (`chunk_step`).

The backward pass is the transpose (a custom VJP; the rounds are `lax.while_loop`s): each device
sends its chunks' entering-state cotangents to its local roots (`accumulate_from_descendants`);
what reaches a boundary slot is summed over the axis (one psum of c E states); the transpose over
the boundary graph adds what reaches each exported chunk through the exported chunks below it;
each device adds that onto its exported chunks' final states and sends it up its chains again.

The conv1d: a token's k - 1 previous tokens along the pred chain may live on any earlier device.
Each device exports the conv inputs at its positions that other devices read (`halo`, from
`jtree.layout.context_gdn_tables.conv_halo_positions`, a fixed capacity H per device): one all-gather of
[c H, D] per layer (`context_conv_source`), never of the full activation; the context indices
into [the slice | the gathered halo] are computed once per forward (`context_conv_index`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jtree.kernels.gdn.chunks import (
    ChunkTerms,
    chunk_maps,
    chunk_step,
    over_chunks,
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
from jtree.kernels.tree_conv import path_context

_HIGHEST = jax.lax.Precision.HIGHEST


def _matmul(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(spec, a, b, precision=_HIGHEST,
                      preferred_element_type=accumulation_dtype(a.dtype, b.dtype))


def _gathered(x: jax.Array, axis: str) -> jax.Array:
    """The per-device blocks [R, n, ...] of every device of `axis`, in order: [R, c n, ...]."""
    return jax.lax.all_gather(x, axis, axis=1, tiled=True)


def _device(axis: str) -> jax.Array:
    return jax.lax.axis_index(axis).astype(jnp.int32)


def _slot_of(listing: jax.Array, values: jax.Array) -> jax.Array:
    """Per row, the first slot of the non-decreasing `listing` [R, n] holding each of `values`
    [R, m] (the export layout of `jtree.layout.context_gdn_tables`; meaningless for absent values)."""
    return jax.vmap(lambda a, v: jnp.searchsorted(a, v, side="left"))(listing, values).astype(
        jnp.int32)


def context_gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                             beta: jax.Array | None, *, chunk_tokens: jax.Array,
                             chunk_src: jax.Array, token_slot: jax.Array,
                             context_exports: jax.Array, axis: str) -> jax.Array:
    """`jtree.kernels.gdn.delta_rule.tree_gated_delta_rule` (roots starting from zeros) on this device's
    slice of rows split over mesh axis `axis`; call inside `shard_map`.

    q, k [R, L, Hk, dk], v [R, L, Hv, dv], g, beta [R, L, Hv]: the slice's tokens (`beta=None`:
    the recurrence without the delta rule, Mamba2's, as in `tree_chunk_terms`). The device's
    blocks of `jtree.layout.context_gdn_tables.context_gdn_tables`: `chunk_tokens` [R, NCL, C] (global
    positions), `chunk_src` [R, NCL] (0 or 1 + a global chunk), `token_slot` [R, L] (global),
    `context_exports` [R, E]. Returns o [R, L, Hv, dv] in v's dtype (0 on padding)."""
    r, length, hv, dv = v.shape
    if chunk_tokens.ndim != 3 or chunk_src.shape != chunk_tokens.shape[:2] or token_slot.shape != (
            r, length) or context_exports.ndim != 2:
        raise ValueError(f"chunk_tokens [R, NCL, C], chunk_src [R, NCL], token_slot [R, L] = "
                         f"{(r, length)}, context_exports [R, E] expected; got "
                         f"{chunk_tokens.shape}, {chunk_src.shape}, {token_slot.shape}, "
                         f"{context_exports.shape}")
    _, ncl, c = chunk_tokens.shape
    dev = _device(axis)
    chunk_off = dev * ncl
    terms = tree_chunk_terms(q, k, v, g, beta,
                             jnp.where(chunk_tokens >= 0, chunk_tokens - dev * length, -1))
    listing = _gathered(context_exports, axis)
    n_bnd = listing.shape[1]
    # Local slots: 0 zeros, 1 + b boundary entry b (an earlier device's chunk), 1 + n_bnd + c
    # the final state of local chunk c.
    parent = chunk_src - 1
    local = (parent >= chunk_off) & (parent < chunk_off + ncl)
    src = jnp.where(chunk_src <= 0, 0, jnp.where(local, 1 + n_bnd + parent - chunk_off,
                                                 1 + _slot_of(listing, parent)))
    own = jnp.clip(context_exports - chunk_off, 0, ncl - 1)
    o = _context_route(axis, n_bnd, terms, src, own)
    return tokens_from_chunks(o, jnp.where(token_slot >= 0, token_slot - chunk_off * c, -1),
                              v.dtype)


def _context_forward(axis: str, n_bnd: int, terms: ChunkTerms, src: jax.Array, own: jax.Array):
    """(o [R, NCL, H, C, dv], residuals): steps 1-4 of the module docstring."""
    m, n = chunk_maps(terms)
    m, n, root = compose_along_parents(m, n, src, 1 + n_bnd)
    m_bnd = _gathered(gather_slots(m, own), axis)
    root_bnd = _gathered(gather_slots(root, own), axis)
    # The boundary maps' roots are boundary entries (1 + b) or zeros (0): resolved from zeros,
    # a map's composed N is the state.
    _, states, _ = compose_along_parents(m_bnd, _gathered(gather_slots(n, own), axis), root_bnd, 1)
    init = jnp.concatenate([jnp.zeros_like(states[:, :1]), states], axis=1)
    s_out = _matmul("bchij,bchjv->bchiv", m, gather_slots(init, root)) + n
    buffer = jnp.concatenate([init, s_out], axis=1)
    flat = jax.tree_util.tree_map(over_chunks, terms)
    o, _, _ = chunk_step(flat, over_chunks(gather_slots(buffer, src)))
    o = o.reshape(src.shape + o.shape[1:])
    return o, (terms, src, own, buffer, m_bnd, root_bnd)


def _context_backward(axis: str, n_bnd: int, res, d_o: jax.Array):
    """The transpose of `_context_forward` (module docstring)."""
    terms, src, own, buffer, m_bnd, root_bnd = res
    n_init = 1 + n_bnd
    rows, ncl = src.shape
    flat = jax.tree_util.tree_map(over_chunks, terms)
    entering = over_chunks(gather_slots(buffer, src))
    d_o_flat = over_chunks(d_o)
    m, _ = chunk_maps(terms)
    _, vjp_out = jax.vjp(lambda s: chunk_step(flat, s)[0], entering)
    direct = vjp_out(d_o_flat)[0].reshape(m.shape[:3] + entering.shape[-2:])
    d_entering = accumulate_from_descendants(m, direct, src, n_init)
    # What this device's chunks send to each boundary entry, summed over the devices (only later
    # devices enter from an entry), then carried down the boundary graph: `remote` is the
    # cotangent of each exported chunk's final state from outside its own device.
    d_bnd = jax.lax.psum(sum_into_slots(d_entering, src, n_init)[:, 1:], axis)
    x = accumulate_from_descendants(m_bnd, _matmul("...ij,...iv->...jv", m_bnd, d_bnd),
                                    root_bnd, 1)
    remote = d_bnd + sum_into_slots(x, root_bnd, n_init)[:, 1:]
    n_own = own.shape[1]
    mine = jax.lax.dynamic_slice_in_dim(remote, _device(axis) * n_own, n_own, axis=1)
    d_final = jnp.zeros(m.shape[:2] + mine.shape[2:], remote.dtype)
    d_final = d_final.at[jnp.arange(rows)[:, None], own].add(mine)
    d_entering = d_entering + accumulate_from_descendants(
        m, _matmul("...ij,...iv->...jv", m, d_final), src, n_init)
    d_slots = d_final + sum_into_slots(d_entering, src, n_init + ncl)[:, n_init:]
    _, vjp = jax.vjp(chunk_step, flat, entering)
    d_flat, _ = vjp((d_o_flat, over_chunks(d_slots), jnp.zeros_like(flat.u)))
    d_terms = jax.tree_util.tree_map(lambda d, t: d.reshape(t.shape), d_flat, terms)
    zero_int = np.zeros(src.shape, jax.dtypes.float0)
    return d_terms, zero_int, np.zeros(own.shape, jax.dtypes.float0)


def _context_outputs(axis: str, n_bnd: int, terms: ChunkTerms, src: jax.Array, own: jax.Array
                     ) -> jax.Array:
    return _context_forward(axis, n_bnd, terms, src, own)[0]


# The rounds are `lax.while_loop`s (no reverse-mode derivative) and the transpose needs the
# boundary exchange in reverse: a custom VJP whose residuals are the local buffer of states.
_context_route = jax.custom_vjp(_context_outputs, nondiff_argnums=(0, 1))
_context_route.defvjp(_context_forward, _context_backward)


def context_conv_index(pred: jax.Array, halo: jax.Array, width: int, axis: str) -> jax.Array:
    """[R, L, width]: each slice token's 1st..width-th previous tokens along its path
    (`path_context` of the whole row) as indices into `context_conv_source`'s
    [the slice's L tokens | the c H gathered halo rows], -1 where the path has fewer tokens.

    `pred` [R, L] and `halo` [R, H] are the device's blocks (global positions; the halo from
    `jtree.layout.context_gdn_tables.conv_halo_positions`). The whole row's pred is all-gathered (int32 x S,
    once per forward) so that every chain is followed whatever devices it crosses."""
    rows, length = pred.shape
    offset = _device(axis) * length
    chain = jax.lax.dynamic_slice_in_dim(path_context(_gathered(pred, axis), width), offset,
                                         length, axis=1)
    slot = _slot_of(_gathered(halo, axis), chain.reshape(rows, -1)).reshape(chain.shape)
    inside = (chain >= offset) & (chain < offset + length)
    return jnp.where(chain < 0, -1, jnp.where(inside, chain - offset, length + slot))


def context_conv_source(x: jax.Array, halo: jax.Array, axis: str) -> jax.Array:
    """[R, L + c H, D]: the slice's conv inputs x [R, L, D] followed by every device's exported
    rows (its inputs at its `halo` [R, H] positions), the source `context_conv_index` indexes.
    The all-gather's transpose returns each exported row's gradient to its owner."""
    length = x.shape[1]
    local = jnp.clip(halo - _device(axis) * length, 0, length - 1)
    return jnp.concatenate([x, _gathered(jnp.take_along_axis(x, local[..., None], axis=1), axis)],
                           axis=1)
