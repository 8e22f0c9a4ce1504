"""`objective.distill`: on-policy distillation toward a transformers teacher. The teacher (a
Llama of another size than the Qwen3 policy, the same vocabulary) scores the tree batch in one
forward through the trainer's `Teacher`; the tree loss and every policy gradient equal the sum
over paths of each path run alone through transformers (teacher and policy), alone and mixed
with PPO, for the sampled-token and the full-vocabulary estimator; the trainer refuses what the
term cannot run on."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from flax import nnx

import jtree.hf
from jtree.config import load_config
from jtree.config.objective import DistillConfig, Objective
from jtree.layout.batch import stack
from jtree.layout.coefficients import batch_normalizer, path_coefficients
from jtree.layout.linearize import linearize, unlinearize
from jtree.objectives.objective import objective_loss
from jtree.training.trainer import Trainer
from tests.hf_path_checks import (
    PPO,
    compare_trees,
    torch_ppo_path_loss,
    write_random_checkpoint,
)
from tests.models_util import logprob_fn, rel_l2, tiny_runtime
from tests.run_util import tiny_overrides
from tests.torch_util import VOCAB, write_qwen3_checkpoint

COEF = 0.7
TOL = 1e-5  # relative: loss and every gradient tensor, float32 jtree vs float32 transformers


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(policy directory, policy in transformers, teacher directory, teacher in transformers)."""
    root = tmp_path_factory.mktemp("distill")
    policy_dir = write_qwen3_checkpoint(root / "policy", tie=False, bias=False)
    policy = transformers.AutoModelForCausalLM.from_pretrained(policy_dir,
                                                               dtype=torch.float32).eval()
    teacher_config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False)
    teacher = write_random_checkpoint(teacher_config, root / "teacher")
    return policy_dir, policy, root / "teacher", teacher


def distill_config(teacher_dir, **extra) -> object:
    """A run config of kind ppo distilling toward `teacher_dir` (vocabulary VOCAB)."""
    overrides = tiny_overrides(teacher_dir / "unused.jsonl", **{
        "model.vocab_size": VOCAB, "objective.kind": "ppo",
        "objective.distill": f"{{teacher: {teacher_dir}, coef: {COEF}}}", **extra})
    return load_config("configs/tiny.yaml", overrides)


def torch_distill_path_loss(policy, teacher, tokens, c, estimator):
    """One path's reverse KL to the teacher in transformers, each model on the path alone:
    (its value, the torch scalar whose gradient the tree step's must equal). `sampled`: value
    sum_t c_t k_t with k_t = log pi(y_t) - log pi_teacher(y_t), gradient sum_t c_t k_t
    grad log pi(y_t) (k_t held fixed). `full`: sum_t c_t sum_v pi(v) (log pi(v) -
    log pi_teacher(v)), differentiated as it is."""
    ids = torch.as_tensor(tokens.astype(np.int64))[None]
    logp_all = torch.log_softmax(policy(input_ids=ids).logits[0, :-1], -1)
    with torch.no_grad():
        teacher_all = torch.log_softmax(teacher(input_ids=ids).logits[0, :-1], -1)
    c = torch.as_tensor(c[1:])
    if estimator == "full":
        kl = (c * (logp_all.exp() * (logp_all - teacher_all)).sum(-1)).sum()
        return float(kl.detach()), kl
    target = ids[0, 1:, None]
    logp, teacher_logp = logp_all.gather(1, target)[:, 0], teacher_all.gather(1, target)[:, 0]
    k = (logp - teacher_logp).detach()
    return float((c * k).sum()), (c * k * logp).sum()


def torch_teacher_scores(teacher, tokens, estimator) -> np.ndarray:
    """The teacher's log-softmax of each token after the first of a path run alone: the whole
    vocabulary for `full`, the path's own token for `sampled`."""
    ids = torch.as_tensor(tokens.astype(np.int64))[None]
    with torch.no_grad():
        logp = torch.log_softmax(teacher(input_ids=ids).logits[0, :-1], -1)
    return (logp if estimator == "full" else logp.gather(1, ids[0, 1:, None])[:, 0]).numpy()


