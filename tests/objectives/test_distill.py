"""`objective.distill` added to GSPO's sequence-level loss: on a tree batch (teacher scored once per
shared prefix, the policy's log-probs scattered for GSPO's path sums) the loss and every gradient
equal the per-path (baseline) batch's, for both estimators. The transformers comparison of the
term itself, alone and with PPO, is tests/hf/test_distill.py."""

import dataclasses

import numpy as np
import pytest
from flax import nnx

from jtree.config.objective import DistillConfig, Objective
from jtree.layout.baseline import linearize_baseline
from jtree.layout.linearize import linearize
from jtree.objectives.logprobs import token_distributions
from tests.models_util import (
    assert_loss_and_grads_match,
    logprob_fn,
    loss_and_grad_fn,
    off_policy_ppo_inputs,
    perturbed,
    tiny_model,
)
from tests.strategies import gspo_tree


@pytest.mark.parametrize("estimator", ["sampled", "full"])
def test_gspo_with_distillation_on_the_tree_equals_per_path(estimator):
    rng = np.random.default_rng(5)
    graphdef, params = tiny_model(vocab_size=64)
    teacher = perturbed(params, scale=0.3, seed=4)
    trees = [gspo_tree(rng, max_nodes=8, vocab=64) for _ in range(2)]
    tree = linearize(trees, 64, n_rows=4)
    base = linearize_baseline(trees, 64, n_rows=4)
    tree_in, base_in = off_policy_ppo_inputs(params, graphdef, tree, base, seed=1)

    def scored(inputs):
        if estimator == "full":
            dist = token_distributions(nnx.merge(graphdef, teacher), inputs)
            return dataclasses.replace(inputs, teacher_dist=dist)
        return inputs.with_coefficients(teacher_logprobs=logprob_fn(graphdef)(teacher, inputs))

    objective = Objective(kind="gspo", clip_low=0.05, clip_high=0.08,
                          distill=DistillConfig("unused", coef=0.5, estimator=estimator))
    loss = float(loss_and_grad_fn(graphdef, objective)(params, scored(tree_in))[0])
    without = float(loss_and_grad_fn(graphdef, dataclasses.replace(objective, distill=None))(
        params, tree_in)[0])
    assert abs(loss - without) > 1e-2  # the distillation term is there
    assert_loss_and_grads_match(graphdef, params, scored(tree_in), scored(base_in), objective)
