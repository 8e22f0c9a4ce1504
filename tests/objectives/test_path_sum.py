"""The path-sum operator on the DFS layout: equal to a dense ancestor-mask matmul forward and
backward, and nothing of size S x S in its program."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jtree.layout.linearize import linearize
from jtree.objectives.path_sum import path_sum
from jtree.trees.tree import TrajectoryTree
from tests.strategies import seeded_forests


def _layout(seed: int, seq_len: int = 96):
    """end [rows, S] of random multi-level forests packed several per row, with padding."""
    trees = seeded_forests(6, seed=seed, max_nodes=9, with_rl=False)
    return np.asarray(linearize(trees, seq_len).inputs.mask.end)


def _dense(end: np.ndarray) -> np.ndarray:
    """[rows, S, S] ancestor mask: M[i, j] = j <= i < end[j]."""
    s = end.shape[-1]
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    return (j <= i) & (i < end[:, None, :])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_path_sum_equals_dense_ancestor_matmul(seed):
    end = _layout(seed)
    rng = np.random.default_rng(seed)
    x = rng.normal(size=end.shape)
    g = rng.normal(size=end.shape)
    mask = _dense(end).astype(np.float64)
    out, vjp = jax.vjp(lambda v: path_sum(v, jnp.asarray(end)), jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(out, np.einsum("rij,rj->ri", mask, x), rtol=1e-5, atol=1e-5)
    (grad,) = vjp(jnp.asarray(g, jnp.float32))  # the transpose: sums over each subtree
    np.testing.assert_allclose(grad, np.einsum("rij,ri->rj", mask, g), rtol=1e-5, atol=1e-5)


def _all_shapes(jaxpr) -> list[tuple[int, ...]]:
    shapes = []
    for eqn in jaxpr.eqns:
        for v in (*eqn.invars, *eqn.outvars):
            if hasattr(v.aval, "shape"):
                shapes.append(tuple(v.aval.shape))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            shapes += _all_shapes(sub)
    return shapes


def test_path_sum_program_holds_nothing_of_size_s_squared():
    end = jnp.asarray(_layout(3, seq_len=128))
    s = end.shape[-1]

    def fwd_bwd(x, g):
        out, vjp = jax.vjp(lambda v: path_sum(v, end), x)
        return out, vjp(g)[0]

    x = jnp.zeros(end.shape, jnp.float32)
    shapes = _all_shapes(jax.make_jaxpr(fwd_bwd)(x, x).jaxpr)
    assert shapes and max(int(np.prod(sh)) for sh in shapes) < s * s, sorted(set(shapes))


def test_path_sum_precision_at_a_long_row():
    """float32 path sums of a 32k-token row of deep random trees vs float64 (measured: 5e-7 and
    4e-7 of the largest value, forward and backward)."""
    rng = np.random.default_rng(0)
    s = 32768
    trees = []
    while sum(t.n_tree_tokens for t in trees) < s - 2048:
        n = 200
        parents = [-1] + [int(rng.integers(max(0, i - 5), i)) for i in range(1, n)]
        segments = [rng.integers(0, 50, size=int(rng.integers(1, 20))).tolist() for _ in range(n)]
        trees.append(TrajectoryTree.from_nodes(parents, segments))
    end = np.asarray(linearize(trees, s).inputs.mask.end)
    x = rng.normal(size=end.shape)
    g = rng.normal(size=end.shape)
    out, vjp = jax.vjp(lambda v: path_sum(v, jnp.asarray(end)), jnp.asarray(x, jnp.float32))
    (grad,) = vjp(jnp.asarray(g, jnp.float32))
    want = np.zeros_like(x)
    want_grad = np.zeros_like(g)
    for r in range(end.shape[0]):  # float64 with the same O(S) rules
        exits = np.zeros(s + 1)
        np.add.at(exits, end[r], x[r])
        want[r] = np.cumsum(x[r] - exits[:s])
        suffix = np.r_[np.cumsum(g[r][::-1])[::-1], 0.0]
        want_grad[r] = suffix[np.arange(s)] - suffix[end[r]]
    fwd_err = np.abs(np.asarray(out) - want).max() / np.abs(want).max()
    bwd_err = np.abs(np.asarray(grad) - want_grad).max() / np.abs(want_grad).max()
    assert fwd_err <= 5e-6 and bwd_err <= 5e-6, (fwd_err, bwd_err)
