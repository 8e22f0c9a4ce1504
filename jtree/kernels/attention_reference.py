"""Dense masked tree attention: the ground truth every other implementation is tested against.

It materializes the [Sq, Skv] mask and scores, so it is for tests and small inputs only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def tree_mask(end: jax.Array, q_pos: jax.Array | None = None) -> jax.Array:
    """[rows, Sq, Skv] boolean mask: query i (at key position q_pos[i], default i) sees key j iff
    j <= q_pos[i] < end[j]."""
    s = end.shape[-1]
    i = jnp.arange(s)[None, :, None] if q_pos is None else q_pos[:, :, None]
    j = jnp.arange(s)[None, None, :]
    return (j <= i) & (i < end[:, None, :])


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
) -> jax.Array:
    """Dense attention under the mask, the check every kernel is tested against. `q_real` (the
    real queries) has no work to skip here: every query's output is the mask's."""
    del q_real
    rows, sq, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(rows, sq, hkv, hq // hkv, d)
    scores = jnp.einsum("rikgd,rjkd->rkgij", qg, k, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    mask = tree_mask(end, q_pos)[:, None, None]
    scores = jnp.where(mask, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("rkgij,rjkd->rikgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(rows, sq, hq, d).astype(q.dtype)
