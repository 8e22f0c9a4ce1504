"""Tree mode == per-path baseline for tiny Qwen3-MoE and Qwen3-Next models: log-probs, SFT and PPO
losses and gradients with the router aux loss included (docs/design.md section 9 tolerances).

Random forests branch on several levels, have single-token nodes (shorter than the conv kernel),
paths ending at internal nodes, several trees per row and padding; 3-token GDN chunks put chunk
boundaries inside nodes (and at other places in the baseline's paths).

Examples are derandomized: the gradient of A_log (4 numbers summing many decay terms of both
signs) carries fp32 noise of up to ~7e-6 relative even between two chunkings of the same tree,
close to the 1e-5 bound, so a fixed set of random forests keeps the suite deterministic.
"""

import functools

import jax
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings

from jtree.baseline import linearize_baseline, unlinearize_baseline
from jtree.linearize import linearize, unlinearize
from jtree.models import Qwen3MoeConfig, Qwen3NextConfig
from jtree.train_step import Objective
from tests.models_util import (
    assert_loss_and_grads_match, logprob_fn, off_policy_ppo_inputs, tiny_lm,
)
from tests.strategies import forests

S, TREE_ROWS, BASE_ROWS, CHUNK = 64, 3, 40, 3
FORESTS = forests(n_trees=(1, 3), max_nodes=8, max_seg=5)
COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=16, mlp_only_layers=(1,), router_aux_loss_coef=0.5,
              output_router_logits=True, tie_word_embeddings=False,
              rope_theta=10_000.0)


@functools.lru_cache(maxsize=None)
def tiny(kind: str):
    """(graphdef, params) with every parameter perturbed so no term is negligible."""
    if kind == "moe":
        model = tiny_lm(Qwen3MoeConfig(**COMMON, num_hidden_layers=2), 0)
    else:
        # Layer 0: GDN + MoE with shared expert; layer 1: gated attention + dense MLP.
        cfg = Qwen3NextConfig(
            **COMMON, num_hidden_layers=2, linear_key_head_dim=8, linear_value_head_dim=6,
            linear_num_key_heads=2, linear_num_value_heads=4, shared_expert_intermediate_size=24,
            layer_types=("linear_attention", "full_attention"))
        model = tiny_lm(cfg, 0)
    graphdef, params = nnx.split(model)
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree_util.tree_leaves(params))))
    params = jax.tree_util.tree_map(lambda x: x + 0.2 * jax.random.normal(next(keys), x.shape), params)
    return graphdef, params


def _batches(trees, normalization):
    tree = linearize(trees, S, normalization=normalization, n_rows=TREE_ROWS,
                     gdn_chunk_size=CHUNK, gdn_chunks=S)
    base = linearize_baseline(trees, S, normalization=normalization, n_rows=BASE_ROWS,
                              gdn_chunk_size=CHUNK, gdn_chunks=S)
    return tree, base


@pytest.mark.parametrize("kind", ["moe", "next"])
@settings(max_examples=3, deadline=None, derandomize=True)
@given(trees=FORESTS)
def test_logprobs_equal_baseline(trees, kind):
    graphdef, params = tiny(kind)
    tree, base = _batches(trees, "seq_mean_token_mean")
    fn = logprob_fn(graphdef)
    lp_tree = unlinearize(tree, np.asarray(fn(params, tree.inputs)))
    lp_base = unlinearize_baseline(base, np.asarray(fn(params, base.inputs)), trees)
    for a_paths, b_paths in zip(lp_tree, lp_base):
        for a, b in zip(a_paths, b_paths):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["moe", "next"])
@settings(max_examples=2, deadline=None, derandomize=True)
@given(trees=FORESTS)
def test_sft_loss_and_grads_equal_baseline(trees, kind):
    graphdef, params = tiny(kind)
    tree, base = _batches(trees, "seq_mean_token_mean")
    assert_loss_and_grads_match(graphdef, params, tree.inputs, base.inputs,
                                Objective(kind="sft"))


@pytest.mark.parametrize("kind", ["moe", "next"])
@settings(max_examples=2, deadline=None, derandomize=True)
@given(trees=FORESTS)
def test_ppo_loss_and_grads_equal_baseline(trees, kind):
    """Clipped surrogate + KL + entropy + aux loss (coefficient 0.5, so it matters), advantages
    differing between paths."""
    graphdef, params = tiny(kind)
    tree, base = _batches(trees, "token_mean")
    tree_in, base_in = off_policy_ppo_inputs(params, graphdef, tree, base, seed=len(trees))
    objective = Objective(kind="ppo", clip_low=0.2, clip_high=0.28, kl_coef=0.05,
                          entropy_coef=0.01)
    assert_loss_and_grads_match(graphdef, params, tree_in, base_in, objective)