@pytest.mark.parametrize("estimator", ["sampled", "full"])
@pytest.mark.parametrize("mixed", [False, True], ids=["alone", "with_ppo"])
def test_tree_distillation_equals_transformers_per_path(models, mixed, estimator):
    """Alone (no advantages: only the KL moves the policy) and added to PPO's loss (advantages
    of both signs, old and reference log-probs off the policy), for both estimators: the
    teacher's tree scores (one forward over the tree batch) equal transformers' on each path
    alone, and the tree loss, its `distill_kl` and every gradient equal the per-path sums at
    1e-5 relative."""
    policy_dir, policy, teacher_dir, teacher = models
    distill = DistillConfig(str(teacher_dir), coef=COEF, estimator=estimator)
    objective = dataclasses.replace(
        PPO if mixed else Objective(kind="ppo", normalization=PPO.normalization),
        distill=distill)
    trainer = Trainer.build(distill_config(teacher_dir, **{
        "objective.distill": f"{{teacher: {teacher_dir}, coef: {COEF}, estimator: {estimator}}}"}))
    rng = np.random.default_rng(3)
    trees = compare_trees()
    if mixed:
        trees = [t.with_advantages(list(rng.normal(0, 1, t.n_paths))) for t in trees]
    batch = linearize(trees, 160, normalization=objective.normalization)
    config, model = jtree.hf.load(policy_dir, tiny_runtime())
    graphdef, params = nnx.split(model, nnx.Param)
    cur = np.asarray(logprob_fn(graphdef)(params, batch.inputs))
    old = (cur + rng.normal(0, 0.3, cur.shape)).astype(np.float32)
    ref_lp = (cur + rng.normal(0, 0.3, cur.shape)).astype(np.float32)
    scored = trainer.teacher.score(trainer.teacher.params(), stack([batch.inputs]))
    inputs = jax.tree_util.tree_map(lambda x: np.asarray(x)[0], scored).with_coefficients(
        old_logprobs=old, ref_logprobs=ref_lp)
    teacher_scores = (inputs.teacher_dist if estimator == "full"
                      else inputs.coefficients.teacher_logprobs)
    (tree_loss, metrics), grads = jax.jit(jax.value_and_grad(
        lambda p: objective_loss(nnx.merge(graphdef, p), inputs, objective), has_aux=True))(
        params)

    policy.zero_grad(set_to_none=True)
    normalizer = batch_normalizer(trees, objective.normalization)
    path_loss, path_kl = 0.0, 0.0
    for tree, tree_teacher, old_paths, ref_paths in zip(
            trees, unlinearize(batch, teacher_scores), unlinearize(batch, old),
            unlinearize(batch, ref_lp)):
        coeffs = path_coefficients(tree, objective.normalization, normalizer)
        for p in range(tree.n_paths):
            tokens = tree.path_tokens(p)
            np.testing.assert_allclose(tree_teacher[p][1:],
                                       torch_teacher_scores(teacher, tokens, estimator),
                                       atol=1e-5, rtol=0)
            kl, surrogate = torch_distill_path_loss(policy, teacher, tokens, coeffs[p],
                                                    estimator)
            loss = COEF * surrogate
            if mixed:
                loss = loss + torch_ppo_path_loss(policy, tokens, coeffs[p],
                                                  float(tree.advantages[p][0]), old_paths[p],
                                                  ref_paths[p])
            loss.backward()
            path_kl += kl
            path_loss += float(loss.detach()) + COEF * (kl - float(surrogate.detach()))
    assert abs(path_kl) > 1e-2
    assert float(metrics["distill_kl"]) == pytest.approx(path_kl, rel=TOL)
    assert float(tree_loss) == pytest.approx(path_loss, rel=TOL)
    expected = {n: p.grad.numpy() for n, p in policy.named_parameters()}
    ours = jtree.hf.to_hf_tensors(grads, config, names=frozenset(expected))
    assert ours.keys() == expected.keys()
    for name, g in expected.items():
        assert np.linalg.norm(g) > 0, name
        assert rel_l2(ours[name], g) <= TOL, (name, rel_l2(ours[name], g))


def policy_overrides(policy_dir) -> dict[str, str]:
    """The `model.*` overrides of a run whose model is the checkpoint's (its scalar fields;
    floats written so that YAML reads them back as the same floats)."""
    config = jtree.hf.read_model_config(policy_dir)
    out = {"model.init_from": str(policy_dir)}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if isinstance(value, float):
            out[f"model.{field.name}"] = format(value, ".17e")
        elif isinstance(value, (bool, int)):
            out[f"model.{field.name}"] = str(value).lower() if isinstance(value, bool) else value
    return out


@pytest.mark.parametrize("estimator", ["sampled", "full"])
def test_trainer_step_scores_the_teacher_and_reports_the_per_path_kl(models, estimator):
    """Through the trainer: `train_on` with the teacher's parameters runs the teacher forward on
    the placed step batch (two micro-batches) and the step's `distill_kl`, taken before the
    update, equals the per-path KL of transformers' teacher and policy."""
    policy_dir, policy, teacher_dir, teacher = models
    trainer = Trainer.build(distill_config(teacher_dir, **{
        **policy_overrides(policy_dir),
        "objective.distill": f"{{teacher: {teacher_dir}, coef: {COEF}, estimator: {estimator}}}"}))
    normalization = trainer.cfg.objective.normalization
    trees = compare_trees()
    halves = [trees[:2], trees[2:]]
    normalizer = batch_normalizer(trees, normalization)
    batches = [linearize(part, 160, score_len=160, normalization=normalization,
                         normalizer=normalizer) for part in halves]
    state = trainer.initial_state()
    steps = stack([b.inputs for b in batches])
    old = np.asarray(trainer.logprob_fn(state.params, steps))
    steps = steps.with_coefficients(old_logprobs=old)
    _, metrics = trainer.train_on(state, trainer.place(steps, 1), old_logprobs_stale=False,
                                  engine_logprobs=False, teacher=trainer.teacher.params())
    path_kl = 0.0
    for tree in trees:
        coeffs = path_coefficients(tree, normalization, normalizer)
        for p in range(tree.n_paths):
            path_kl += torch_distill_path_loss(policy, teacher, tree.path_tokens(p), coeffs[p],
                                               estimator)[0]
    assert abs(path_kl) > 1e-2
    assert float(metrics["distill_kl"]) == pytest.approx(path_kl, rel=TOL)


@pytest.mark.parametrize("extra, match", [
    ({"objective.kind": "sft"}, r"distill: needs an RL objective"),
    ({"objective.distill": "{teacher: x, estimator: forward}"}, r"estimator: 'forward'"),
    ({"objective.distill": "{coef: 1.0}"}, r"teacher: expected a Hugging Face checkpoint"),
    ({"run.mode": "redundancy_free"}, r"objective\.distill: run\.mode=redundancy_free"),
    ({"model.vocab_size": VOCAB + 1}, r"objective\.distill\.teacher: .* vocab_size"),
])
def test_distillation_refused_where_it_cannot_run(models, extra, match):
    """No distillation on sft's given text, with an unknown estimator or no teacher, on
    redundancy-free parts (no teacher forward), or with a teacher of another vocabulary."""
    with pytest.raises(ValueError, match=match):
        Trainer.build(distill_config(models[2], **extra))
