"""Sliding-window (path positions) and attention-sink cases for the kernel tests: random forests
with their path positions, and a dense oracle written here in numpy/jnp (not the `reference`
implementation under test).

The window rule checked: query i sees key j iff j <= i < end[j] and pos[i] - pos[j] < W, pos the
token's depth on its path. Sinks: softmax over [scores | s_h], the sink column dropped.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jtree.kernels import TreeMask, tree_attention
from tests.attention_cases import assert_elementwise_close, packed_forests


def tree_end_pos(seed: int, s: int, *, rows: int = 2, max_trees: int = 6, max_nodes: int = 10,
                 max_seg: int = 12, padding_rows: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(`end`, `pos`) [rows, s] of random multi-level forests (paths ending at internal nodes
    too), several per row; padding has end[j] = j + 1 and pos 0."""
    inputs = packed_forests(seed, s, rows=rows, padding_rows=padding_rows, max_trees=max_trees,
                            max_nodes=max_nodes, max_seg=max_seg)
    return np.asarray(inputs.mask.end, np.int32), np.asarray(inputs.pos, np.int32)


def deep_forest(rng: np.random.Generator, *, nodes: int = 10, seg: tuple[int, int] = (4, 40),
                vocab: int = 64) -> dict:
    """TrajectoryTree.from_nodes kwargs of a tree with long paths: mostly a chain (each node's
    parent the previous one) with branches at several levels, paths ending at every leaf and at
    some internal nodes."""
    parents = [-1] + [i - 1 if rng.random() < 0.6 else int(rng.integers(0, i))
                      for i in range(1, nodes)]
    segments = [rng.integers(0, vocab, size=int(rng.integers(*seg))).tolist()
                for _ in range(nodes)]
    children = {p for p in parents if p >= 0}
    leaves = [i for i in range(nodes) if i not in children]
    path_nodes = leaves + rng.choice(nodes, size=2).tolist()
    lengths = []
    for node in path_nodes:
        length, cur = 0, node
        while cur >= 0:
            length, cur = length + len(segments[cur]), parents[cur]
        lengths.append(length)
    return {"parents": parents, "segments": segments, "path_nodes": path_nodes,
            "loss_masks": [[1] * n for n in lengths], "weights": [1.0] * len(path_nodes)}


