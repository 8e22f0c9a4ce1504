import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jtree.kernels.attention.reference import tree_mask
from jtree.kernels.block_tables import (
    EMPTY,
    FULL,
    PARTIAL,
    block_tables,
    classify_blocks,
    required_blocks,
)
from jtree.layout.linearize import linearize
from tests.strategies import forests


def _dense_classes(end, bq, bk):
    mask = np.asarray(tree_mask(jnp.asarray(end)))
    rows, s, _ = mask.shape
    blocks = mask.reshape(rows, s // bq, bq, s // bk, bk)
    any_ = blocks.any(axis=(2, 4))
    all_ = blocks.all(axis=(2, 4))
    return np.where(all_, FULL, np.where(any_, PARTIAL, EMPTY))


@settings(max_examples=30)
@given(trees=forests(n_trees=(1, 6), max_nodes=7, max_seg=9),  # a tree fits a row: 7 * 9 <= 64
       blocks=st.sampled_from([(4, 4), (8, 4), (4, 8), (16, 8), (2, 16)]))
def test_classes_match_dense_mask(trees, blocks):
    bq, bk = blocks
    # One row more than the trees can need: includes padding rows and padding tails.
    batch = linearize(trees, 64, n_rows=len(trees) + 1)
    want = _dense_classes(batch.inputs.mask.end, bq, bk)
    np.testing.assert_array_equal(classify_blocks(batch.inputs.mask.end, bq, bk), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(classify_blocks, static_argnums=(1, 2))(
        jnp.asarray(batch.inputs.mask.end), bq, bk)), want)
    tables = block_tables(batch.inputs.mask.end, bq, bk)
    jt = jax.jit(block_tables, static_argnums=(1, 2))(jnp.asarray(batch.inputs.mask.end), bq, bk)
    for t in (tables, jt):
        for r in range(want.shape[0]):
            for i in range(want.shape[1]):
                listed = np.asarray(t.kv_blocks)[r, i, : int(t.kv_count[r, i])]
                assert listed.tolist() == np.flatnonzero(want[r, i] != EMPTY).tolist()
                assert np.asarray(t.kv_kind)[r, i, : len(listed)].tolist() == want[r, i, listed].tolist()
                assert np.all(np.asarray(t.kv_kind)[r, i, len(listed):] == EMPTY)
            for j in range(want.shape[2]):
                listed = np.asarray(t.q_blocks)[r, j, : int(t.q_count[r, j])]
                assert listed.tolist() == np.flatnonzero(want[r, :, j] != EMPTY).tolist()


def test_padding_entries_repeat_the_last_block():
    end = np.array([[4, 4, 4, 4, 8, 8, 8, 8]], np.int32)  # two separate 4-token sequences
    t = block_tables(end, 2, 2)
    assert t.kv_count.tolist() == [[1, 2, 1, 2]]
    assert t.kv_blocks.tolist() == [[[0, 0, 0, 0], [0, 1, 1, 1], [2, 2, 2, 2], [2, 3, 3, 3]]]
    assert t.kv_kind.tolist() == [[[1, 0, 0, 0], [2, 1, 0, 0], [1, 0, 0, 0], [2, 1, 0, 0]]]
    assert required_blocks(end, 2, 2) == (2, 2)


def test_budget_too_small_is_an_error():
    end = np.full((1, 8), 8, np.int32)
    with pytest.raises(ValueError, match="need 4 kv-blocks per q-block"):
        block_tables(end, 2, 2, max_kv_blocks=2)
    with pytest.raises(ValueError, match="must be a multiple"):
        block_tables(end, 3, 2)
