import itertools

import numpy as np
import pytest

from jtree.layout.balance import (
    assign_to_ranks,
    attention_pairs,
    contiguous_runs,
    split_contiguous,
    tree_cost,
)
from jtree.trees.part import TreePart
from jtree.trees.tree import TrajectoryTree
from tests.strategies import explicit_tree, random_forest


def test_rank_assignment_is_within_5_percent_of_the_lower_bound_on_random_workloads():
    rng = np.random.default_rng(0)
    worst = 0.0
    for trial in range(90):
        n = int(rng.integers(2, 17))
        items = n * int(rng.integers(6, 13))
        draw = (lambda: rng.lognormal(0, 1, items), lambda: rng.uniform(1, 100, items),
                lambda: rng.pareto(2, items) + 1)[trial % 3]
        costs = draw()
        a = assign_to_ranks(costs, n)
        assert sorted(i for r in a.ranks for i in r) == list(range(items))
        np.testing.assert_allclose(a.loads, [costs[list(r)].sum() for r in a.ranks])
        assert a.lower_bound == pytest.approx(max(costs.sum() / n, costs.max()))
        worst = max(worst, a.imbalance)
    assert worst <= 0.05


def test_rank_assignment_small_cases_against_brute_force():
    rng = np.random.default_rng(1)
    for _ in range(20):
        n, k = int(rng.integers(2, 4)), int(rng.integers(2, 8))
        costs = rng.integers(1, 30, size=k).astype(float)
        best = min(np.bincount(np.array(asg), weights=costs, minlength=n).max()
                   for asg in itertools.product(range(n), repeat=k))
        got = assign_to_ranks(costs, n).max_load
        assert best <= got <= 4 / 3 * best  # LPT's guarantee, and never better than optimal


def test_rank_assignment_edge_cases():
    a = assign_to_ranks([5.0, 1.0], 4)
    assert a.max_load == 5.0 and a.imbalance == 0.0 and len(a.ranks) == 4
    with pytest.raises(ValueError, match="n_ranks"):
        assign_to_ranks([1.0], 0)
    with pytest.raises(ValueError, match="costs"):
        assign_to_ranks([1.0, float("nan")], 2)


def _brute_contiguous(first, step, k):
    n = len(first)

    def cost(a, b):
        return first[a] + sum(step[a + 1 : b])

    return min(max(cost(a, b) for a, b in zip((0, *cuts), (*cuts, n)))
               for m in range(min(k, n)) for cuts in itertools.combinations(range(1, n), m))


def test_contiguous_runs_are_optimal():
    rng = np.random.default_rng(2)
    for _ in range(200):
        n, k = int(rng.integers(1, 10)), int(rng.integers(1, 6))
        lens = rng.integers(1, 30, size=n)
        lcp = np.minimum(rng.integers(0, 30, size=n), np.minimum(lens, np.roll(lens, 1)))
        lcp[0] = 0
        first, step = lens.astype(float), (lens - lcp).astype(float)
        runs = contiguous_runs(first, step, k)
        assert len(runs) == min(k, n) and runs[0][0] == 0 and runs[-1][1] == n
        assert all(a < b and b == c for (a, b), (c, _) in zip(runs, runs[1:]))
        got = max(first[a] + step[a + 1 : b].sum() for a, b in runs)
        assert got == _brute_contiguous(first, step, k)


def test_contiguous_runs_with_real_valued_costs():
    rng = np.random.default_rng(3)
    for _ in range(100):
        n, k, w = int(rng.integers(2, 9)), int(rng.integers(2, 5)), float(rng.uniform(0.01, 0.3))
        lens = rng.uniform(1, 30, size=n)
        lcp = np.minimum(rng.uniform(0, 30, size=n), np.minimum(lens, np.roll(lens, 1)))
        lcp[0] = 0.0
        first = lens + w * lens * (lens + 1) / 2
        step = (lens - lcp) + w * (lens * (lens + 1) - lcp * (lcp + 1)) / 2
        runs = contiguous_runs(first, step, k)
        got = max(first[a] + step[a + 1 : b].sum() for a, b in runs)
        assert got == pytest.approx(_brute_contiguous(first, step, k), rel=1e-12)


@pytest.mark.parametrize("attention_weight", [0.0, 0.05])
def test_split_contiguous_is_the_optimal_contiguous_split_of_a_tree(attention_weight):
    rng = np.random.default_rng(4)
    for _ in range(25):
        tree = explicit_tree(random_forest(rng, max_nodes=10, extra_paths=3))
        n_ranks = int(rng.integers(1, 5))
        split = split_contiguous(tree, n_ranks, attention_weight=attention_weight)
        assert len(split.parts) == n_ranks
        real = [p for p in split.parts if p is not None]
        owned = np.concatenate([p.owned_paths for p in real])
        assert sorted(owned.tolist()) == list(range(tree.n_paths))
        order = np.argsort(tree.path_nodes, kind="stable")
        assert owned.tolist() == sorted(owned.tolist(), key=lambda p: list(order).index(p))
        for p, c in zip(real, split.costs):
            assert c == pytest.approx(tree_cost(p, attention_weight))
        # Every contiguous split of the DFS path order, costed as the parts it makes.
        n = tree.n_paths
        best = min(
            max(tree_cost(TreePart.from_paths(tree, order[a:b]), attention_weight)
                for a, b in zip((0, *cuts), (*cuts, n)))
            for m in range(min(n_ranks, n)) for cuts in itertools.combinations(range(1, n), m)
        )
        assert split.max_cost == pytest.approx(best, rel=1e-9)


def test_split_contiguous_more_ranks_than_paths():
    tree = TrajectoryTree.from_sequences([[1, 2, 3], [1, 2, 4]])
    split = split_contiguous(tree, 4)
    assert [p is None for p in split.parts] == [False, False, True, True]
    assert split.max_cost == 3


def test_attention_pairs_count_the_tree_mask():
    tree = TrajectoryTree.from_sequences([[1, 2, 3], [1, 2, 4, 5]])
    # tokens at positions 0,1,2 (shared 0,1) and 2,3: pairs = 1+2+3 + 3+4
    assert attention_pairs(tree) == 13
    assert tree_cost(tree, 0.5) == 5 + 6.5
