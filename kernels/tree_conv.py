"""Depthwise causal conv1d along tree paths (the short convolution in front of Gated DeltaNet).

A causal conv of kernel size K mixes each token with the K - 1 tokens before it. On a DFS-ordered
tree the token before i is not i - 1 but pred(i), the previous token of i's path (the parent
node's last token for a node's first token), so the left context is the pred chain
pred(i), pred(pred(i)), ... and a path's first token sees zeros, like the zero left padding of
Hugging Face's `causal_conv1d_fn`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jtree.kernels.flat_tokens import scale_channels


def path_context(pred: jax.Array, width: int) -> jax.Array:
    """[R, S, width] row-local indices of the 1st..width-th previous tokens along each token's path
    (-1 where the path has fewer tokens). `pred` [R, S] is -1 for a path's first token."""
    if width == 0:
        return jnp.zeros(pred.shape + (0,), pred.dtype)
    steps = [pred]
    for _ in range(width - 1):
        prev = steps[-1]
        steps.append(jnp.where(prev >= 0, jnp.take_along_axis(pred, jnp.maximum(prev, 0), axis=1), -1))
    return jnp.stack(steps, axis=-1)


def tree_causal_conv1d(x: jax.Array, weight: jax.Array, context: jax.Array,
                       source: jax.Array | None = None) -> jax.Array:
    """out[i] = weight[:, K-1] * x[i] + sum_m weight[:, K-1-m] * src[context[i, m-1]], m = 1..K-1.

    x [R, S, D]; weight [D, K] (HF `conv1d.weight` [D, 1, K] squeezed); context [R, S, K - 1] from
    `path_context`, indexing `source` [R, S', D] (default: x itself; a part of a tree passes its
    cached left context followed by x). No bias, no activation; computed in x's dtype.
    """
    src = x if source is None else source
    kernel = weight.shape[-1]
    if context.shape != x.shape[:2] + (kernel - 1,):
        raise ValueError(f"context must be [R, S, K-1] = {x.shape[:2] + (kernel - 1,)}; "
                         f"got {context.shape}")
    w = weight.astype(x.dtype)
    out = scale_channels(x, w[:, kernel - 1])
    for m in range(1, kernel):
        idx = context[..., m - 1]
        shifted = jnp.take_along_axis(src, jnp.maximum(idx, 0)[..., None], axis=1)
        out = out + scale_channels(jnp.where((idx >= 0)[..., None], shifted, 0),
                                   w[:, kernel - 1 - m])
    return out
