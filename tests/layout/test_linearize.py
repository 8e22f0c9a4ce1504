import numpy as np
import pytest
from hypothesis import given, settings

from jtree.kernels.attention.reference import tree_mask
from jtree.layout.bin_packing import first_fit_decreasing
from jtree.layout.linearize import linearize, unlinearize
from jtree.trees.tree import TrajectoryTree
from tests.strategies import forests


def _dense_mask_from_paths(batch):
    """Brute force: query i sees key j iff j is on i's path (same tree), or i == j on padding."""
    rows, s = batch.shape
    mask = np.zeros((rows, s, s), bool)
    mask[:, np.arange(s), np.arange(s)] = True
    for tree, r, off in zip(batch.layout.trees, batch.layout.rows, batch.layout.offsets):
        for node in range(tree.n_nodes):
            idx = tree._chain_token_index(node) + off
            # Every token of the node sees the node's path up to itself.
            for q in idx[idx >= off + tree.node_offsets[node]]:
                mask[r, q, idx[idx <= q]] = True
    return mask


@settings(max_examples=30)
@given(forests(n_trees=(1, 5)))
def test_layout_matches_path_semantics(trees):
    batch = linearize(trees, 48)
    np.testing.assert_array_equal(np.asarray(tree_mask(batch.inputs.mask.end)),
                                  _dense_mask_from_paths(batch))
    # Token / position / pred of every path, read back through unlinearize.
    toks = unlinearize(batch, batch.inputs.tokens)
    pos = unlinearize(batch, batch.inputs.pos)
    for t, tk, ps in zip(trees, toks, pos):
        for p in range(t.n_paths):
            assert tk[p].tolist() == t.path_tokens(p).tolist()
            assert ps[p].tolist() == list(range(t.path_lengths[p]))
    flat_pred = batch.inputs.pred
    for t, r, off in zip(trees, batch.layout.rows, batch.layout.offsets):
        for p in range(t.n_paths):
            idx = t.path_token_index(p) + off
            assert flat_pred[r, idx].tolist() == [-1] + idx[:-1].tolist()
    assert batch.inputs.valid.sum() == sum(t.n_tree_tokens for t in trees)
    pad = ~batch.inputs.valid
    assert np.all(batch.inputs.pred[pad] == -1)
    assert np.all(batch.inputs.coefficients.weight[pad] == 0)
    assert np.all(batch.inputs.node[pad] == -1)


def test_several_trees_per_row_and_dtypes():
    trees = [TrajectoryTree.from_sequences([[1, 2, 3], [1, 2, 4]]) for _ in range(3)]
    batch = linearize(trees, 16)
    assert batch.shape == (1, 16)
    assert batch.layout.offsets.tolist() == [0, 4, 8]
    x = batch.inputs
    for a in (x.tokens, x.pos, x.mask.end, x.pred, x.node):
        assert a.dtype == np.int32
    c = x.coefficients
    for a in (c.weight, c.adv_pos, c.adv_neg, c.old_logprobs):
        assert a.dtype == np.float32
    assert batch.inputs.mask.end[0, :12].tolist() == [4, 4, 3, 4, 8, 8, 7, 8, 12, 12, 11, 12]
    assert batch.inputs.node[0, :12].tolist() == [0, 0, 1, 2, 3, 3, 4, 5, 6, 6, 7, 8]
    assert batch.inputs.mask.end[0, 12:].tolist() == [13, 14, 15, 16]


def test_rows_and_buckets():
    trees = [TrajectoryTree.from_sequences([list(range(1, n + 1))]) for n in (10, 7, 5, 3)]
    batch = linearize(trees, 16, n_rows=4, len_buckets=(8, 12, 16))
    assert batch.shape == (4, 16)  # rows of 10+5 / 7+3 need the 16 bucket
    batch = linearize(trees[1:], 16, len_buckets=(8, 12, 16))
    assert batch.shape == (1, 16)  # 7+5+3 packs into one row, which needs the 16 bucket
    batch = linearize(trees[2:], 16, len_buckets=(8, 12, 16))
    assert batch.shape == (1, 8)
    with pytest.raises(ValueError, match="n_rows=1: the trees need 2 rows"):
        linearize(trees, 16, n_rows=1)


def test_tree_larger_than_row_is_rejected_with_its_size():
    trees = [TrajectoryTree.from_sequences([[1, 2]]), TrajectoryTree.from_sequences([list(range(20))])]
    with pytest.raises(ValueError, match="tree 1: has 20 tree tokens, more than seq_len=16"):
        linearize(trees, 16)


def test_first_fit_decreasing():
    sizes = [5, 9, 3, 7, 1]
    rows = first_fit_decreasing(sizes, 10)
    # FFD: 9 opens row 0, 7 row 1, 5 row 2, 3 joins the 7, 1 joins the 9.
    assert rows == [[1, 4], [3, 2], [0]]


def test_old_logprobs_disagreement_is_reported():
    t = TrajectoryTree.from_sequences([[1, 2, 3], [1, 2, 4]],
                                      old_logprobs=[[9.0, -1.0, -2.0], [0.0, -1.25, -3.0]])
    batch = linearize([t], 8)
    assert batch.has_old_logprobs
    assert batch.old_logprob_disagreement == pytest.approx(0.25)  # position 0 is ignored
