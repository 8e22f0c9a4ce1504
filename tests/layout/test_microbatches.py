import numpy as np
import pytest

from jtree.layout.coefficients import batch_normalizer
from jtree.layout.linearize import linearize
from jtree.layout.microbatches import build_microbatches
from jtree.layout.planner import least_padding_plan, plan_rows
from jtree.partitioning.partition import partition
from tests.strategies import explicit_tree, random_forest


def test_plan_rows_first_fit_decreasing_and_padding_report():
    plan = plan_rows([5, 3, 8, 2, 6], 10)
    assert sorted(sorted(r) for r in plan.rows) == [[0], [1, 4], [2, 3]]  # 8+2 | 6+3 | 5
    assert plan.row_len == 10 and plan.n_rows == 3 and plan.used_tokens == 24
    assert plan.padding_tokens == 6 and plan.padding_fraction == pytest.approx(0.2)


def test_plan_rows_buckets_and_row_multiple():
    plan = plan_rows([3, 3, 2], 16, len_buckets=[4, 8, 16], rows_multiple=4)
    assert plan.row_len == 8  # one row of 8 tokens: the smallest bucket that holds it
    assert plan.n_rows == 4 and plan.padding_tokens == 4 * 8 - 8


def test_plan_rows_errors():
    with pytest.raises(ValueError, match="item 1: has 20 tokens"):
        plan_rows([3, 20], 16)
    with pytest.raises(ValueError, match="len_buckets"):
        plan_rows([3, 9], 16, len_buckets=[4])
    with pytest.raises(ValueError, match="sizes"):
        plan_rows([], 16)


def test_microbatches_share_one_shape_and_hold_every_part_once():
    rng = np.random.default_rng(0)
    trees = [explicit_tree(random_forest(rng, max_nodes=12, max_seg=4)) for _ in range(6)]
    cap = max(int(t.path_lengths.max()) for t in trees)
    parts = [p for t in trees for p in partition(t, cap).parts]
    norm = batch_normalizer(trees, "token_mean")
    mb = build_microbatches(parts, cap, rows_per_microbatch=2, normalization="token_mean",
                            normalizer=norm, row_lengths=[cap // 2, cap])
    shapes = {b.shape for b in mb.batches}
    assert len(shapes) == 1 and shapes.pop() == (2, mb.plan.row_len)
    assert len(mb.batches) == mb.plan.n_rows // 2
    held = [id(t) for b in mb.batches for t in b.layout.trees]
    assert sorted(held) == sorted(id(p) for p in parts)
    assert all(b.normalizer == norm for b in mb.batches)
    # The padding the plan reports is the padding the batches have.
    valid = sum(int(b.inputs.valid.sum()) for b in mb.batches)
    assert valid == mb.plan.used_tokens
    total = sum(b.inputs.valid.size for b in mb.batches)
    assert 1 - valid / total == pytest.approx(mb.plan.padding_fraction)
    inputs = mb.inputs()
    assert inputs.shape == (len(mb.batches), 2, mb.plan.row_len)
    # Weights summed over micro-batches equal the whole trees' weights.
    whole = linearize(trees, sum(t.n_tree_tokens for t in trees), normalization="token_mean")
    assert inputs.coefficients.weight.sum() == pytest.approx(
        whole.inputs.coefficients.weight.sum(), rel=1e-5)


def test_least_padding_plan_packs_at_the_bucket_that_wastes_least():
    sizes = [40, 40, 40]  # rows of 100 hold two (40% padding); rows of 40 hold one (none)
    assert plan_rows(sizes, 100).padding_tokens == 80
    plan = least_padding_plan(sizes, 100, [25, 40, 50, 100])
    assert (plan.row_len, plan.n_rows, plan.padding_tokens) == (40, 3, 0)
    tie = least_padding_plan([50, 50], 100, [50, 100])  # both exact: the longer rows win
    assert (tie.row_len, tie.n_rows) == (100, 1)
    with pytest.raises(ValueError, match="len_buckets"):
        least_padding_plan([60], 100, [50])


def test_least_padding_plan_equals_trying_every_bucket():
    rng = np.random.default_rng(4)
    for _ in range(30):
        sizes = rng.integers(1, 400, size=int(rng.integers(1, 40))).tolist()
        buckets = sorted(set(rng.integers(1, 33, size=8).tolist()))
        buckets = [b * 32 for b in buckets]
        multiple = int(rng.integers(1, 4))
        fitting = [b for b in buckets if b >= max(sizes)]
        if not fitting:
            continue
        got = least_padding_plan(sizes, 1024, buckets, rows_multiple=multiple)
        every = [plan_rows(sizes, b, rows_multiple=multiple) for b in fitting]
        best = min(every, key=lambda p: (p.n_rows * p.row_len, -p.row_len))
        assert (got.row_len, got.n_rows, got.rows) == (best.row_len, best.n_rows, best.rows)
