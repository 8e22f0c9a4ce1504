"""Tree cases of the gated delta rule kernels (`jtree.kernels.gdn.delta_rule`), shared by
tests/kernels/test_gdn.py and tests/kernels/test_kda.py: the heads' and rows' shapes, the deep
chain of chunks, every path's tokens gathered out of a tree batch, and the tree kernel against the
per-path recurrent kernel as jitted weighted losses with their gradients."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jtree.kernels.gdn.delta_rule import gated_delta_rule_recurrent, tree_gated_delta_rule
from jtree.layout.linearize import TreeBatch
from jtree.trees.tree import TrajectoryTree

HK, HV, DK, DV = 2, 4, 8, 6  # key heads, value heads, key and value head dims
# Tree batches of 4 rows of 64 tokens, their paths padded to 48 (shapes fixed, so hypothesis
# examples share one compile per chunk size and scan).
TREE_S, TREE_ROWS, MAX_PATHS = 64, 4, 48
SCANS = ("sequential", "parallel")


def path_index(batch: TreeBatch, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """[P, max_len] row-local token index of every path (-1 pad) and its row."""
    rows, idx = [], []
    for t, r, off in zip(batch.layout.trees, batch.layout.rows, batch.layout.offsets):
        for p in range(t.n_paths):
            chain = t.path_token_index(p) + off
            idx.append(np.pad(chain, (0, max_len - len(chain)), constant_values=-1))
            rows.append(r)
    return np.asarray(rows), np.stack(idx)


def gather_paths(x, rows: np.ndarray, idx: np.ndarray) -> jax.Array:
    """Per-path inputs [P, T, ...]; padding slots are zero (k = beta = g = 0: state unchanged)."""
    picked = x[rows[:, None], jnp.maximum(idx, 0)]
    return jnp.where((idx >= 0).reshape(idx.shape + (1,) * (x.ndim - 2)), picked, 0)


def deep_chain() -> list[TrajectoryTree]:
    """A chain of 12 nodes (chunk boundaries inside nodes: 17 chunks of 3 deep) with a leaf
    under every other chain node, and a small branching tree in the same row."""
    parents, segments = [], []
    for i in range(12):
        node = len(parents)
        parents.append(node - 2 if i % 2 == 0 and i else node - 1)  # after the previous leaf
        segments.append([i + 1] * (5 if i == 0 else 1 + i % 4))
        if i % 2:
            parents.append(node)
            segments.append([50 + i])
    chain = TrajectoryTree.from_nodes(parents, segments)
    return [chain, TrajectoryTree.from_nodes([-1, 0, 0], [[7, 7], [8], [9, 9, 9]])]


def path_losses(batch: TreeBatch, rng: np.random.Generator, n_paths: int | None = None) -> tuple:
    """The chunk tables of `batch` and a weighted loss on its paths, for comparing the tree kernel
    with a per-path reference: (tables, rows, idx, coeff, target, weight). rows, idx
    (`path_index`, padded to `n_paths` paths if given); coeff [P, T] a random coefficient per
    path token (0 on padding); target [R, S, HV, DV]; weight [R, S] the tree's per-token weight,
    W_t = the sum over the paths through t of the path's coefficient at t."""
    gdn = batch.inputs.gdn
    tables = (gdn.chunk_tokens, gdn.chunk_src, gdn.token_slot)
    rows, idx = path_index(batch, TREE_S)
    if n_paths is not None:
        assert len(rows) <= n_paths
        rows = np.pad(rows, (0, n_paths - len(rows)))
        idx = np.pad(idx, ((0, n_paths - len(idx)), (0, 0)), constant_values=-1)
    real = idx >= 0
    coeff = rng.uniform(0.5, 2.0, size=idx.shape).astype(np.float32) * real
    target = rng.normal(size=batch.shape + (HV, DV)).astype(np.float32)
    weight = np.zeros(batch.shape, np.float32)
    np.add.at(weight, (np.broadcast_to(rows[:, None], idx.shape)[real], idx[real]), coeff[real])
    return tables, rows, idx, coeff, target, weight


@functools.lru_cache(maxsize=None)
def tree_and_path_grads(scan: str):
    """Jitted (loss, outputs, grads) of the tree kernel (with `scan`) and of the per-path
    recurrent reference, for fixed shapes so hypothesis examples reuse one compilation per chunk
    size."""

    def tree_loss(q, k, v, g, beta, s0, tables, weight, target):
        o, _ = tree_gated_delta_rule(q, k, v, g, beta, chunk_tokens=tables[0],
                                     chunk_src=tables[1], token_slot=tables[2], initial_state=s0,
                                     scan=scan)
        return jnp.sum(weight[..., None, None] * o * target), o

    def path_loss(q, k, v, g, beta, s0, rows, idx, coeff, target):
        per_path = [gather_paths(x, rows, idx) for x in (q, k, v, g, beta)]
        o, _ = gated_delta_rule_recurrent(*per_path, s0[rows])
        return jnp.sum(coeff[..., None, None] * o * gather_paths(target, rows, idx)), o

    def grads(fn):
        return jax.jit(jax.value_and_grad(fn, argnums=range(6), has_aux=True))

    return grads(tree_loss), grads(path_loss)
