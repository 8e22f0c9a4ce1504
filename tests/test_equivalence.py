"""Tree mode == per-path baseline, through the real model: log-probs, losses and gradients.

Random forests that branch (several levels, siblings, internal path ends, duplicates, several
trees per row, single-token nodes, several roots), float32, DESIGN.md section 9 tolerances.
"""

import jax
import numpy as np
import pytest
from hypothesis import given, settings

from jtree.baseline import linearize_baseline, unlinearize_baseline
from jtree.linearize import linearize, unlinearize
from jtree.loss import NORMALIZATIONS
from jtree.train import Objective
from tests.models_util import loss_and_grad_fn, logprob_fn, rel_l2, scatter_paths, tiny_model
from tests.strategies import forests

S, TREE_ROWS, BASE_ROWS = 64, 3, 40
GRAPHDEF, PARAMS = tiny_model(seed=1)
FORESTS = forests(n_trees=(1, 3), max_nodes=8, max_seg=5)


def _batches(trees, normalization):
    tree = linearize(trees, S, normalization=normalization, n_rows=TREE_ROWS)
    base = linearize_baseline(trees, S, normalization=normalization, n_rows=BASE_ROWS)
    return tree, base


@settings(max_examples=15, deadline=None)
@given(trees=FORESTS)
def test_logprobs_equal_baseline(trees):
    tree, base = _batches(trees, "seq_mean_token_mean")
    fn = logprob_fn(GRAPHDEF)
    lp_tree = unlinearize(tree, np.asarray(fn(PARAMS, tree.arrays())))
    lp_base = unlinearize_baseline(base, np.asarray(fn(PARAMS, base.arrays())), trees)
    for a_paths, b_paths in zip(lp_tree, lp_base):
        for a, b in zip(a_paths, b_paths):
            assert a[0] == 0.0 and b[0] == 0.0
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
            assert np.all(a[1:] < 0)


def _check_loss_and_grads(tree_in, base_in, objective):
    fn = loss_and_grad_fn(GRAPHDEF, objective)
    loss_t, g_t = fn(PARAMS, tree_in)
    loss_b, g_b = fn(PARAMS, base_in)
    if objective.kind == "sft":  # a sum of same-sign terms: plain relative difference
        assert float(loss_t) == pytest.approx(float(loss_b), rel=1e-6, abs=1e-9)
    else:
        # The surrogate of mixed-sign advantages cancels, so a 1-ulp log-prob difference can be a
        # large fraction of a near-zero loss; measure relative to the loss scale sum(|W|+|P|+|N|).
        scale = sum(float(np.abs(tree_in[k]).sum()) for k in ("weight", "adv_pos", "adv_neg"))
        assert abs(float(loss_t) - float(loss_b)) <= 1e-6 * max(abs(float(loss_b)), scale)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_t), jax.tree_util.tree_leaves(g_b)):
        assert rel_l2(a, b) <= 1e-5, jax.tree_util.keystr(path)


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@settings(max_examples=6, deadline=None)
@given(trees=FORESTS)
def test_sft_loss_and_grads_equal_baseline(trees, normalization):
    tree, base = _batches(trees, normalization)
    _check_loss_and_grads(tree.arrays(), base.arrays(), Objective(kind="sft"))


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@settings(max_examples=6, deadline=None)
@given(trees=FORESTS)
def test_ppo_loss_and_grads_equal_baseline(trees, normalization):
    """Clipped surrogate + KL + entropy, with advantages that differ between paths sharing tokens
    and old/ref log-probs off the current policy so clipping really happens."""
    tree, base = _batches(trees, normalization)
    rng = np.random.default_rng(len(trees))
    cur = np.asarray(logprob_fn(GRAPHDEF)(PARAMS, tree.arrays()))
    tree_in = dict(tree.arrays())
    tree_in["old_logprobs"] = (cur + rng.normal(0, 0.3, cur.shape)).astype(np.float32)
    tree_in["ref_logprobs"] = (cur + rng.normal(0, 0.3, cur.shape)).astype(np.float32)
    base_in = scatter_paths(
        base, [p for t in unlinearize(tree, tree_in["old_logprobs"]) for p in t], "old_logprobs")
    base_in["ref_logprobs"] = scatter_paths(
        base, [p for t in unlinearize(tree, tree_in["ref_logprobs"]) for p in t], "x")["x"]
    objective = Objective(kind="ppo", clip_low=0.2, clip_high=0.28, kl_coef=0.05,
                          entropy_coef=0.01)
    _check_loss_and_grads(tree_in, base_in, objective)
