"""Gradient accumulation over the parts of partitioned trees equals the unpartitioned gradient."""

import jax
import pytest

from jtree.config.objective import Objective
from jtree.layout.coefficients import batch_normalizer
from jtree.layout.linearize import linearize
from jtree.layout.microbatches import build_microbatches
from jtree.partitioning.partition import partition
from jtree.step.batches import stack_microbatches
from jtree.step.train_step import make_grad_fn
from tests.models_util import rel_l2, tiny_model
from tests.strategies import multi_part_trees


@pytest.mark.parametrize("kind,normalization,method", [
    ("sft", "seq_mean_token_mean", "heuristic"),
    ("ppo", "token_mean", "dp_multi"),
])
def test_part_accumulation_equals_full_tree_gradient(kind, normalization, method):
    graphdef, params = tiny_model(seed=3)
    trees = multi_part_trees(seed=7)
    capacity = 16
    parts = [p for t in trees for p in partition(t, capacity, method).parts]
    assert len(parts) >= 5 and sum(p.n_tree_tokens for p in parts) > sum(
        t.n_tree_tokens for t in trees)  # prefixes really are duplicated across parts
    norm = batch_normalizer(trees, normalization)
    micro = build_microbatches(parts, capacity, rows_per_microbatch=2,
                               normalization=normalization, normalizer=norm)
    assert len(micro.batches) >= 2
    full = linearize(trees, 128, normalization=normalization)
    objective = Objective(kind=kind, normalization=normalization, clip_low=0.1, clip_high=0.1)
    grad_fn = jax.jit(make_grad_fn(graphdef, objective))
    loss_full, _, g_full = grad_fn(params, stack_microbatches([full]))
    loss_parts, _, g_parts = grad_fn(params, micro.inputs())
    assert float(loss_parts) == pytest.approx(float(loss_full), rel=1e-5)
    leaves_full = jax.tree_util.tree_leaves(g_full)
    leaves_parts = jax.tree_util.tree_leaves(g_parts)
    assert len(leaves_full) == len(leaves_parts)
    for a, b in zip(leaves_parts, leaves_full):
        assert rel_l2(a, b) <= 1e-5
