"""Tree mode == per-path baseline, through the real model: log-probs, losses and gradients.

Random forests that branch (several levels, siblings, internal path ends, duplicates, several
trees per row, single-token nodes, several roots), float32, docs/design.md section 9 tolerances.
"""

import numpy as np
import pytest
from flax import nnx
from hypothesis import assume, given, settings

from jtree.config.objective import NORMALIZATIONS, Objective
from jtree.layout.baseline import linearize_baseline, unlinearize_baseline
from jtree.layout.linearize import linearize, unlinearize
from tests.models_util import (
    assert_loss_and_grads_match,
    logprob_fn,
    off_policy_ppo_inputs,
    perturbed,
    tiny_gpt_oss_config,
    tiny_llama_config,
    tiny_lm,
    tiny_model,
    tiny_qwen2_config,
)
from tests.strategies import forests

S, TREE_ROWS, BASE_ROWS = 64, 3, 40
GRAPHDEF, PARAMS = tiny_model(seed=1)
FORESTS = forests(n_trees=(1, 3), max_nodes=8, max_seg=5)


def _batches(trees, normalization):
    tree = linearize(trees, S, normalization=normalization, n_rows=TREE_ROWS)
    base = linearize_baseline(trees, S, normalization=normalization, n_rows=BASE_ROWS)
    return tree, base


@settings(max_examples=15)
@given(trees=FORESTS)
def test_logprobs_equal_baseline(trees):
    tree, base = _batches(trees, "seq_mean_token_mean")
    fn = logprob_fn(GRAPHDEF)
    lp_tree = unlinearize(tree, np.asarray(fn(PARAMS, tree.inputs)))
    lp_base = unlinearize_baseline(base, np.asarray(fn(PARAMS, base.inputs)), trees)
    for a_paths, b_paths in zip(lp_tree, lp_base):
        for a, b in zip(a_paths, b_paths):
            assert a[0] == 0.0 and b[0] == 0.0
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
            assert np.all(a[1:] < 0)


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@settings(max_examples=6)
@given(trees=FORESTS)
def test_sft_loss_and_grads_equal_baseline(trees, normalization):
    tree, base = _batches(trees, normalization)
    assert_loss_and_grads_match(GRAPHDEF, PARAMS, tree.inputs, base.inputs,
                                Objective(kind="sft"))


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@settings(max_examples=6)
@given(trees=FORESTS)
def test_ppo_loss_and_grads_equal_baseline(trees, normalization):
    """Clipped surrogate + KL + entropy, with advantages that differ between paths sharing tokens
    and old/ref log-probs off the current policy so clipping really happens."""
    tree, base = _batches(trees, normalization)
    tree_in, base_in = off_policy_ppo_inputs(PARAMS, GRAPHDEF, tree, base, seed=len(trees))
    objective = Objective(kind="ppo", clip_low=0.2, clip_high=0.28, kl_coef=0.05,
                          entropy_coef=0.01)
    assert_loss_and_grads_match(GRAPHDEF, PARAMS, tree_in, base_in, objective)


# Llama 3 (attention and MLP biases, scaled RoPE) and Qwen2 (q/k/v biases, no q/k norm), with
# perturbed weights so the zero-initialized biases matter.
OTHER_DENSE = {name: nnx.split(tiny_lm(make(), seed=2)) for name, make in
               (("llama", tiny_llama_config), ("qwen2", tiny_qwen2_config))}
OTHER_DENSE = {name: (g, perturbed(p)) for name, (g, p) in OTHER_DENSE.items()}


@pytest.mark.parametrize("arch", list(OTHER_DENSE))
@settings(max_examples=4)
@given(trees=FORESTS)
def test_other_dense_architectures_equal_baseline_under_ppo(trees, arch):
    _assert_equal_baseline_under_ppo(*OTHER_DENSE[arch], trees)


def _assert_equal_baseline_under_ppo(graphdef, params, trees):
    """Tree log-probs, PPO loss and gradients == the per-path baseline's."""
    tree, base = _batches(trees, "seq_mean_token_mean")
    fn = logprob_fn(graphdef)
    lp_tree = unlinearize(tree, np.asarray(fn(params, tree.inputs)))
    lp_base = unlinearize_baseline(base, np.asarray(fn(params, base.inputs)), trees)
    for a_paths, b_paths in zip(lp_tree, lp_base):
        for a, b in zip(a_paths, b_paths):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    tree_in, base_in = off_policy_ppo_inputs(params, graphdef, tree, base, seed=len(trees))
    # A forest that scores no token (one-token paths) trains nothing: its only loss is a MoE
    # router's, which on a single token is constant when the router normalizes over the chosen
    # experts (gpt-oss), so both gradients are float32 rounding alone (~1e-7) and no relative
    # comparison means anything. The router loss on real forests is compared in every other draw.
    c = tree_in.coefficients
    assume(any(np.abs(x).sum() > 0 for x in (c.weight, c.adv_pos, c.adv_neg)))
    objective = Objective(kind="ppo", clip_low=0.2, clip_high=0.28, kl_coef=0.05,
                          entropy_coef=0.01)
    assert_loss_and_grads_match(graphdef, params, tree_in, base_in, objective)


# gpt-oss (sliding-window and full layers with sinks, MoE with biases and the clamped SwiGLU,
# YaRN) on the block-sparse `xla` kernel, which skips the blocks outside every window.
GPT_OSS = nnx.split(tiny_lm(tiny_gpt_oss_config(), seed=2, attention_impl="xla"))
GPT_OSS = (GPT_OSS[0], perturbed(GPT_OSS[1], scale=0.2))


@settings(max_examples=3)
@given(trees=FORESTS)
def test_gpt_oss_equals_baseline_under_ppo(trees):
    _assert_equal_baseline_under_ppo(*GPT_OSS, trees)
