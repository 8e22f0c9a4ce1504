"""Tree mode == per-path baseline, through the real model: log-probs, losses and gradients.

Random forests that branch (several levels, siblings, internal path ends, duplicates, several
trees per row, single-token nodes, several roots), float32, docs/design.md section 9 tolerances.
"""

import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings

from jtree.config.objective import NORMALIZATIONS, Objective
from tests.models_util import (
    assert_equal_baseline_under_ppo,
    assert_loss_and_grads_match,
    off_policy_ppo_inputs,
    path_logprob_pairs,
    perturbed,
    tiny_gpt_oss_config,
    tiny_llama_config,
    tiny_lm,
    tiny_model,
    tiny_qwen2_config,
    tree_and_baseline,
)
from tests.strategies import forests

GRAPHDEF, PARAMS = tiny_model(seed=1)
FORESTS = forests(n_trees=(1, 3), max_nodes=8, max_seg=5)


@settings(max_examples=15)
@given(trees=FORESTS)
def test_logprobs_equal_baseline(trees):
    tree, base = tree_and_baseline(trees, "seq_mean_token_mean")
    for a, b in path_logprob_pairs(GRAPHDEF, PARAMS, trees, tree, base):
        assert a[0] == 0.0 and b[0] == 0.0
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
        assert np.all(a[1:] < 0)


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@settings(max_examples=6)
@given(trees=FORESTS)
def test_sft_loss_and_grads_equal_baseline(trees, normalization):
    tree, base = tree_and_baseline(trees, normalization)
    assert_loss_and_grads_match(GRAPHDEF, PARAMS, tree.inputs, base.inputs,
                                Objective(kind="sft"))


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@settings(max_examples=6)
@given(trees=FORESTS)
def test_ppo_loss_and_grads_equal_baseline(trees, normalization):
    """Clipped surrogate + KL + entropy, with advantages that differ between paths sharing tokens
    and old/ref log-probs off the current policy so clipping really happens."""
    tree, base = tree_and_baseline(trees, normalization)
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
    assert_equal_baseline_under_ppo(*OTHER_DENSE[arch], trees)


# gpt-oss (sliding-window and full layers with sinks, MoE with biases and the clamped SwiGLU,
# YaRN) on the block-sparse `xla` kernel, which skips the blocks outside every window.
GPT_OSS = nnx.split(tiny_lm(tiny_gpt_oss_config(), seed=2, attention_impl="xla"))
GPT_OSS = (GPT_OSS[0], perturbed(GPT_OSS[1], scale=0.2))


@settings(max_examples=3)
@given(trees=FORESTS)
def test_gpt_oss_equals_baseline_under_ppo(trees):
    assert_equal_baseline_under_ppo(*GPT_OSS, trees)
