"""PPO with a critic on trees: per-path GAE, returns, the clipped value loss and its gradient equal
an independent float64 per-path reference on random multi-level trees (paths ending at internal
nodes, paths disagreeing on shared loss masks); a PPO step with the critic in tree mode equals the
per-path step (docs/rl.md, "PPO with a critic")."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jtree.hf
from jtree.cli import main as cli
from jtree.commands.export_hf import trained_model
from jtree.config import from_dict, load_config
from jtree.config.objective import CriticConfig, Objective, OptimConfig
from jtree.launch.train import main as train_main
from jtree.layout.baseline import linearize_baseline
from jtree.layout.linearize import linearize
from jtree.models import CausalLM, create_model
from jtree.objectives.critic import gae, pair_values
from jtree.objectives.losses import value_loss
from jtree.objectives.pairs import pair_token_sums, with_pairs
from jtree.partitioning.redundancy_free.executor import RedundancyFreeStep
from jtree.step.batches import stack_microbatches
from jtree.step.critic_params import flat_params
from jtree.step.optimizer import make_optimizer
from jtree.step.train_step import make_grad_fn
from jtree.training.resume import check_resumable
from jtree.training.run_data import load_training_trees
from jtree.training.step_builders import step_builder, step_indices
from jtree.training.trainer import Trainer
from jtree.trees.tree import TrajectoryTree
from tests.models_util import (
    assert_grads_close,
    assert_loss_and_grads_match,
    loss_and_grad_fn,
    off_policy_ppo_inputs,
    perturbed,
    tiny_config,
    tiny_lm,
    tiny_runtime,
)
from tests.run_util import tiny_overrides, write_groups
from tests.strategies import random_forest


def critic_tree(rng: np.random.Generator, **kw) -> TrajectoryTree:
    """A random multi-level tree with one reward per path (per-path loss masks and weights)."""
    kwargs = random_forest(rng, with_rl=False, **kw)
    return TrajectoryTree.from_nodes(**kwargs,
                                     rewards=rng.normal(size=len(kwargs["path_nodes"])).tolist())


def reference(trees, token_values, old_token_values, batch, gamma, lam, clip):
    """Per path, from the path's own token sequence, in float64: the value of the state before
    path position i is the value after position i - 1; GAE over the path's trained positions
    (mask 1, position > 0, weight > 0) with the reward at the last one. Returns the per-path
    (advantages, returns) in pair order (row by row, trees in order), the value loss, its gradient per row token, and the
    policy's P/N per row token."""
    rows, s = batch.shape
    adv, ret = [], []
    loss = 0.0
    grad = np.zeros((rows, s))
    pos = np.zeros((rows, s))
    neg = np.zeros((rows, s))
    w_sum = sum(float(t.weights.sum()) for t in trees)
    for k in np.argsort(batch.layout.rows, kind="stable"):  # the pairs' order: row by row
        tree, row, off = trees[k], batch.layout.rows[k], batch.layout.offsets[k]
        for p in range(tree.n_paths):
            idx = off + tree.path_token_index(p)
            m = tree.loss_masks[p].astype(np.float64).copy()
            m[0] = 0.0
            at = np.flatnonzero(m * tree.weights[p])
            if at.size == 0:
                continue
            c = tree.weights[p] / w_sum / at.size  # seq_mean_token_mean
            state = idx[at - 1]  # the token after which each action is chosen
            v = token_values[row, state].astype(np.float64)
            vo = old_token_values[row, state].astype(np.float64)
            a = np.zeros(at.size)
            nxt_a = 0.0
            for k in range(at.size - 1, -1, -1):
                last = k == at.size - 1
                delta = (tree.rewards[p] if last else 0.0) + (0.0 if last else gamma * vo[k + 1]) \
                    - vo[k]
                nxt_a = delta + (0.0 if last else gamma * lam * nxt_a)
                a[k] = nxt_a
            r = a + vo
            adv.append(a)
            ret.append(r)
            vc = np.clip(v, vo - clip, vo + clip)
            plain, clipped = (v - r) ** 2, (vc - r) ** 2
            loss += 0.5 * c * np.sum(np.maximum(plain, clipped))
            g = np.where(plain >= clipped, c * (v - r),
                         c * (vc - r) * ((v > vo - clip) & (v < vo + clip)))
            np.add.at(grad[row], state, g)
            np.add.at(pos[row], idx[at], np.where(a >= 0, c * a, 0.0))
            np.add.at(neg[row], idx[at], np.where(a < 0, c * a, 0.0))
    return adv, ret, loss, grad, pos, neg


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_gae_returns_and_value_loss_equal_the_per_path_reference(seed):
    rng = np.random.default_rng(seed)
    trees = [critic_tree(rng, max_nodes=9, extra_paths=4) for _ in range(3)]
    # some path ends at an internal node (a node with children)
    assert any(set(t.path_nodes) & set(t.parents[t.parents >= 0]) for t in trees)
    batch = with_pairs(linearize(trees, 64, n_rows=2))
    pairs = batch.inputs.pairs
    token_values = rng.normal(size=batch.shape).astype(np.float32)
    old_values = (token_values + rng.normal(0, 0.3, batch.shape)).astype(np.float32)
    gamma, lam, clip = 0.9, 0.7, 0.2
    adv_want, ret_want, loss_want, grad_want, pos_want, neg_want = reference(
        trees, token_values, old_values, batch, gamma, lam, clip)

    old = pair_values(jnp.asarray(old_values), batch.inputs.pred, pairs)
    adv, ret = gae(old, pairs, gamma, lam)

    def loss_of(tv):
        return value_loss(pair_values(tv, batch.inputs.pred, pairs), old, ret, pairs.coef, clip)

    loss, grad = jax.value_and_grad(loss_of)(jnp.asarray(token_values))
    live = pairs.index >= 0
    np.testing.assert_allclose(np.asarray(adv)[live], np.concatenate(adv_want), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(ret)[live], np.concatenate(ret_want), rtol=1e-5,
                               atol=1e-5)
    assert float(loss) == pytest.approx(loss_want, rel=1e-5)
    assert np.linalg.norm(np.asarray(grad) - grad_want) <= 1e-5 * np.linalg.norm(grad_want)
    ca = pairs.coef * adv
    s = batch.shape[1]
    np.testing.assert_allclose(pair_token_sums(jnp.where(ca >= 0, ca, 0.0), pairs, s), pos_want,
                               rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(pair_token_sums(jnp.where(ca < 0, ca, 0.0), pairs, s), neg_want,
                               rtol=1e-5, atol=1e-7)
    # the clip acts on some pairs and not on others, and a shared token has several returns
    v = np.asarray(pair_values(jnp.asarray(token_values), batch.inputs.pred, pairs))
    outside = np.abs(v - np.asarray(old))[live] > clip
    assert outside.any() and (~outside).any()
    index = pairs.index[live]
    assert len(np.unique(index)) < len(index)


@pytest.mark.parametrize("critic", ["head", "separate"])
def test_ppo_step_with_critic_equals_per_path_step(critic):
    """A tiny model with a value head on its trunk, or with a separate critic of another size:
    tree-mode PPO-with-critic loss and every gradient (the value head's, the critic's and the
    policy's) equal the per-path baseline's, off-policy old log-probs so the policy clip acts."""
    rng = np.random.default_rng(3)
    separate = critic == "separate"
    network = tiny_config(vocab_size=64, hidden_size=24, num_hidden_layers=1) if separate \
        else None
    model = CausalLM(tiny_config(vocab_size=64), tiny_runtime(), rngs=nnx.Rngs(0),
                     value_head=not separate, critic=network)
    graphdef, params = nnx.split(model)
    params = perturbed(params)
    trees = [critic_tree(rng, max_nodes=8, vocab=64) for _ in range(2)]
    tree = with_pairs(linearize(trees, 64, n_rows=4))
    base = with_pairs(linearize_baseline(trees, 64, n_rows=4))
    tree_in, base_in = off_policy_ppo_inputs(params, graphdef, tree, base, seed=1)
    objective = Objective(kind="ppo", clip_low=0.1, clip_high=0.1, critic=CriticConfig(
        gamma=0.95, lam=0.9, value_coef=0.5, model=critic, network=network))
    assert_loss_and_grads_match(graphdef, params, tree_in, base_in, objective)
    _, grads = loss_and_grad_fn(graphdef, objective)(params, tree_in)
    value_grads = grads["critic"] if separate else grads["value_head"]
    for part in (value_grads, grads["model"]):
        assert all(float(jnp.linalg.norm(x)) > 0 for x in jax.tree_util.tree_leaves(part))


def test_critic_config_is_checked():
    with pytest.raises(ValueError, match=r"objective.critic.gama: unknown config key"):
        from_dict(Objective, {"kind": "ppo", "critic": {"gama": 0.9}}, "objective")
    with pytest.raises(ValueError, match=r"objective.critic.model: 'value' is not one of"):
        from_dict(Objective, {"kind": "ppo", "critic": {"model": "value"}}, "objective")
    for key, value in (("network", {"hidden_size": 8}), ("init_from", "random")):
        with pytest.raises(ValueError, match=f"objective.critic: {key}: only for model: separate"):
            from_dict(Objective, {"kind": "ppo", "critic": {key: value}}, "objective")
    with pytest.raises(ValueError, match="learning_rate: -1.0 must be > 0"):
        from_dict(Objective, {"kind": "ppo", "critic": {"learning_rate": -1.0}}, "objective")
    base = ["objective.kind=ppo", "objective.critic.model=separate"]
    for override, match in (
            ("objective.critic.network={hidden_sise: 8}",
             r"objective.critic.network.hidden_sise: unknown config key"),
            ("objective.critic.network={vocab_size: 8}",
             r"objective.critic.network.vocab_size: 8 is not the policy's model.vocab_size"),
            ("objective.critic.network={architecture: qwen4}",
             r"objective.critic.network.architecture: 'qwen4' is not one of"),
            ("objective.critic.network={architecture: qwen3_moe, num_experts: 3, "
             "num_experts_per_tok: 4}", r"objective.critic.network: ")):
        with pytest.raises(ValueError, match=match):
            load_config(None, [*base, override])
    cfg = load_config(None, [*base, "objective.critic.network={num_hidden_layers: 1}"])
    assert cfg.critic_network == dataclasses.replace(cfg.model.config, num_hidden_layers=1)
    assert load_config(None, base).critic_network == cfg.model.config
    with pytest.raises(ValueError, match="critic: needs kind 'ppo'"):
        from_dict(Objective, {"kind": "gspo", "critic": {}}, "objective")
    with pytest.raises(ValueError, match=r"lam: 1.5 must be in \[0, 1\]"):
        from_dict(Objective, {"kind": "ppo", "critic": {"lam": 1.5}}, "objective")
    cfg = from_dict(Objective, {"kind": "ppo", "critic": {"gamma": 0.99}}, "objective")
    assert cfg.critic == CriticConfig(gamma=0.99) and cfg.advantage_estimator is None


def test_critic_needs_rewards():
    tree = TrajectoryTree.from_sequences([[1, 2, 3], [1, 2, 4]])
    with pytest.raises(ValueError, match="tree 0: no reward"):
        with_pairs(linearize([tree], 8))


@pytest.mark.slow
def test_run_steps_carry_critic_pairs_and_train_like_a_direct_batch(tmp_path):
    """A run's step (raw coefficients, `row_norm`, pairs at the run's fixed width, trees split
    over micro-batches) gives the loss and gradients of the same trees linearized directly."""
    data = write_groups(tmp_path / "g.jsonl", n_groups=6)
    rng = np.random.default_rng(0)
    records = [json.loads(line) for line in data.read_text().splitlines()]
    data.write_text("".join(json.dumps(dict(r, reward=float(rng.normal()))) + "\n"
                            for r in records))
    cfg = load_config(None, tiny_overrides(data, **{
        "objective.kind": "ppo", "objective.critic.gamma": 0.9, "objective.critic.lam": 0.8,
        "run.steps": 1}))
    trees, _ = load_training_trees(cfg)
    builder = step_builder(trees, cfg.data, "tree", normalization=cfg.objective.normalization,
                           n_shards=1, shards=(0,), steps=1, critic=True)
    indices = step_indices(len(trees), cfg.data.trees_per_step, cfg.data.shuffle_seed)[0]
    step = builder(indices)["inputs"]
    assert step.pairs.index.shape[-1] == builder.config.pair_len
    direct = stack_microbatches([with_pairs(
        linearize([trees[int(i)] for i in indices], 512, normalization=cfg.objective.normalization))])
    model = create_model("qwen3", cfg.model.config, cfg.runtime, value_head=True)
    graphdef, params = nnx.split(model)
    params = perturbed(params)
    grad_fn = jax.jit(make_grad_fn(graphdef, cfg.objective))
    loss_s, _, g_s = grad_fn(params, step)
    loss_d, _, g_d = grad_fn(params, direct)
    assert float(loss_s) == pytest.approx(float(loss_d), rel=1e-5)
    assert_grads_close(g_s, g_d)


def test_a_run_with_a_critic_needs_rewards(tmp_path):
    data = write_groups(tmp_path / "g.jsonl", n_groups=2)
    records = [json.loads(line) for line in data.read_text().splitlines()]
    data.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "reward"}) + "\n"
                            for r in records))
    cfg = load_config(None, tiny_overrides(data, **{"objective.kind": "ppo",
                                                    "objective.critic.gamma": 0.9}))
    with pytest.raises(ValueError, match="tree 0: no reward"):
        load_training_trees(cfg)


