import numpy as np
import pytest
from hypothesis import given, settings

from jtree.trees.tree import TrajectoryTree
from tests.strategies import forests


def test_trie_merge_structure():
    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 6, 7], [1, 2, 3], [1, 2, 3, 4, 5], [9, 8]]
    t = TrajectoryTree.from_sequences(seqs)
    assert [s.tolist() for s in t.segments] == [[1, 2, 3], [4, 5], [6, 7], [9, 8]]
    assert t.parents.tolist() == [-1, 0, 0, -1]
    # Path 2 ends at an internal node; paths 0 and 3 are duplicates on one node.
    assert t.path_nodes.tolist() == [1, 2, 0, 1, 3]
    for p, s in enumerate(seqs):
        assert t.path_tokens(p).tolist() == s
    s = t.stats()
    assert (s.n_tree_tokens, s.n_flat_tokens, s.n_paths, s.n_nodes, s.max_depth) == (9, 20, 5, 4, 2)
    assert s.por == pytest.approx(1 - 9 / 20)


def test_split_keeps_earlier_children():
    # The third sequence splits a node that already has children of its own.
    t = TrajectoryTree.from_sequences([[1, 2, 3, 4], [1, 2, 3, 4, 5], [1, 2, 7]])
    assert [s.tolist() for s in t.segments] == [[1, 2], [3, 4], [5], [7]]
    assert t.parents.tolist() == [-1, 0, 1, 0]
    assert [t.path_tokens(p).tolist() for p in range(3)] == [[1, 2, 3, 4], [1, 2, 3, 4, 5], [1, 2, 7]]


def test_token_arrays_hand_built():
    #   node0 [10, 11] -> node1 [12, 13], node2 [14] -> node3 [15]
    t = TrajectoryTree.from_nodes([-1, 0, 0, 2], [[10, 11], [12, 13], [14], [15]])
    a = t.token_arrays
    assert a["tokens"].tolist() == [10, 11, 12, 13, 14, 15]
    assert a["pos"].tolist() == [0, 1, 2, 3, 2, 3]
    assert a["end"].tolist() == [6, 6, 4, 4, 6, 6]
    # The first token of each child is scored from the parent's last token (index 1).
    assert a["pred"].tolist() == [-1, 0, 1, 2, 1, 4]
    assert t.path_nodes.tolist() == [1, 3]


def test_from_nodes_reorders_to_dfs():
    # Input order: leaf first, root last.
    t = TrajectoryTree.from_nodes([2, 2, -1], [[5], [6, 7], [1, 2]], path_nodes=[0, 1, 2])
    assert t.parents.tolist() == [-1, 0, 0]
    assert [t.path_tokens(p).tolist() for p in range(3)] == [[1, 2, 5], [1, 2, 6, 7], [1, 2]]


def test_figure4_por():
    # Seed 000 Figure 4's scale: 83k tree tokens, 164k flat tokens over 4 paths -> POR 0.494.
    t = TrajectoryTree.from_nodes(
        [-1, 0, 0, 0, 0], [np.ones(27_000, int)] + [np.full(14_000, k + 2) for k in range(4)]
    )
    s = t.stats()
    assert (s.n_tree_tokens, s.n_flat_tokens, s.n_paths) == (83_000, 164_000, 4)
    assert s.por == pytest.approx(1 - 83 / 164) and round(s.por, 3) == 0.494


@settings(max_examples=40)
@given(forests(n_trees=(1, 1)))
def test_paths_roundtrip_and_layout_invariants(trees):
    t = trees[0]
    a = t.token_arrays
    for p in range(t.n_paths):
        idx = t.path_token_index(p)
        # Positions count up along the path, and each token's pred is the previous path token.
        assert a["pos"][idx].tolist() == list(range(len(idx)))
        assert a["pred"][idx].tolist() == [-1] + idx[:-1].tolist()
        # Every earlier path token is visible from the last one under the `end` rule.
        last = idx[-1]
        visible = np.flatnonzero((np.arange(t.n_tree_tokens) <= last) & (last < a["end"]))
        assert visible.tolist() == sorted(idx.tolist())
    assert t.stats().n_flat_tokens == sum(len(t.path_token_index(p)) for p in range(t.n_paths))
    assert 0.0 <= t.stats().por < 1.0


def test_tree_token_values_reports_disagreement():
    t = TrajectoryTree.from_sequences([[1, 2, 3], [1, 2, 4]])
    vals, d = t.tree_token_values([np.array([0.0, -1.0, -2.0]), np.array([0.0, -1.5, -3.0])])
    assert vals.tolist() == [0.0, -1.0, -2.0, -3.0] and d == pytest.approx(0.5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sequences=[[1, 2], []]), "sequence 1: tokens is empty"),
        (dict(sequences=[[1, -2]]), r"sequence 0: tokens\[1\] = -2 is negative"),
        (dict(sequences=[[1, 2.5]]), "sequence 0: tokens must be integers"),
        (dict(sequences=[[1, 2]], vocab_size=2), r"sequence 0: tokens\[1\] = 2 is outside"),
        (dict(sequences=[[1, 2], [3]], loss_masks=[[1, 1], [1, 1]]),
         "sequence 1: loss_mask: expected 1 values"),
        (dict(sequences=[[1, 2]], advantages=[[1.0, 2.0, 3.0]]), "sequence 0: advantage: expected a scalar or 2"),
        (dict(sequences=[[1, 2], [1, 3]], advantages=[0.5, float("nan")]),
         "sequence 1: advantage\\[0\\] = nan is not finite"),
        (dict(sequences=[[1, 2]], old_logprobs=[[0.0, float("inf")]]),
         "sequence 0: old_logprobs\\[1\\] = inf is not finite"),
        (dict(sequences=[[1, 2]], weights=[-1.0]), "sequence 0: weight = -1.0"),
    ],
)
def test_from_sequences_rejects_bad_input(kwargs, match):
    seqs = kwargs.pop("sequences")
    with pytest.raises(ValueError, match=match):
        TrajectoryTree.from_sequences(seqs, **kwargs)


@pytest.mark.parametrize(
    "parents, segments, kwargs, match",
    [
        ([-1, 5], [[1], [2]], {}, "node 1: parent = 5 is out of range"),
        ([1, 0], [[1], [2]], {}, "node 0: parent chain forms a cycle"),
        ([-1, 2, 1], [[1], [2], [3]], {}, "node 1: parent chain forms a cycle"),
        ([-1, 0], [[1], []], {}, "node 1: tokens is empty"),
        ([-1, 0], [[1], [2]], dict(path_nodes=[3]), "path 0: path_nodes = 3 out of range"),
        ([-1, 0], [[1], [2, 3]], dict(loss_masks=[[1, 1]]), "path 0: loss_mask: expected 3 values"),
    ],
)
def test_from_nodes_rejects_bad_input(parents, segments, kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrajectoryTree.from_nodes(parents, segments, **kwargs)
