"""Routing replay on the host: per-path routed experts folded onto tree tokens by the documented
rule (docs/rl.md, "Routing replay") and laid into the batch."""

import numpy as np
import pytest

from jtree.layout.linearize import linearize
from jtree.layout.routing import tree_routing
from jtree.trees.tree import TrajectoryTree

NONE = [[-1, -1]]  # one MoE layer, k = 2: a token without engine routing


def _route(*tokens):
    return np.array(tokens, np.int32).reshape(len(tokens), 1, 2)


def test_the_first_path_that_routes_a_token_wins_and_disagreements_are_counted():
    # Paths 0 and 1 share tokens [1, 2, 3]; path 2 shares [1, 2].
    tree = TrajectoryTree.from_sequences([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6]])
    per_path = [
        _route(NONE[0], NONE[0], [0, 1], [2, 3]),    # token 2 unrouted (a prompt token) here
        _route(NONE[0], [3, 2], [1, 0], [1, 2]),     # token 3: same set, other order: agrees
        _route(NONE[0], [0, 3], [0, 2]),             # token 2: routed by path 1 first: differs
    ]
    folded, disagreements = tree_routing(tree, per_path)
    # Written out: token 2 from path 1 (path 0 has none), token 3 from path 0.
    expected = [_route(NONE[0], [3, 2], [0, 1], [2, 3]), _route(NONE[0], [3, 2], [0, 1], [1, 2]),
                _route(NONE[0], [3, 2], [0, 2])]
    for p, want in enumerate(expected):
        np.testing.assert_array_equal(folded[tree.path_token_index(p)], want)
    assert disagreements == 1  # token 2 only; token 3's {0, 1} == {1, 0}


def test_linearize_places_the_folded_routing_beside_its_tokens():
    trees = [TrajectoryTree.from_sequences([[1, 2, 3], [1, 2, 4]]),
             TrajectoryTree.from_sequences([[7, 8]])]
    routing = [[_route(NONE[0], [0, 1], [1, 2]), _route(NONE[0], [0, 1], [3, 2])],
               [_route([2, 3], [3, 0])]]
    batch = linearize(trees, 8, routed_experts=routing)
    routed, tokens = batch.inputs.routed_experts, batch.inputs.tokens
    assert routed.shape == (*batch.shape, 1, 2) and batch.routing_disagreements == 0
    expected = {1: [-1, -1], 2: [0, 1], 3: [1, 2], 4: [3, 2], 7: [2, 3], 8: [3, 0]}
    for r, s in zip(*np.nonzero(batch.inputs.valid)):
        np.testing.assert_array_equal(routed[r, s, 0], expected[int(tokens[r, s])])
    assert (routed[~batch.inputs.valid] == -1).all()


def test_a_routing_of_the_wrong_length_is_refused():
    tree = TrajectoryTree.from_sequences([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"routed_experts: path 0: shape \(2, 1, 2\), expected "
                                         r"\[3, layers, k\]"):
        linearize([tree], 8, routed_experts=[[_route([0, 1], [0, 1])]])