@pytest.mark.slow
def test_a_critic_run_checkpoints_its_value_head_and_exports_the_policy(few_groups_file,
                                                                        tmp_path):
    """`jtree train` with objective.critic trains the value head, checkpoints it, and
    `jtree export-hf` writes the policy without it."""
    overrides = tiny_overrides(few_groups_file, **{
        "run.steps": 2, "objective.kind": "ppo", "objective.critic.gamma": 0.9,
        "model.tie_word_embeddings": False})
    ckpt = tmp_path / "ckpt"
    assert train_main(["--config", "configs/tiny.yaml", *overrides,
                       f"checkpoint.dir={ckpt}"]) == 0
    trained, config, _ = trained_model("configs/tiny.yaml", overrides, str(ckpt))
    initial = create_model("qwen3", config, value_head=True)
    assert not np.array_equal(np.asarray(trained.value_head.kernel[...]),
                              np.asarray(initial.value_head.kernel[...]))
    assert cli(["export-hf", "--config", "configs/tiny.yaml", "--checkpoint", str(ckpt),
                "--out", str(tmp_path / "hf"), *overrides]) == 0
    _, loaded = jtree.hf.load(tmp_path / "hf")
    assert loaded.value_head is None
    np.testing.assert_array_equal(np.asarray(loaded.lm_head.kernel[...]),
                                  np.asarray(trained.lm_head.kernel[...]))


