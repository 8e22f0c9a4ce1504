"""`objective.reference`: the KL term's reference log-probs from a forward of a reference model on
the step's own (tree) batch equal those of each path run alone, so the tree step's KL, loss and
gradients equal the per-path step's; the trainer wires the reference in and refuses it where it
has no meaning."""

from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

import jtree.hf
from jtree.config import load_config
from jtree.config.objective import Objective
from jtree.launch.train import main
from jtree.layout.baseline import linearize_baseline, unlinearize_baseline
from jtree.layout.batch import stack
from jtree.layout.linearize import linearize, unlinearize
from jtree.models import create_model
from jtree.step.train_step import make_grad_fn
from jtree.training.trainer import Trainer
from tests.models_util import (
    assert_grads_close,
    logprob_fn,
    off_policy_ppo_inputs,
    perturbed,
    tiny_config,
    tiny_lm,
    tiny_model,
)
from tests.run_util import read_metrics, tiny_overrides
from tests.strategies import seeded_forests


def test_reference_kl_on_the_tree_equals_the_per_path_kl():
    """Reference log-probs from one forward of the reference model over the tree batch give the
    same per-path values as a forward over every path alone, and the PPO step with the KL term
    (its loss, KL metric and gradients) equals the per-path step."""
    graphdef, params = tiny_model(seed=0)
    reference = perturbed(params, scale=0.05, seed=3)
    trees = seeded_forests(4, seed=5, max_nodes=6)
    tree = linearize(trees, 64, normalization="token_mean")
    base = linearize_baseline(trees, 64, normalization="token_mean")
    ref_fn = logprob_fn(graphdef)
    ref_tree = np.asarray(ref_fn(reference, tree.inputs))
    ref_base = np.asarray(ref_fn(reference, base.inputs))  # every path its own sequence
    for got, want in zip(unlinearize(tree, ref_tree), unlinearize_baseline(base, ref_base, trees)):
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    objective = Objective(kind="ppo", normalization="token_mean", kl_coef=0.5)
    grad_fn = jax.jit(make_grad_fn(graphdef, objective))
    # Old log-probs off the policy, one value per tree token copied to every path through it.
    tree_in, base_in = off_policy_ppo_inputs(params, graphdef, tree, base, seed=1)
    loss_t, m_t, g_t = grad_fn(params, stack([tree_in.with_coefficients(ref_logprobs=ref_tree)]))
    loss_b, m_b, g_b = grad_fn(params, stack([base_in.with_coefficients(ref_logprobs=ref_base)]))
    assert float(m_t["kl_ref"]) > 1e-4
    assert float(m_t["kl_ref"]) == pytest.approx(float(m_b["kl_ref"]), rel=1e-5)
    assert float(loss_t) == pytest.approx(float(loss_b), rel=1e-5, abs=1e-7)
    assert_grads_close(g_t, g_b)


@pytest.mark.parametrize("overrides, match", [
    (["objective.reference=initial"], r"objective\.reference: 'initial' .* no KL term"),
    (["objective.reference=initial", "objective.kind=ppo", "objective.kl_coef=0.1",
      "run.mode=redundancy_free"], r"objective\.reference: run\.mode=redundancy_free"),
])
def test_reference_refused_without_a_kl_term_or_on_redundancy_free_parts(overrides, match):
    with pytest.raises(ValueError, match=match):
        Trainer.build(load_config("configs/tiny.yaml", overrides))


def test_initial_reference_is_the_starting_model(tmp_path):
    """`reference: initial` runs the weights a fresh run starts from: with `model.init_from` and
    LoRA, the loaded checkpoint, which is also the LoRA run's frozen base; laid out like the
    model's parameters."""
    config = tiny_config()
    model = tiny_lm(config, 11)
    jtree.hf.save(model, config, tmp_path / "hf")
    overrides = tiny_overrides(tmp_path / "unused.jsonl", **{
        "model.init_from": str(tmp_path / "hf"), "model.tie_word_embeddings": False,
        "model.rope_theta": config.rope_theta, "model.num_hidden_layers": 2,
        "objective.kind": "ppo", "objective.kl_coef": 0.1, "objective.reference": "initial",
        "model.lora": "{rank: 2, targets: [o_proj]}"})
    trainer = Trainer.build(load_config("configs/tiny.yaml", overrides))
    loaded = nnx.state(model, nnx.Param)
    reference, start = trainer.reference_params(), trainer.initial_state().params
    for tree in (reference, start.base):
        assert jax.tree_util.tree_structure(tree) == jax.tree_util.tree_structure(loaded)
        for a, b in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(loaded)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_trainer_reference_from_a_checkpoint_tree_equals_baseline(few_groups_file, tmp_path):
    """`objective.reference: DIR` in a run: the reference forward on the step's own batch gives
    the same KL and loss in tree mode as in per-path (baseline) mode, and `initial` gives a zero
    KL before the first update."""
    overrides = tiny_overrides(few_groups_file, **{
        "run.steps": 2, "model.tie_word_embeddings": False, "objective.kind": "ppo",
        "objective.kl_coef": 0.5, "optim.warmup_steps": 0})
    config = load_config("configs/tiny.yaml", overrides).model.config
    jtree.hf.save(create_model("qwen3", config, seed=7), config, tmp_path / "ref")
    runs = {}
    for mode, ref in (("tree", tmp_path / "ref"), ("baseline", tmp_path / "ref"),
                      ("tree", "initial")):
        out = tmp_path / f"{mode}_{Path(ref).name}.jsonl"
        assert main(["--config", "configs/tiny.yaml", *overrides, f"run.mode={mode}",
                     f"objective.reference={ref}", f"run.metrics_jsonl={out}"]) == 0
        runs[mode, Path(ref).name] = read_metrics(out)
    tree, base = runs["tree", "ref"], runs["baseline", "ref"]
    for t, b in zip(tree, base, strict=True):
        assert t["kl_ref"] > 1e-3
        assert t["kl_ref"] == pytest.approx(b["kl_ref"], rel=1e-5)
        # The surrogate of mixed-sign advantages nearly cancels: the loss is compared on the
        # scale of its terms (|advantages| ~ 1), as in tests/models_util.py.
        assert t["loss"] == pytest.approx(b["loss"], abs=1e-6)
    initial = runs["tree", "initial"]
    assert initial[0]["kl_ref"] == pytest.approx(0.0, abs=1e-7) and initial[1]["kl_ref"] > 0
