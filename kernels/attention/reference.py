"""Dense masked tree attention: the ground truth every other implementation is tested against.

It materializes the [Sq, Skv] mask and scores, so it is for tests and small inputs only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jtree.kernels.precision import accumulation_dtype


def tree_mask(end: jax.Array, q_pos: jax.Array | None = None, *, window: int | None = None,
              key_pos: jax.Array | None = None) -> jax.Array:
    """[rows, Sq, Skv] boolean mask: query i (at key position q_pos[i], default i) sees key j iff
    j <= q_pos[i] < end[j], and with a `window` W also key_pos[q_pos[i]] - key_pos[j] < W
    (`key_pos` [rows, Skv]: the path position of every key)."""
    s = end.shape[-1]
    i = jnp.arange(s)[None, :, None] if q_pos is None else q_pos[:, :, None]
    j = jnp.arange(s)[None, None, :]
    mask = (j <= i) & (i < end[:, None, :])
    if window is not None:
        query_path = query_positions(key_pos, q_pos)
        mask = mask & (query_path[:, :, None] - key_pos[:, None, :] < window)
    return mask


def query_positions(key_pos: jax.Array, q_pos: jax.Array | None) -> jax.Array:
    """Path positions [rows, Sq] of the queries: those of the key positions they sit at."""
    key_pos = jnp.asarray(key_pos, jnp.int32)
    if q_pos is None:
        return key_pos
    return jnp.take_along_axis(key_pos, jnp.asarray(q_pos, jnp.int32), axis=1)


def attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    end: jax.Array,
    *,
    scale: float,
    softcap: float | None = None,
    q_pos: jax.Array | None = None,
    q_real: jax.Array | None = None,
    window: int | None = None,
    key_pos: jax.Array | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Dense attention under the mask, the check every kernel is tested against: q, k
    [.., head_dim Dk], v [.., Dv] (Dv may differ from Dk, as in MLA), output [.., Dv]. `q_real` (the
    real queries) has no work to skip here: every query's output is the mask's. `window` and
    `key_pos`: the sliding window along the path (`tree_mask`); `sinks` [Hq]: one extra logit per
    query head in every softmax denominator, with no value."""
    del q_real
    rows, sq, hq, d = q.shape
    dv = v.shape[3]  # may differ from d (MLA)
    hkv = k.shape[2]
    qg = q.reshape(rows, sq, hkv, hq // hkv, d)
    acc = accumulation_dtype(q.dtype, k.dtype, v.dtype)
    scores = jnp.einsum("rikgd,rjkd->rkgij", qg, k, preferred_element_type=acc) * scale
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    mask = tree_mask(end, q_pos, window=window, key_pos=key_pos)[:, None, None]
    scores = jnp.where(mask, scores, -jnp.inf)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        sink = jnp.broadcast_to(jnp.asarray(sinks, acc).reshape(hkv, hq // hkv)[
            None, :, :, None, None], (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    probs = probs.astype(v.dtype)
    out = jnp.einsum("rkgij,rjkd->rikgd", probs, v, preferred_element_type=acc)
    return out.reshape(rows, sq, hq, dv).astype(q.dtype)