def test_resuming_may_change_the_critic_settings_not_whether_there_is_one():
    saved = {"objective.critic": {"gamma": 0.9}}
    check_resumable({"config": saved}, {"objective.critic": {"gamma": 0.99}}, "ckpt")
    for before, after in ((saved, {"objective.critic": None}), ({"objective.critic": None}, saved)):
        with pytest.raises(ValueError, match="objective.critic .*adds or removes the value head"):
            check_resumable({"config": before}, after, "ckpt")
    separate = {"model": "separate", "network": {"hidden_size": 16}, "learning_rate": 1e-3,
                "init_from": "policy"}
    check_resumable({"config": {"objective.critic": separate}}, {"objective.critic": dict(
        separate, learning_rate=1e-4, init_from="random")}, "ckpt")
    for change, why in (({"model": "head", "network": None}, "where the values come from"),
                        ({"network": {"hidden_size": 8}}, "the critic's network"),
                        ({"learning_rate": None}, "the critic's learning rate")):
        with pytest.raises(ValueError, match=f"objective.critic .*{why}"):
            check_resumable({"config": {"objective.critic": separate}},
                            {"objective.critic": dict(separate, **change)}, "ckpt")


def test_redundancy_free_mode_refuses_a_critic():
    graphdef, _ = nnx.split(CausalLM(tiny_config(), tiny_runtime(), rngs=nnx.Rngs(0),
                                     value_head=True))
    with pytest.raises(ValueError, match="objective.critic: not available with run.mode=redun"):
        RedundancyFreeStep(graphdef, Objective(kind="ppo", critic=CriticConfig()))


