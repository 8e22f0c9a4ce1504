"""Gradient accumulation over the parts of partitioned trees equals the unpartitioned gradient."""

import jax
import numpy as np
import pytest

from jtree.linearize import linearize
from jtree.loss import batch_normalizer
from jtree.packing import build_microbatches
from jtree.partition import partition
from jtree.train_step import Objective, make_grad_fn, stack_microbatches
from jtree.tree import TrajectoryTree
from tests.models_util import rel_l2, tiny_model
from tests.strategies import random_forest


def consistent_tree(rng: np.random.Generator, **kw) -> TrajectoryTree:
    """A random branching tree whose per-path old log-probs agree on shared tokens (as they do
    when the rollout engine's values are exact), so the PPO loss is one function of the tree."""
    t = TrajectoryTree.from_nodes(**random_forest(rng, **kw))
    per_token = -rng.uniform(3.6, 4.6, size=t.n_tree_tokens)
    olds = [per_token[t.path_token_index(p)] for p in range(t.n_paths)]
    return TrajectoryTree.from_nodes(
        t.parents.tolist(), list(t.segments), path_nodes=t.path_nodes.tolist(),
        loss_masks=list(t.loss_masks), advantages=list(t.advantages), old_logprobs=olds,
        weights=t.weights,
    )


def branching_trees(seed: int) -> list[TrajectoryTree]:
    """Two trees that need several parts at capacity 16, and a small one that fits whole."""
    rng = np.random.default_rng(seed)
    big = []
    while len(big) < 2:
        t = consistent_tree(rng, max_nodes=12, max_seg=4, roots=1, extra_paths=3)
        if t.n_tree_tokens > 24 and t.path_lengths.max() <= 16 and t.n_paths >= 4:
            big.append(t)
    small = consistent_tree(rng, max_nodes=3, max_seg=3, roots=1)
    return big + [small]


@pytest.mark.parametrize("kind,normalization,method", [
    ("sft", "seq_mean_token_mean", "heuristic"),
    ("ppo", "token_mean", "dp_multi"),
])
def test_part_accumulation_equals_full_tree_gradient(kind, normalization, method):
    graphdef, params = tiny_model(seed=3)
    trees = branching_trees(seed=7)
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
