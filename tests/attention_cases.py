"""Random tree masks and inputs for the attention kernel tests, and the comparison against the
dense `reference` implementation (forward output and q/k/v gradients)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jtree.layout.linearize import linearize
from jtree.kernels import TreeMask, tree_attention
from tests.strategies import explicit_tree, random_forest


def tree_end(seed: int, s: int, *, rows: int = 3, padding_rows: int = 1, max_trees: int = 12,
             max_nodes: int = 10, max_seg: int = 12) -> np.ndarray:
    """`end` [rows, s] of random multi-level forests packed several per row (DFS order); the last
    `padding_rows` rows hold only padding (end[j] = j + 1)."""
    rng = np.random.default_rng(seed)
    trees = []
    for _ in range(max_trees):
        tree = explicit_tree(random_forest(rng, max_nodes=max_nodes, max_seg=max_seg))
        if tree.n_tree_tokens <= s and linearize(trees + [tree], s).shape[0] <= rows - padding_rows:
            trees.append(tree)
    return linearize(trees, s, n_rows=rows).inputs.mask.end


def qkv(seed: int, rows: int, s: int, hq: int, hkv: int, d: int, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    shapes = [(rows, s, hq, d), (rows, s, hkv, d), (rows, s, hkv, d)]
    return [jnp.asarray(rng.normal(size=sh), dtype) for sh in shapes]


@functools.lru_cache(maxsize=None)
def _value_and_vjp(impl: str, softcap: float | None, options: tuple):
    """(q, k, v, end, cotangent) -> (out, dq, dk, dv), plain and jitted; cached so that every
    call with the same shapes reuses one compilation."""

    def run(q, k, v, end, cot):
        out, vjp = jax.vjp(lambda q, k, v: tree_attention(q, k, v, TreeMask(end), impl=impl,
                                                          softcap=softcap,
                                                          **dict(options)), q, k, v)
        return (out, *vjp(cot))

    return run, jax.jit(run)


def max_errors(end: np.ndarray, q, k, v, *, impl: str, jit_end: bool = True,
               softcap: float | None = None, **options) -> tuple[float, list[float]]:
    """Max abs difference of the output and of dq, dk, dv (for a random output cotangent)
    between `impl` and `reference`. With `jit_end`, `end` is a traced argument (as in the model);
    otherwise the host array is a constant of the jitted function (block tables built by numpy)."""
    cot = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), q.dtype)
    run, run_jit = _value_and_vjp(impl, softcap, tuple(sorted(options.items())))
    if jit_end:
        got = run_jit(q, k, v, jnp.asarray(end), cot)
    else:
        got = jax.jit(lambda q, k, v, cot: run(q, k, v, end, cot))(q, k, v, cot)
    want = _value_and_vjp("reference", softcap, ())[1](q, k, v, jnp.asarray(end), cot)
    diffs = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
             for a, b in zip(got, want)]
    return diffs[0], diffs[1:]