@pytest.mark.slow
def test_critic_starting_weights_with_hugging_face_checkpoints(tmp_path):
    """The value head with `model.init_from`: the policy from the checkpoint, the head from the
    seeded init. A separate critic: `init_from: policy` copies the policy's starting trunk (here
    the loaded one), a checkpoint directory loads the critic's trunk from it (another size), and
    its value head comes from the seeded init; the optimizer state is the fresh one's."""
    cfg = tiny_config()
    policy, other = tiny_lm(cfg, 11), tiny_lm(tiny_config(hidden_size=16, head_dim=4), 12)
    jtree.hf.save(policy, cfg, tmp_path / "policy")
    jtree.hf.save(other, other.config, tmp_path / "other")
    overrides = tiny_overrides(tmp_path / "unused.jsonl", **{
        "model.tie_word_embeddings": False, "model.rope_theta": cfg.rope_theta,
        "model.num_hidden_layers": 2, "objective.kind": "ppo"})
    loaded = flat_params(nnx.state(policy, nnx.Param))

    def start(*extra: str):
        config = load_config("configs/tiny.yaml", [*overrides, *extra])
        trainer = Trainer.build(config)
        state = trainer.initial_state()
        assert jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(
            jax.eval_shape(trainer.init_fn))
        return flat_params(state.params), flat_params(trainer.init_fn().params)

    def assert_same(got, want):
        assert set(got) == set(want)
        for name in want:
            np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), name)

    init = f"model.init_from={tmp_path / 'policy'}"
    got, seeded = start(init, "objective.critic.model=head")
    assert_same({k: v for k, v in got.items() if not k.startswith("value_head/")}, loaded)
    assert_same({k: v for k, v in got.items() if k.startswith("value_head/")},
                {k: v for k, v in seeded.items() if k.startswith("value_head/")})

    got, seeded = start(init, "objective.critic.model=separate")
    assert_same({k: v for k, v in got.items() if not k.startswith("critic/")}, loaded)
    assert_same({k[len("critic/"):]: v for k, v in got.items()
                 if k.startswith("critic/model/")},
                {k: v for k, v in loaded.items() if k.startswith("model/")})
    assert np.array_equal(got["critic/value_head/kernel"], seeded["critic/value_head/kernel"])

    got, seeded = start("objective.critic.model=separate",
                        f"objective.critic.init_from={tmp_path / 'other'}",
                        "objective.critic.network={hidden_size: 16, head_dim: 4}")
    other_params = flat_params(nnx.state(other, nnx.Param))
    assert_same({k[len("critic/"):]: v for k, v in got.items()
                 if k.startswith("critic/model/")},
                {k: v for k, v in other_params.items() if k.startswith("model/")})
    assert_same({k: v for k, v in got.items() if not k.startswith("critic/model/")},
                {k: v for k, v in seeded.items() if not k.startswith("critic/model/")})

    wrong = load_config("configs/tiny.yaml", [
        *overrides, "objective.critic.model=separate",
        f"objective.critic.init_from={tmp_path / 'other'}"])
    with pytest.raises(ValueError, match=r"objective.critic.init_from: objective.critic.network"
                                         r"\.hidden_size: the config has 32"):
        Trainer.build(wrong).initial_state()


