"""`objective.off_policy` in training runs (docs/rl.md, "Off-policy correction"): the run's step
(pairs laid out by the step builder, pi_old from a forward on the step's batch, weights formed
on the device) against a dense per-path JAX computation written here, which runs the model on
every path alone and weighs each path's terms by its own formula; the metrics; the refusals."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jtree.config import load_config
from jtree.config.objective import Objective, OffPolicyConfig
from jtree.config.run import DataConfig
from jtree.layout.batch import DeviceBatch
from jtree.memory.step_shapes import abstract_step_args
from jtree.objectives.logprobs import token_logprobs
from jtree.step.batches import old_logprobs_stale
from jtree.step.train_step import make_grad_fn, make_logprob_fn
from jtree.training.compile_log import Compiles
from jtree.training.report import step_record, summary
from jtree.training.run import train
from jtree.training.run_data import load_training_trees
from jtree.training.step_builders import step_builder, step_indices
from jtree.training.trainer import Trainer, check_off_policy
from jtree.trees.jsonl import write_trees
from jtree.trees.tree import TrajectoryTree
from tests.models_util import assert_grads_close, path_inputs, perturbed, tiny_model
from tests.run_util import read_metrics, tiny_overrides
from tests.strategies import random_forest

CLIP = 0.2
OBJECTIVES = {
    "ppo_tis": Objective(kind="ppo", clip_low=CLIP, clip_high=CLIP,
                         off_policy=OffPolicyConfig(kind="tis", cap=1.1)),
    "ppo_mis": Objective(kind="ppo", clip_low=CLIP, clip_high=CLIP,
                         normalization="token_mean",
                         off_policy=OffPolicyConfig(kind="mis", low=0.9, high=1.1)),
    "gspo_seq_tis": Objective(kind="gspo", clip_low=CLIP, clip_high=CLIP,
                              normalization="seq_mean_token_sum",
                              off_policy=OffPolicyConfig(kind="seq_tis", cap=1.02)),
}
# The sequence masks: the geometric-mean ratio mask, DeepSeek-V3.2's KL mask, alone and on top
# of a weighting kind.
MASKS = {
    "ppo_seq_mask": Objective(kind="ppo", clip_low=CLIP, clip_high=CLIP,
                              off_policy=OffPolicyConfig(kind="seq_mask", low=0.99, high=1.01)),
    "gspo_seq_mask": Objective(kind="gspo", clip_low=CLIP, clip_high=CLIP,
                               off_policy=OffPolicyConfig(kind="seq_mask", low=0.99, high=1.01)),
    "ppo_kl_mask": Objective(kind="ppo", clip_low=CLIP, clip_high=CLIP,
                             normalization="seq_mean_token_sum",
                             off_policy=OffPolicyConfig(kl_mask_delta=0.005)),
    "gspo_seq_tis_kl_mask": Objective(kind="gspo", clip_low=CLIP, clip_high=CLIP,
                                      off_policy=OffPolicyConfig(kind="seq_tis", cap=1.02,
                                                                 kl_mask_delta=0.005)),
}
SEQ_LEN = 32  # a tree larger than this is split into capacity parts in tree mode


@functools.cache
def model():
    """(graphdef, params, old params): the step's parameters and the ones pi_old comes from
    (another policy, so the PPO clip acts; a run recomputes pi_old with the step's own)."""
    graphdef, params = tiny_model(num_hidden_layers=1)
    params = perturbed(params)
    return graphdef, params, perturbed(params, scale=0.02, seed=7)


@functools.partial(jax.jit, static_argnums=0)
def path_logprobs(graphdef, params, inputs: DeviceBatch) -> jax.Array:
    return token_logprobs(nnx.merge(graphdef, params), inputs)


def branching(shapes: list[TrajectoryTree]) -> bool:
    """Several levels, a path ending at an internal node, a duplicate path, a tree larger than
    a row."""
    return (max(int(t.node_levels.max()) for t in shapes) >= 2
            and max(t.n_tree_tokens for t in shapes) > SEQ_LEN
            and any(set(t.parents.tolist()) & set(t.path_nodes.tolist()) for t in shapes)
            and any(len(set(t.path_nodes.tolist())) < t.n_paths for t in shapes))


def make_trees(rng: np.random.Generator, shared_masks: bool) -> list[TrajectoryTree]:
    """Random multi-level forests (siblings, paths ending at internal nodes, duplicates), every
    path with its own behavior log-probs mu: the old policy's per-path log-probs moved by
    per-path noise, so the paths disagree on shared tokens and ratios straddle the cap."""
    graphdef, _, old_params = model()
    shapes: list[TrajectoryTree] = []
    while len(shapes) < 4 or not branching(shapes):
        shapes = shapes[1:] if len(shapes) == 4 else shapes
        shape = TrajectoryTree.from_nodes(**random_forest(rng, with_rl=False, max_nodes=10,
                                                          max_seg=6, extra_paths=3))
        if shape.n_paths >= 2 and shape.n_tree_tokens >= 8 and \
                shape.path_lengths.max() <= SEQ_LEN:
            shapes.append(shape)
    paths = [[s.path_tokens(p) for p in range(s.n_paths)] for s in shapes]
    flat = [p for ps in paths for p in ps]
    old = np.asarray(path_logprobs(graphdef, old_params, path_inputs(flat, max(map(len, flat)))))
    trees, i = [], 0
    for shape, ps in zip(shapes, paths):
        token_mask = (rng.random(shape.n_tree_tokens) < 0.8).astype(int)
        masks, mus, advantages = [], [], []
        for p, toks in enumerate(ps):
            n = len(toks)
            masks.append(token_mask[shape.path_token_index(p)] if shared_masks else
                         (rng.random(n) < 0.8).astype(int))
            mus.append(np.minimum(old[i, :n] + rng.normal(0, 0.08, n), 0.0))
            advantages.append(float(rng.normal()) if shared_masks or rng.random() < 0.5 else
                              rng.normal(size=n))
            i += 1
        trees.append(TrajectoryTree.from_nodes(
            shape.parents.tolist(), list(shape.segments), path_nodes=shape.path_nodes.tolist(),
            loss_masks=masks, advantages=advantages, old_logprobs=mus,
            weights=rng.uniform(0.5, 2.0, shape.n_paths).tolist()))
    return trees


def reference(trees: list[TrajectoryTree], objective: Objective):
    """Per-path loss, gradients and metrics, from the paths alone: every path run by itself,
    pi_old its own forward under the old parameters; c[p,t] by the normalization's formula;
    the sequence masks from each path's own mean over its trained tokens. Also which paths
    (in `trees`' order) a mask drops any term of."""
    graphdef, params, old_params = model()
    flat = [(t, p) for t in trees for p in range(t.n_paths)]
    tokens = [t.path_tokens(p) for t, p in flat]
    length = max(map(len, tokens))
    inputs = path_inputs(tokens, length)

    def pad(x):
        out = np.zeros((len(flat), length))
        for i, v in enumerate(x):
            out[i, :len(v)] = v
        return jnp.asarray(out, jnp.float32)

    m = np.zeros((len(flat), length))
    for i, (t, p) in enumerate(flat):
        m[i, 1:len(tokens[i])] = t.loss_masks[p][1:]
    w = np.array([t.weights[p] for t, p in flat])[:, None]
    n = m.sum(1, keepdims=True)
    c = {"seq_mean_token_mean": w * m / (w.sum() * np.maximum(n, 1)),
         "seq_mean_token_sum": w * m / w.sum(),
         "token_mean": w * m / (w * m).sum()}[objective.normalization]
    a = pad([np.broadcast_to(t.advantages[p], (len(tokens[i]),)) for i, (t, p) in enumerate(flat)])
    mu = pad([t.old_logprobs[p] for t, p in flat])
    m, c, n = jnp.asarray(m, jnp.float32), jnp.asarray(c, jnp.float32), jnp.asarray(n, jnp.float32)
    pi_old = path_logprobs(graphdef, old_params, inputs)
    x = jnp.where(m > 0, pi_old - mu, 0.0)
    cfg = objective.off_policy
    r = jnp.exp(x) if not cfg.sequence_level else \
        jnp.broadcast_to(jnp.exp(x.sum(1, keepdims=True) / jnp.maximum(n, 1)), x.shape)
    if cfg.kind == "none":
        weight, corrected = jnp.ones_like(r), jnp.zeros(r.shape, bool)
    elif cfg.kind.endswith("tis"):
        weight, corrected = jnp.minimum(r, cfg.cap), r > cfg.cap
    else:
        corrected = (r < cfg.low) | (r > cfg.high)
        weight = jnp.where(corrected, 0.0, 1.0 if cfg.kind == "seq_mask" else r)
    masked = corrected if cfg.kind in ("mis", "seq_mis", "seq_mask") else \
        jnp.zeros(r.shape, bool)
    if cfg.kl_mask_delta is not None:  # DeepSeek-V3.2: mean over the path of mu - pi_old
        kl = jnp.sum(m * (mu - pi_old), 1, keepdims=True) / jnp.maximum(n, 1)
        dropped = (m > 0) & (a < 0) & (kl > cfg.kl_mask_delta)
        weight, masked = jnp.where(dropped, 0.0, weight), masked | dropped

    def loss(p):
        logp = path_logprobs(graphdef, p, inputs)
        if objective.kind == "ppo":
            rho = jnp.exp(jnp.where(m > 0, logp - pi_old, 0.0))
            clipped = jnp.clip(rho, 1 - CLIP, 1 + CLIP)
            return -jnp.sum(c * weight * jnp.minimum(rho * a, clipped * a))
        s = jnp.exp(jnp.sum(m * (logp - pi_old), 1) / jnp.maximum(n[:, 0], 1))
        clipped = jnp.clip(s, 1 - CLIP, 1 + CLIP)
        cwp, ap = jnp.sum(c * weight, 1), a[:, 0]  # one advantage per path
        return -jnp.sum(cwp * jnp.minimum(s * ap, clipped * ap))

    value, grads = jax.value_and_grad(loss)(params)
    live = np.asarray(m) > 0
    xs = np.asarray(x, np.float64)[live]
    metrics = {"offpolicy_kl_k1": np.mean(-xs), "offpolicy_kl_k3": np.mean(np.expm1(xs) - xs),
               "offpolicy_corrected_frac": np.asarray(corrected)[live].mean()}
    path_masked = np.any(np.asarray(masked) & live, axis=1)
    metrics["offpolicy_masked_seq_frac"] = path_masked[live.any(1)].mean()
    return float(value), grads, metrics, float(jnp.sum(jnp.abs(c * a))), path_masked


def run_step(trees: list[TrajectoryTree], objective: Objective, mode: str):
    """The run's step on `trees`: laid out by the run's step builder (2 micro-batches, raw
    coefficients with `row_norm`, pairs), pi_old from a forward on that batch (under the old
    parameters here), then the step's gradient function."""
    graphdef, params, old_params = model()
    data = DataConfig(seq_len=SEQ_LEN, trees_per_step=len(trees), micro_batches=2)
    builder = step_builder(trees, data, mode, normalization=objective.normalization,
                           n_shards=1, shards=(0,), steps=1, off_policy=True)
    if mode == "tree":
        assert sum(map(len, builder.units)) > len(trees)  # a tree is split into parts
    element = builder(step_indices(len(trees), len(trees), 0)[0])
    inputs = element["inputs"]
    micro = [jax.tree_util.tree_map(lambda x, i=i: x[i], inputs) for i in range(inputs.shape[0])]
    old = jnp.stack([logprob_fn(graphdef)(old_params, mb) for mb in micro])
    loss, metrics, grads = grad_fn(graphdef, objective)(params,
                                                         inputs.with_coefficients(old_logprobs=old))
    return float(loss), {k: float(v) for k, v in metrics.items()}, grads, element["info"]


@functools.cache
def logprob_fn(graphdef):
    return jax.jit(make_logprob_fn(graphdef))


@functools.cache
def grad_fn(graphdef, objective: Objective):
    return jax.jit(make_grad_fn(graphdef, objective))


def assert_step_equals(trees: list[TrajectoryTree], objective: Objective, want) -> None:
    """Loss, every gradient and the metrics of the run's step, in tree mode (a tree split into
    parts) and baseline mode, equal the per-path reference `want`; paths really disagree on
    shared tokens' mu."""
    want_loss, want_grads, want_metrics, scale, _ = want
    for mode in ("tree", "baseline"):
        loss, metrics, grads, info = run_step(trees, objective, mode)
        assert abs(loss - want_loss) <= 1e-5 * max(abs(want_loss), scale), (mode, loss, want_loss)
        assert_grads_close(grads, want_grads)
        for name, value in want_metrics.items():
            assert metrics[name] == pytest.approx(value, rel=1e-4, abs=1e-7), (mode, name)
        assert float(info["offpolicy_behavior_disagreement"]) > 0.01
        if objective.kind == "ppo":
            assert 0 < metrics["clip_frac"] < 1  # the PPO clip acts too


@pytest.mark.parametrize("case", list(OBJECTIVES))
def test_run_step_with_off_policy_weights_equals_per_path_reference(case):
    """The run's step equals the per-path reference; the weights really truncate or mask some
    pairs and not others."""
    objective = OBJECTIVES[case]
    trees = make_trees(np.random.default_rng(3), shared_masks=objective.kind == "gspo")
    assert branching(trees)
    want = reference(trees, objective)
    assert 0.05 < want[2]["offpolicy_corrected_frac"] < 0.95
    assert_step_equals(trees, objective, want)


def masked_beside_kept(trees: list[TrajectoryTree], path_masked: np.ndarray) -> bool:
    """Whether some tree token is trained by a path a mask drops and by a path it keeps: the
    mask is per path, so that shared token keeps the kept path's term."""
    i = 0
    for tree in trees:
        by = {True: set(), False: set()}
        for p in range(tree.n_paths):
            trained = tree.path_token_index(p)[np.asarray(tree.loss_masks[p]) > 0]
            by[bool(path_masked[i])].update(trained[trained > 0].tolist())
            i += 1
        if by[True] & by[False]:
            return True
    return False


@pytest.mark.parametrize("case", list(MASKS))
def test_run_step_with_sequence_masks_equals_per_path_reference(case):
    """The sequence masks (docs/rl.md, "Sequence masks") in the run's step equal the per-path
    reference, each path run alone with its mask from its own tokens; the masks drop some paths
    and keep others, including paths that share trained tokens with a dropped one."""
    objective = MASKS[case]
    trees = make_trees(np.random.default_rng(3), shared_masks=objective.kind == "gspo")
    assert branching(trees)
    want = reference(trees, objective)
    assert 0.05 < want[2]["offpolicy_masked_seq_frac"] < 0.95
    assert masked_beside_kept(trees, want[4])
    assert_step_equals(trees, objective, want)


def test_step_records_and_the_summary_carry_the_metrics():
    """The step's device metrics and the host's behavior disagreement go into the step's
    record; the summary gives their means over the steps and the largest disagreement."""
    info = {"n_trees": 2, "n_tree_tokens": 10, "n_flat_tokens": 20, "n_computed_tokens": 10,
            "n_pruned_tokens": 0, "offpolicy_behavior_disagreement": np.float64(0.25)}
    history = [step_record(k, {"loss": 1.0, "grad_norm": 1.0, "offpolicy_kl_k1": 0.1,
                               "offpolicy_kl_k3": 0.02 * (k + 1), "offpolicy_corrected_frac": 0.5,
                               "offpolicy_masked_seq_frac": 0.25},
                           dict(info, offpolicy_behavior_disagreement=0.25 * (k + 1)), 0.1, 0.1,
                           Compiles(), 1e-3) for k in range(2)]
    assert history[1]["offpolicy_behavior_disagreement"] == 0.5
    assert history[0]["offpolicy_kl_k3"] == 0.02
    line = summary(history, 1.0, 0, None)
    assert ("off-policy: mean kl_k3 3.00e-02, corrected 50.0% of pairs, max behavior "
            "disagreement 5.00e-01, masked 25.0% of sequences") in line
    plain = {k: v for k, v in history[0].items() if not k.startswith("offpolicy")}
    assert "off-policy" not in summary([plain], 1.0, 0, None)


@pytest.mark.slow
def test_a_run_trains_with_the_weights_and_logs_their_metrics(tmp_path, capsys):
    """`objective.off_policy` in a run: pi_old recomputed every step (the data's old log-probs
    are mu), the weights' and the KL sequence mask's metrics in each step's record and in the
    summary; the engine log-prob gap compares mu with the recomputed pi_old (not pi_old with
    itself)."""
    data = tmp_path / "trees.jsonl"
    write_trees(data, make_trees(np.random.default_rng(5), shared_masks=False))
    metrics = tmp_path / "metrics.jsonl"
    cfg = load_config(None, tiny_overrides(data, **{
        "data.format": "trees", "data.seq_len": SEQ_LEN, "data.trees_per_step": 2,
        "run.steps": 2, "run.metrics_jsonl": metrics, "objective.kind": "ppo",
        "objective.old_logprob_tolerance": 10.0, "objective.off_policy.kind": "tis",
        "objective.off_policy.cap": 1.05, "objective.off_policy.kl_mask_delta": 0.0}))
    train(cfg)
    records = read_metrics(metrics)
    assert len(records) == 2
    for r in records:
        assert r["offpolicy_kl_k3"] > 0 and 0 < r["offpolicy_corrected_frac"] < 1
        assert np.isfinite(r["offpolicy_kl_k1"]) and r["offpolicy_behavior_disagreement"] > 0
        assert 0 <= r["offpolicy_masked_seq_frac"] <= 1
        assert 1e-3 < r["engine_logprob_gap"] < 1
    out = capsys.readouterr().out
    assert "off-policy: mean kl_k3" in out and "of sequences" in out


def test_runs_refuse_what_cannot_take_the_weights(tmp_path):
    base = ["objective.kind=ppo", "objective.off_policy.kind=tis", "objective.off_policy.cap=2.0"]
    cfg = load_config("configs/tiny.yaml", base)
    check_off_policy(cfg)
    # pi_old is the trainer's own even where the data's old log-probs agree on every token
    assert old_logprobs_stale(True, 0.0, cfg.objective)
    assert not old_logprobs_stale(True, 0.0, Objective(kind="ppo"))
    with pytest.raises(ValueError, match="objective.off_policy.kind=tis: not available with "
                                         "run.mode=redundancy_free"):
        check_off_policy(load_config("configs/tiny.yaml", [*base, "run.mode=redundancy_free"]))
    kl_mask = ["objective.kind=ppo", "objective.off_policy.kl_mask_delta=0.01"]
    assert load_config("configs/tiny.yaml", kl_mask).objective.off_policy.kl_mask_delta == 0.01
    with pytest.raises(ValueError, match="objective.off_policy.kl_mask_delta=0.01: not "
                                         "available with run.mode=redundancy_free"):
        check_off_policy(load_config("configs/tiny.yaml", [*kl_mask, "run.mode=redundancy_free"]))
    data = tmp_path / "trees.jsonl"
    data.write_text(json.dumps({"parents": [-1], "segments": [[1, 2, 3]], "paths": [
        {"node": 0, "loss_mask": [0, 1, 1], "advantage": 1.0}]}) + "\n")
    with pytest.raises(ValueError, match="tree 0: no old_logprobs"):
        load_training_trees(load_config(None, [f"data.path={data}", "data.format=trees", *base]))


def test_the_step_a_config_lowers_carries_the_pairs():
    """`jtree.launch.lower_step` and `jtree.memory` trace the run's step on abstract inputs:
    with off-policy weights they carry the pairs the step reads."""
    cfg = load_config("configs/tiny.yaml", [
        "objective.kind=gspo", "objective.off_policy.kind=seq_mis",
        "objective.off_policy.low=0.5", "objective.off_policy.high=2.0", "data.seq_len=64",
        "model.num_hidden_layers=1"])
    trainer = Trainer.build(cfg)
    state, inputs = abstract_step_args(trainer, 1)
    assert inputs.pairs.behavior.shape == inputs.pairs.index.shape
    metrics = jax.eval_shape(trainer.step_fn, state, inputs)[1]
    assert "offpolicy_kl_k3" in metrics
