import json

import numpy as np
import pytest

from jtree.trees.jsonl import read_sequence_groups, read_trees, write_sequence_groups, write_trees
from tests.strategies import explicit_tree, random_forest


def _same_tree(a, b):
    assert a.n_paths == b.n_paths
    for p in range(a.n_paths):
        assert a.path_tokens(p).tolist() == b.path_tokens(p).tolist()
        np.testing.assert_array_equal(a.loss_masks[p], b.loss_masks[p])
        np.testing.assert_allclose(a.advantages[p], b.advantages[p])
        np.testing.assert_allclose(a.old_logprobs[p], b.old_logprobs[p])
    np.testing.assert_allclose(a.weights, b.weights)


def test_roundtrips(tmp_path):
    rng = np.random.default_rng(0)
    trees = [explicit_tree(random_forest(rng)) for _ in range(5)]
    write_trees(tmp_path / "t.jsonl", trees)
    write_sequence_groups(tmp_path / "g.jsonl", trees)
    for a, b, c in zip(trees, read_trees(tmp_path / "t.jsonl"),
                       read_sequence_groups(tmp_path / "g.jsonl")):
        _same_tree(a, b)
        _same_tree(a, c)
        assert c.n_tree_tokens <= a.n_tree_tokens  # the trie merges siblings with equal starts


def test_groups_merge_in_order_of_first_appearance(tmp_path):
    lines = [{"group": "b", "tokens": [1, 2, 3]}, {"group": "a", "tokens": [4]},
             {"group": "b", "tokens": [1, 2, 4]}]
    (tmp_path / "g.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    trees = read_sequence_groups(tmp_path / "g.jsonl")
    assert [t.n_paths for t in trees] == [2, 1] and trees[0].n_tree_tokens == 4


@pytest.mark.parametrize(
    "lines, match",
    [
        (['{"group": 1, "tokens": [1, 2]}', '{"group": 1, "tokens": []}'], r"g\.jsonl:2: tokens is empty"),
        (['{"group": 1, "tokens": [1, 2], "loss_mask": [1]}'], r"g\.jsonl:1: loss_mask: expected 2"),
        (['{"group": 1, "tokens": [1, 2], "advantage": NaN}'], r"g\.jsonl:1: advantage\[0\] = nan"),
        (['{"group": 1}'], r"g\.jsonl:1: missing field 'tokens'"),
        (['{"group": 1, "tokens": [1], "score": 2}'], r"g\.jsonl:1: unknown field 'score'"),
        (['{"group": 1, "tokens": [1, 2]', ], r"g\.jsonl:1: invalid JSON"),
        (['{"group": 1, "tokens": [1, 2], "advantage": 1}', '{"group": 1, "tokens": [1, 3]}'],
         r"g\.jsonl:2: advantage is missing"),
    ],
)
def test_bad_group_lines_name_file_and_line(tmp_path, lines, match):
    (tmp_path / "g.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=match):
        read_sequence_groups(tmp_path / "g.jsonl")


def test_bad_tree_line_names_file_line_and_node(tmp_path):
    (tmp_path / "t.jsonl").write_text(
        json.dumps({"parents": [-1, 0], "segments": [[1], [2]]}) + "\n"
        + json.dumps({"parents": [1, 0], "segments": [[1], [2]]}) + "\n")
    with pytest.raises(ValueError, match=r"t\.jsonl:2: node 0: parent chain forms a cycle"):
        read_trees(tmp_path / "t.jsonl")