@pytest.mark.slow
def test_a_separate_critic_run_checkpoints_resumes_and_exports_the_policy(few_groups_file,
                                                                          tmp_path):
    """`jtree train` with a separate critic (another size, its own learning rate) trains it,
    checkpoints it beside the policy (parameters and its own optimizer state), resumes from
    the checkpoint, and `jtree export-hf` writes the policy without it."""
    overrides = tiny_overrides(few_groups_file, **{
        "run.steps": 2, "objective.kind": "ppo", "objective.critic.gamma": 0.9,
        "objective.critic.model": "separate", "objective.critic.init_from": "random",
        "objective.critic.network": "{hidden_size: 16, head_dim: 4}",
        "objective.critic.learning_rate": 3e-3, "model.tie_word_embeddings": False})
    ckpt = tmp_path / "ckpt"
    assert train_main(["--config", "configs/tiny.yaml", *overrides,
                       f"checkpoint.dir={ckpt}"]) == 0
    assert train_main(["--config", "configs/tiny.yaml", *overrides, "run.steps=3",
                       f"checkpoint.dir={ckpt}", "--resume"]) == 0
    trained, config, _ = trained_model("configs/tiny.yaml", overrides, str(ckpt))
    cfg = load_config("configs/tiny.yaml", overrides)
    initial = create_model("qwen3", config, **cfg.model_args)
    assert trained.critic.config.hidden_size == 16
    for part in ("value_head", "model"):
        got, was = (flat_params(nnx.state(getattr(m.critic, part), nnx.Param))
                    for m in (trained, initial))
        assert any(not np.array_equal(np.asarray(got[k]), np.asarray(was[k])) for k in got)
    assert cli(["export-hf", "--config", "configs/tiny.yaml", "--checkpoint", str(ckpt),
                "--out", str(tmp_path / "hf"), *overrides]) == 0
    _, loaded = jtree.hf.load(tmp_path / "hf")
    assert loaded.critic is None and loaded.value_head is None
    np.testing.assert_array_equal(np.asarray(loaded.lm_head.kernel[...]),
                                  np.asarray(trained.lm_head.kernel[...]))


