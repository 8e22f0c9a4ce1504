"""The host side of context parallelism (`jtree.parallel.context`) and what it refuses by name.

The equivalence of the context-parallel step with the single-device one runs on 8 forced host
devices in `tests/step/test_mesh.py` (mode `cp` of `tests/mesh_worker.py`)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtree.layout.batch import stack
from jtree.layout.gdn_tables import default_chunk_count
from jtree.parallel.context import (
    context_batch, context_mask, halo_capacity, halo_positions, score_layout,
)
from jtree.kernels import TreeMask
from jtree.kernels.gdn.delta_rule import tree_gated_delta_rule
from jtree.layout.linearize import linearize
from tests.models_util import worst_rounding
from tests.strategies import seeded_forests

# Two devices of 4 tokens: tokens 4 and 5 are scored by positions 3 and 0 of device 0, token 7
# by position 6 of its own device.
PRED = np.array([[-1, 0, 1, 2, 3, 0, -1, 6]], np.int32)


def test_the_halo_holds_the_positions_other_devices_are_scored_by():
    assert halo_capacity(PRED, 2) == 2
    assert halo_capacity(PRED, 1) == 1  # nothing crosses: at least one slot
    # device 0 exports 0 and 3; device 1 nothing (its slots repeat the last real position)
    np.testing.assert_array_equal(halo_positions(PRED, 2, 3), [[0, 3, 3, 3, 3, 3]])
    # with 4 devices of 2: token 2 reads 1 (device 0), 4 reads 3, 5 reads 0
    np.testing.assert_array_equal(halo_positions(PRED, 4, 2), [[0, 1, 3, 3, 3, 3, 3, 3]])
    with pytest.raises(ValueError, match=r"halo: capacity 1, but row 0, device 0 of "
                                         r"mesh.context=2 exports 2"):
        halo_positions(PRED, 2, 1)


def test_scored_positions_are_laid_out_per_device():
    index = np.array([[1, 3, 2, 7, -1]], np.int32)
    np.testing.assert_array_equal(score_layout(index, 8, 2, width=3), [[1, 2, 3, 7, -1, -1]])
    np.testing.assert_array_equal(score_layout(index, 8, 4, width=2),
                                  [[1, -1, 2, 3, -1, -1, 7, -1]])
    # by default on the score-width ladder, at most a device's tokens
    np.testing.assert_array_equal(score_layout(index, 8, 2), [[1, 2, 3, -1, 7, -1, -1, -1]])
    with pytest.raises(ValueError, match=r"score width 2: a device of mesh.context=2 scores 3"):
        score_layout(index, 8, 2, width=2)


def test_context_batch_names_what_it_cannot_split():
    batch = linearize(seeded_forests(3, max_nodes=5), 24, score_len=24).inputs
    laid = context_batch(batch, 4)
    assert halo_capacity(batch.pred, 4) <= 8 and laid.halo.shape == (batch.shape[0], 4 * 8)
    kept = np.sort(laid.score_index[laid.score_index >= 0])
    np.testing.assert_array_equal(kept, np.sort(batch.score_index[batch.score_index >= 0]))
    with pytest.raises(ValueError, match=r"mesh.context=5 does not divide the row length S=24"):
        context_batch(batch, 5)
    with pytest.raises(ValueError, match=r"mesh.context=2: the batch has 'prefix_pred'"):
        context_batch(dataclasses.replace(batch, prefix_pred=np.full((batch.shape[0], 2), -1,
                                                                     np.int32)), 2)
    with_gdn = linearize(seeded_forests(3, max_nodes=5), 24, gdn_chunk_size=4).inputs
    with pytest.raises(ValueError, match=r"the batch has 'gdn' chunk tables; pass conv_kernel"):
        context_batch(with_gdn, 2)


@pytest.mark.slow
def test_gdn_tables_are_rebuilt_per_device_on_ladders_and_run_on_one_device():
    """`context_batch` replaces the one-device chunk tables by per-device ones (chunks never
    span a slice; capacities on ladders, one for every micro-batch); they are valid one-device
    tables too: the gated delta rule over them equals the rule over the original tables (float32,
    other chunks summing in other orders: within the error model of
    `tests.models_util.rounding_bound` against the rule over the original tables in float64)."""
    trees = seeded_forests(12, seed=3, max_nodes=7, max_seg=9)
    micro = [linearize(trees[i::2], 64, gdn_chunk_size=4, gdn_chunks=64, n_rows=2).inputs
             for i in range(2)]
    batch = stack(micro)
    laid = context_batch(batch, 4, conv_kernel=4)
    t = laid.gdn
    ncl = t.chunk_src.shape[-1] // 4
    assert ncl == default_chunk_count(16, 4, ncl) and ncl >= 4  # on the bucket ladder
    assert t.context_exports.shape[-1] % 4 == 0 and t.context_exports.shape[-1] // 4 >= 8
    assert t.conv_halo.shape[-1] // 4 >= 8
    owner = t.chunk_tokens // 16  # each chunk's tokens lie in its device's slice
    chunk_device = np.arange(4 * ncl) // ncl
    assert np.all((t.chunk_tokens < 0) | (owner == chunk_device[None, None, :, None]))
    real = np.asarray(batch.node) >= 0
    assert np.array_equal(t.token_slot >= 0, real)

    rng = np.random.default_rng(0)
    m, r, s = batch.shape
    q, k = (rng.normal(size=(m * r, s, 2, 4)).astype(np.float32) for _ in range(2))
    v = rng.normal(size=(m * r, s, 2, 3)).astype(np.float32)
    g = -rng.uniform(0.05, 0.5, size=(m * r, s, 2)).astype(np.float32)
    beta = rng.uniform(0.2, 0.9, size=(m * r, s, 2)).astype(np.float32)

    def rule(tables, dtype=np.float32):
        flat = jax.tree.map(lambda x: jnp.asarray(x).reshape(m * r, *x.shape[2:]), tables)
        return np.asarray(tree_gated_delta_rule(
            *(jnp.asarray(x, dtype) for x in (q, k, v, g, beta)), chunk_tokens=flat.chunk_tokens,
            chunk_src=flat.chunk_src, token_slot=flat.token_slot)[0])

    with jax.enable_x64(True):
        exact = rule(batch.gdn, np.float64)
    # A token's output sums over the tokens of its path (at most s).
    worst = worst_rounding({"o": rule(t)}, {"o": rule(batch.gdn)}, {"o": exact}, s)
    assert worst["excess"] <= 1.0, worst


def test_what_does_not_run_under_context_parallelism_is_refused_by_name():
    prefixed = TreeMask(np.arange(1, 5, dtype=np.int32)[None], np.ones((1, 2), np.int32))
    with pytest.raises(ValueError, match=r"^mesh.context > 1 with a redundancy-free part"):
        context_mask(prefixed, "context")