def deep_end_pos(seed: int, s: int, *, rows: int = 2, trees: int = 3, **kw
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(`end`, `pos`) of `deep_forest` trees packed into rows of s tokens."""
    inputs = packed_forests(seed, s, rows=rows, padding_rows=0, max_trees=trees, max_nodes=0,
                            max_seg=0, make=lambda rng: deep_forest(rng, **kw))
    return np.asarray(inputs.mask.end, np.int32), np.asarray(inputs.pos, np.int32)


def path_depth(end: np.ndarray) -> np.ndarray:
    """Depth of every token on its path, from `end` alone: the number of keys it sees, minus 1
    (an independent check of the batch's `pos`)."""
    s = end.shape[1]
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    vis = (j <= i)[None] & (i[None] < end[:, None, :])
    return vis.sum(-1) - 1


def oracle_mask(end: np.ndarray, pos: np.ndarray, window: int | None,
                q_pos: np.ndarray | None = None) -> np.ndarray:
    """[rows, Sq, Skv] bool, numpy loops-free but written from the rule."""
    rows, skv = end.shape
    qp = np.broadcast_to(np.arange(skv), (rows, skv)) if q_pos is None else q_pos
    j = np.arange(skv)[None, None, :]
    i = qp[:, :, None]
    mask = (j <= i) & (i < end[:, None, :])
    if window is not None:
        qpath = np.take_along_axis(pos, qp, axis=1)
        mask &= (qpath[:, :, None] - pos[:, None, :]) < window
    return mask


def oracle_attention(q, k, v, mask, sinks=None, scale=None):
    """Dense softmax attention in jnp (differentiable) under a numpy `mask` [rows, Sq, Skv]."""
    rows, sq, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    scale = d ** -0.5 if scale is None else scale
    kk = jnp.repeat(k.astype(jnp.float32), g, axis=2)
    vv = jnp.repeat(v.astype(jnp.float32), g, axis=2)
    s = jnp.einsum("rihd,rjhd->rhij", q.astype(jnp.float32), kk,
                   precision=jax.lax.Precision.HIGHEST) * scale
    s = jnp.where(jnp.asarray(mask)[:, None], s, -jnp.inf)
    if sinks is not None:
        col = jnp.broadcast_to(jnp.asarray(sinks, jnp.float32)[None, :, None, None],
                               (rows, hq, sq, 1))
        s = jnp.concatenate([s, col], axis=-1)
    p = jax.nn.softmax(s, axis=-1)
    if sinks is not None:
        p = p[..., :-1]
    return jnp.einsum("rhij,rjhd->rihd", p, vv, precision=jax.lax.Precision.HIGHEST)


def sink_gradient_scale(q, k, v, mask, sinks, d_out, scale=None):
    """[Hq] sum over queries of |p_sink_i delta_i|, the size of the terms whose signed sum is the
    sinks' gradient (what rounding errors of those terms are relative to)."""
    rows, sq, hq, d = q.shape
    g = hq // k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    kk = jnp.repeat(jnp.asarray(k, jnp.float32), g, axis=2)
    s = jnp.einsum("rihd,rjhd->rhij", jnp.asarray(q, jnp.float32), kk,
                   precision=jax.lax.Precision.HIGHEST) * scale
    s = jnp.where(jnp.asarray(mask)[:, None], s, -jnp.inf)
    sk = jnp.asarray(sinks, jnp.float32)[None, :, None]
    lse = jnp.logaddexp(jax.scipy.special.logsumexp(s, axis=-1), sk)  # [rows, Hq, Sq]
    out = oracle_attention(q, k, v, mask, sinks, scale)
    delta = jnp.einsum("rihd,rihd->rhi", jnp.asarray(d_out, jnp.float32), out)
    return jnp.abs(jnp.exp(sk - lse) * delta).sum(axis=(0, 2))


def window_mask(end, pos, window, prefix: int = 0, query_offset=None) -> TreeMask:
    """The TreeMask of a call: square, with the first `prefix` keys a cached prefix, or with a
    query offset (queries: keys query_offset + i)."""
    end, pos = jnp.asarray(end), jnp.asarray(pos)
    if prefix:
        return TreeMask(end[:, prefix:], end[:, :prefix], positions=pos, window=window)
    if query_offset is not None:
        return TreeMask(end, query_offset=jnp.int32(query_offset), positions=pos, window=window)
    return TreeMask(end, positions=pos, window=window)


@functools.lru_cache(maxsize=None)
def _run(impl: str, window, prefix: int, n_queries, options: tuple, sinks: bool):
    def run(q, k, v, sk, end, pos, cot, offset):
        def f(q, k, v, sk):
            kw = dict(options)
            if sinks:
                kw["sinks"] = sk
            if prefix:
                mask = window_mask(end, pos, window, prefix=prefix)
                return tree_attention(q, k[:, prefix:], v[:, prefix:], mask, impl=impl,
                                      prefix_k=k[:, :prefix], prefix_v=v[:, :prefix], **kw)
            if n_queries is not None:
                mask = TreeMask(end, query_offset=offset, positions=pos, window=window)
                return tree_attention(q, k, v, mask, impl=impl, **kw)
            return tree_attention(q, k, v, window_mask(end, pos, window), impl=impl, **kw)
        out, vjp = jax.vjp(f, q, k, v, sk)
        return (out, *vjp(cot))
    return jax.jit(run)


def check_against_oracle(impl: str, end, pos, window, *, hq=4, hkv=2, d=32, dtype=jnp.float32,
                         sinks: bool = False, prefix: int = 0, query_offset=None,
                         n_queries=None, seed: int = 0, bound_dtype=None, **options):
    """Run `impl` forward and backward (q, k, v and sinks) and compare with jax.grad of the dense
    oracle, element-wise (`assert_elementwise_close`). Queries: the keys after the first `prefix`
    (a cached prefix), or `n_queries` at `query_offset`, or all keys."""
    rows, skv = end.shape
    rng = np.random.default_rng(seed)
    if n_queries is not None:
        q_pos = np.broadcast_to(np.arange(query_offset, query_offset + n_queries), (rows, n_queries))
    elif prefix:
        q_pos = np.broadcast_to(np.arange(prefix, skv), (rows, skv - prefix))
    else:
        q_pos = None
    sq = skv if q_pos is None else q_pos.shape[1]
    q = jnp.asarray(rng.normal(size=(rows, sq, hq, d)), dtype)
    k = jnp.asarray(rng.normal(size=(rows, skv, hkv, d)), dtype)
    v = jnp.asarray(rng.normal(size=(rows, skv, hkv, d)), dtype)
    sk = jnp.asarray(rng.normal(size=(hq,)) + 1.0, jnp.float32)
    cot = jnp.asarray(rng.normal(size=q.shape), dtype)
    got = _run(impl, window, prefix, n_queries, tuple(sorted(options.items())), sinks)(
        q, k, v, sk, jnp.asarray(end), jnp.asarray(pos), cot, jnp.int32(query_offset or 0))
    mask = oracle_mask(end, pos, window, q_pos)
    up = lambda x: x.astype(jnp.float32)
    want_out, vjp = jax.vjp(lambda q, k, v, sk: oracle_attention(q, k, v, mask,
                                                                 sk if sinks else None),
                            up(q), up(k), up(v), sk)
    want = (want_out, *vjp(up(cot)))
    names = ("out", "dq", "dk", "dv", "dsinks")
    bound = bound_dtype or dtype
    for name, a, b in zip(names, got, want):
        if name == "dsinks" and not sinks:
            continue
        if float(jnp.max(jnp.abs(b))) == 0.0:  # W = 1 without sinks: softmax 1, dq exactly 0
            assert float(jnp.max(jnp.abs(a.astype(jnp.float32)))) <= 1e-5, (impl, window, name)
            continue
        assert_elementwise_close(a.astype(jnp.float32), b, bound, f"{impl} W={window} {name}")
    return got