def test_the_critic_learning_rate_scales_only_the_critic_updates():
    """`objective.critic.learning_rate`: the critic's (value head's, separate critic's) AdamW
    updates are those at its own peak rate, the policy's unchanged."""
    params = {"model": {"w": jnp.ones(3)}, "value_head": {"kernel": jnp.ones(2)},
              "critic": {"model": {"w": jnp.ones(3)}}}
    grads = jax.tree_util.tree_map(lambda x: x * jnp.arange(1.0, x.size + 1), params)
    cfg = OptimConfig(learning_rate=1e-2, warmup_steps=2, decay_steps=10)

    def update(opt):
        state = opt.init(params)
        for _ in range(3):
            updates, state = opt.update(grads, state, params)
        return updates

    plain = update(make_optimizer(cfg))
    scaled = update(make_optimizer(cfg, critic_learning_rate=3e-3))
    own = update(make_optimizer(dataclasses.replace(cfg, learning_rate=3e-3)))
    np.testing.assert_array_equal(scaled["model"]["w"], plain["model"]["w"])
    for part in ("value_head", "critic"):
        for got, want in zip(jax.tree_util.tree_leaves(scaled[part]),
                             jax.tree_util.tree_leaves(own[part])):
            np.testing.assert_allclose(got, want, rtol=1e-6)
    with pytest.raises(ValueError, match="learning_rate: 0.0 must be > 0"):  # the critic's rate
        dataclasses.replace(cfg, learning_rate=0.0)  # scales the policy's: a peak of 0 is refused


@pytest.mark.slow
@pytest.mark.parametrize("critic", ["head", "separate"])
def test_the_reference_model_runs_the_policy_alone(tmp_path, critic):
    """With a critic, `objective.reference` (`initial`, or an HF checkpoint, which has no
    critic) runs the policy's parameters alone: `initial` gives the starting policy's log-probs,
    a checkpoint loads into the same layout."""
    overrides = tiny_overrides(tmp_path / "unused.jsonl", **{
        "objective.kind": "ppo", "objective.kl_coef": 0.1, "objective.reference": "initial",
        "objective.critic.model": critic})
    cfg = load_config("configs/tiny.yaml", overrides)
    trainer = Trainer.build(cfg)
    reference = trainer.reference_params()
    assert not any(k.startswith(("critic/", "value_head/")) for k in flat_params(reference))
    trees = [critic_tree(np.random.default_rng(0), max_nodes=6, vocab=64)]
    inputs = stack_microbatches([with_pairs(linearize(trees, 64, n_rows=1))])
    want = trainer.logprob_fn(trainer.initial_state().params, inputs)
    np.testing.assert_array_equal(trainer.ref_logprob_fn(reference, inputs), want)
    jtree.hf.save(create_model("qwen3", cfg.model.config, seed=0), cfg.model.config,
                  tmp_path / "hf")
    from_dir = Trainer.build(load_config("configs/tiny.yaml", [
        *overrides, f"objective.reference={tmp_path / 'hf'}"]))
    np.testing.assert_allclose(from_dir.ref_logprob_fn(from_dir.reference_params(), inputs),
                               want, rtol=1e-6, atol=1e-6)
