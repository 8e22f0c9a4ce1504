import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jtree.config.objective import NORMALIZATIONS
from jtree.layout.coefficients import batch_normalizer, token_coefficients
from jtree.partitioning.exact_dp import set_partitions_bounded
from jtree.partitioning.partition import METHODS, partition, plan_groups
from jtree.trees.part import TreePart
from jtree.trees.tree import TrajectoryTree
from tests.strategies import explicit_tree, random_forest, sequences_tree


@st.composite
def trees_and_capacities(draw, max_nodes: int = 10):
    """A random branching tree and a capacity between its longest path and its whole size."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kwargs = random_forest(rng, max_nodes=max_nodes, max_seg=6)
    tree = sequences_tree(kwargs) if rng.random() < 0.5 else explicit_tree(kwargs)
    lo, hi = int(tree.path_lengths.max()), tree.n_tree_tokens
    return tree, draw(st.integers(lo, max(lo, hi)))


def source_token_index(part: TreePart, tree: TrajectoryTree) -> np.ndarray:
    """Input tree-token index of every token of `part`."""
    off = tree.node_offsets
    return np.concatenate([np.arange(off[s], off[s + 1]) for s in part.source_nodes])


def union_tokens(tree: TrajectoryTree, paths) -> int:
    nodes = {int(n) for p in paths for n in _chain(tree, int(tree.path_nodes[p]))}
    return sum(len(tree.segments[n]) for n in nodes)


def _chain(tree, node):
    while node >= 0:
        yield node
        node = int(tree.parents[node])


@settings(max_examples=60)
@given(trees_and_capacities(), st.sampled_from(NORMALIZATIONS))
def test_partition_properties(case, normalization):
    tree, capacity = case
    norm = batch_normalizer([tree], normalization)
    full = token_coefficients(tree, normalization, norm)
    results = {m: partition(tree, capacity, m) for m in METHODS}
    for method, r in results.items():
        owned = np.concatenate([p.owned_paths for p in r.parts])
        assert sorted(owned.tolist()) == list(range(tree.n_paths)), method  # each path once
        assert all(p.n_tree_tokens <= capacity for p in r.parts), method
        assert r.n_computed >= tree.n_tree_tokens
        assert r.err <= r.por + 1e-12
        # The parts' own normalizer is the tree's (paths are partitioned, not copied).
        assert batch_normalizer(r.parts, normalization) == pytest.approx(norm, rel=1e-6)
        summed = {k: np.zeros(tree.n_tree_tokens) for k in full}
        for part in r.parts:
            src = source_token_index(part, tree)
            np.testing.assert_array_equal(part.tokens, tree.tokens[src])
            for i, p in enumerate(part.owned_paths):
                np.testing.assert_array_equal(part.path_tokens(i), tree.path_tokens(p))
                np.testing.assert_array_equal(part.loss_masks[i], tree.loss_masks[p])
            for k, v in token_coefficients(part, normalization, norm).items():
                np.add.at(summed[k], src, v)
        for k in full:  # W, P and N of the parts add up to the full tree's, token by token
            np.testing.assert_allclose(summed[k], full[k], rtol=1e-5, atol=1e-7, err_msg=k)
    best = results["dp_multi"].n_computed
    assert best <= results["dp_single"].n_computed
    assert best <= results["heuristic"].n_computed


def _set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for p in _set_partitions(rest):
        for i in range(len(p)):
            yield p[:i] + [[first] + p[i]] + p[i + 1 :]
        yield [[first]] + p


def random_parent_tree(rng: np.random.Generator, n_leaves: int) -> TrajectoryTree:
    """Nodes attach to a uniformly random earlier node until the tree has `n_leaves` leaves."""
    parents, children = [-1], {0: 0}
    while sum(1 for i in range(len(parents)) if children[i] == 0) < n_leaves:
        p = int(rng.integers(0, len(parents)))
        children[p] += 1
        children[len(parents)] = 0
        parents.append(p)
    segs = [rng.integers(0, 100, size=int(rng.integers(1, 12))) for _ in parents]
    return TrajectoryTree.from_nodes(parents, segs)


@settings(max_examples=40)
@given(trees_and_capacities(max_nodes=8), st.integers(0, 2**32 - 1))
def test_dp_multi_is_the_brute_force_optimum(case, seed):
    rng = np.random.default_rng(seed)
    deeper = random_parent_tree(rng, int(rng.integers(3, 8)))
    for tree, capacity in [case, (deeper, int(rng.integers(deeper.path_lengths.max(),
                                                           deeper.n_tree_tokens + 1)))]:
        if tree.n_paths > 8:
            continue
        best = min(
            sum(union_tokens(tree, g) for g in groups)
            for groups in _set_partitions(list(range(tree.n_paths)))
            if all(union_tokens(tree, g) <= capacity for g in groups)
        )
        assert partition(tree, capacity, "dp_multi").n_computed == best
        assert partition(tree, capacity, "heuristic").n_computed >= best
        assert partition(tree, capacity, "dp_single").n_computed >= best


def test_part_sizes_are_the_unions_of_their_paths():
    rng = np.random.default_rng(3)
    for _ in range(30):
        tree = explicit_tree(random_forest(rng, max_nodes=12))
        cap = int(tree.path_lengths.max())
        for m in METHODS:
            for part in partition(tree, cap, m).parts:
                assert part.n_tree_tokens == union_tokens(tree, part.owned_paths)


def test_seed000_figure4_shape():
    # 4 trajectories: a 19k-token shared prompt, two 12k-token branches, each with two 10k leaves.
    k = 1000
    rng = np.random.default_rng(0)
    seg = [rng.integers(1, 500, size=n) for n in (19 * k, 12 * k, 12 * k, 10 * k, 10 * k, 10 * k,
                                                  10 * k)]
    tree = TrajectoryTree.from_nodes([-1, 0, 0, 1, 1, 2, 2], seg)
    s = tree.stats()
    assert (s.n_tree_tokens, s.n_paths, s.n_flat_tokens) == (83 * k, 4, 164 * k)
    for m in METHODS:
        r = partition(tree, 60 * k, m)
        assert r.n_parts == 2 and r.n_computed <= 102 * k
        assert r.err == pytest.approx(1 - 102 / 164)  # seed 000: ERR ~ 37.8%
        assert sorted(map(sorted, (p.owned_paths.tolist() for p in r.parts))) == [[0, 1], [2, 3]]


def test_tree_that_fits_is_one_part():
    rng = np.random.default_rng(1)
    tree = sequences_tree(random_forest(rng, max_nodes=10))
    for m in METHODS:
        r = partition(tree, tree.n_tree_tokens, m)
        assert r.n_parts == 1 and r.n_computed == tree.n_tree_tokens and r.err == r.por
        np.testing.assert_array_equal(r.parts[0].owned_paths, np.arange(tree.n_paths))


def test_paths_ending_inside_others_ride_free():
    # Path 2 is a prefix of path 0 and path 3 duplicates path 1: neither may add parts or tokens.
    tree = TrajectoryTree.from_sequences([[1, 2, 3, 4, 5], [1, 2, 6, 7, 8], [1, 2, 3], [1, 2, 6, 7, 8]])
    for m in METHODS:
        r = partition(tree, 5, m)
        assert r.n_parts == 2 and r.n_computed == 10
        groups = sorted(sorted(p.owned_paths.tolist()) for p in r.parts)
        assert groups == [[0, 2], [1, 3]]


def test_forest_roots_share_parts_without_sharing_tokens():
    tree = TrajectoryTree.from_sequences([[1, 2], [3, 4], [5, 6, 7]])
    assert len(plan_groups(tree, 7)) == 1
    r = partition(tree, 4, "dp_multi")
    assert r.n_computed == 7 and r.n_parts == 2


def test_path_longer_than_capacity_is_a_clear_error():
    tree = TrajectoryTree.from_sequences([[1, 2, 3], [1, 2, 3, 4, 5, 6]])
    for m in METHODS:
        with pytest.raises(ValueError, match=r"path 1: has 6 tokens, more than capacity=5"):
            partition(tree, 5, m)


def test_bad_arguments():
    tree = TrajectoryTree.from_sequences([[1, 2, 3]])
    with pytest.raises(ValueError, match="method: 'greedy'"):
        partition(tree, 4, "greedy")
    with pytest.raises(ValueError, match="capacity: must be a positive integer"):
        partition(tree, 0)
    with pytest.raises(ValueError, match="paths: indices"):
        TreePart.from_paths(tree, [1])


def test_dp_multi_refuses_large_trees_before_running():
    rng = np.random.default_rng(0)
    seqs = [[0] * 50 + rng.integers(1, 9, size=20).tolist() for _ in range(40)]
    tree = TrajectoryTree.from_sequences(seqs)
    with pytest.raises(ValueError, match="too large for method='dp_multi'.*use method='heuristic'"):
        partition(tree, 500, "dp_multi")
    assert partition(tree, 500, "heuristic").n_parts >= 1
    assert partition(tree, 500, "dp_single").n_parts >= 1


def test_bounded_set_partitions():
    assert [set_partitions_bounded(k, k) for k in range(7)] == [1, 1, 2, 5, 15, 52, 203]  # Bell
    assert [set_partitions_bounded(k, 2) for k in range(7)] == [1, 1, 2, 4, 10, 26, 76]
    assert set_partitions_bounded(5, 1) == 1
    brute = sum(1 for p in _set_partitions(list(range(6))) if max(map(len, p)) <= 3)
    assert set_partitions_bounded(6, 3) == brute


def test_heuristic_matches_dp_on_chains_of_equal_siblings():
    # Root 10 tokens, 6 leaves of 10: capacity 40 holds 3 leaves, so two parts of 40 are optimal.
    seqs = [[1] * 10 + [i + 2] * 10 for i in range(6)]
    tree = TrajectoryTree.from_sequences(seqs)
    costs = {m: partition(tree, 40, m).n_computed for m in METHODS}
    assert costs == {"heuristic": 80, "dp_single": 120, "dp_multi": 80}
    assert list(itertools.chain.from_iterable(plan_groups(tree, 40))) == list(range(6))
