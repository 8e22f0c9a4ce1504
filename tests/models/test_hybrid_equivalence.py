"""Tree mode == per-path baseline for tiny Qwen3-MoE, Qwen3-Next and Qwen3.5-MoE models: log-probs,
SFT and PPO losses and gradients with the router aux loss included (docs/design.md section 9
tolerances).

Random forests branch on several levels, have single-token nodes (shorter than the conv kernel),
paths ending at internal nodes, several trees per row and padding; 3-token GDN chunks put chunk
boundaries inside nodes (and at other places in the baseline's paths).

Examples are derandomized: the gradient of A_log (4 numbers summing many decay terms of both
signs) carries fp32 noise of up to ~7e-6 relative even between two chunkings of the same tree,
close to the 1e-5 bound, so a fixed set of random forests keeps the suite deterministic.
"""

import pytest
from hypothesis import given, settings

from jtree.config.objective import Objective
from tests.models_util import (
    assert_logprobs_equal_baseline,
    assert_loss_and_grads_match,
    off_policy_ppo_inputs,
    perturbed_moe_model,
    tree_and_baseline,
)
from tests.strategies import forests

CHUNK = 3
FORESTS = forests(n_trees=(1, 3), max_nodes=8, max_seg=5)


def _batches(trees, normalization):
    return tree_and_baseline(trees, normalization, gdn_chunk_size=CHUNK)


@pytest.mark.parametrize("kind", ["moe", "next"])
@settings(max_examples=3, derandomize=True)
@given(trees=FORESTS)
def test_logprobs_equal_baseline(trees, kind):
    graphdef, params = perturbed_moe_model(kind)
    tree, base = _batches(trees, "seq_mean_token_mean")
    assert_logprobs_equal_baseline(graphdef, params, trees, tree, base)


@pytest.mark.parametrize("kind, gdn_scan", [
    ("moe", "auto"), ("next", "sequential"),
    pytest.param("next", "parallel", marks=pytest.mark.slow)])  # both scans: tests/kernels/test_gdn.py
@settings(max_examples=2, derandomize=True)
@given(trees=FORESTS)
def test_sft_loss_and_grads_equal_baseline(trees, kind, gdn_scan):
    """With either GDN scan (`RuntimeConfig.gdn_scan`) on both sides."""
    graphdef, params = perturbed_moe_model(kind, gdn_scan=gdn_scan)
    tree, base = _batches(trees, "seq_mean_token_mean")
    assert_loss_and_grads_match(graphdef, params, tree.inputs, base.inputs,
                                Objective(kind="sft"))


@pytest.mark.parametrize("kind", [
    "moe", "next", pytest.param("qwen3_5_moe", marks=pytest.mark.slow)])  # the default suite's
@settings(max_examples=2, derandomize=True)  # Qwen3.5 checks: tests/hf/test_hf_qwen3_5.py
@given(trees=FORESTS)
def test_ppo_loss_and_grads_equal_baseline(trees, kind):
    """Clipped surrogate + KL + entropy + aux loss (coefficient 0.5, so it matters), advantages
    differing between paths."""
    graphdef, params = perturbed_moe_model(kind)
    tree, base = _batches(trees, "token_mean")
    tree_in, base_in = off_policy_ppo_inputs(params, graphdef, tree, base, seed=len(trees))
    objective = Objective(kind="ppo", clip_low=0.2, clip_high=0.28, kl_coef=0.05,
                          entropy_coef=0.01)
    assert_loss_and_grads_match(graphdef, params, tree_in, base_in, objective)
