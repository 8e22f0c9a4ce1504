"""Prefixes shared across groups (`data.share_prefixes: across_groups`, `jtree.trees.merge`,
`jtree.layout.cross_group`, `StepBuilder` with `cross_group`). Oracles: the unmerged step (the same
builder without merging: each group its own tree) and the per-path baseline step (every path
alone), for the loss and every gradient; each group's own advantages and per-path data, for what
travels into the merged tree; hand counts for the saved tokens."""

import jax
import numpy as np
import pytest

from jtree.config import load_config
from jtree.config.objective import Objective
from jtree.layout.cross_group import common_prefix_len, merge_per_bin
from jtree.layout.planner import LayoutConfig
from jtree.objectives.advantages import turn_spans, with_advantages
from jtree.partitioning.redundancy_free.executor import RedundancyFreeStep
from jtree.step.train_step import make_grad_fn
from jtree.training.report import summary
from jtree.training.run_data import StepBuilders, load_training_trees
from jtree.training.step_builders import (
    CrossGroup,
    RfreeStepBuilder,
    RfreeStepConfig,
    StepBuilder,
    StepConfig,
    all_units,
)
from jtree.trees.loss_masks import check_shared_masks
from jtree.trees.merge import merge_trees
from jtree.trees.tree import TrajectoryTree
from tests.models_util import assert_grads_close, tiny_model
from tests.run_util import tiny_overrides
from tests.strategies import random_forest

VOCAB = 64
ESTIMATORS = ("grpo", "rloo", "dr_grpo", "tree", "turn", "given")


def _group(rng, prompt, *, prompt_path: bool = False, id_masks: bool = False) -> TrajectoryTree:
    """One group: a random branching tree (several levels, paths ending at internal nodes,
    duplicates) behind `prompt` (context, loss mask 0), with per-turn rewards, given advantages
    and old log-probs that are a function of the token id (so every two paths agree on every
    token they share, in any group). `prompt_path`: one more path that is the prompt alone plus
    one trained token. Loss masks: random per path (paths disagree on shared tokens), or with
    `id_masks` a function of the token id (one trained bit per tree token, as GSPO needs)."""
    while True:
        kw = random_forest(rng, max_nodes=8, max_seg=3, vocab=VOCAB - 2, roots=1, extra_paths=3)
        tree = TrajectoryTree.from_nodes(kw["parents"], [np.add(s, 1) for s in kw["segments"]],
                                         path_nodes=kw["path_nodes"])
        if tree.n_nodes >= 3:
            break
    seqs = [np.concatenate([prompt, tree.path_tokens(p)]) for p in range(tree.n_paths)]
    if prompt_path:
        seqs.append(np.concatenate([prompt, [5]]))
    masks = []
    for s in seqs:
        own = s[len(prompt):]
        m = np.r_[np.zeros(len(prompt)), own % 3 != 0 if id_masks else rng.random(len(own)) < 0.7]
        m[-1] = m[-1] if id_masks else 1.0
        masks.append(m)
    return TrajectoryTree.from_sequences(
        seqs, loss_masks=masks, weights=rng.uniform(0.5, 2.0, len(seqs)),
        old_logprobs=[-(1.0 + (s % 7) / 3.0) for s in seqs],
        advantages=[rng.normal(size=len(s)) for s in seqs],
        rewards=[rng.normal(size=max(1, len(turn_spans(m)))) for m in masks], vocab_size=VOCAB)


def _groups(seed: int, estimator: str = "grpo", id_masks: bool = False) -> list[TrajectoryTree]:
    """Groups sharing a common system prompt of varying length: four behind the whole system
    prompt and their own task, one behind a shorter piece of it, one whose prompt extends
    another group's whole prompt, one sharing nothing (another first token); advantages from
    `estimator`, per group."""
    rng = np.random.default_rng(seed)
    system = rng.integers(2, VOCAB - 1, size=int(rng.integers(4, 9)))
    task = rng.integers(2, VOCAB - 1, size=3)
    prompts = [np.r_[system, task], system[:3],
               np.r_[system, task, rng.integers(2, VOCAB - 1, size=2)],
               np.r_[[VOCAB - 1], rng.integers(2, VOCAB - 1, size=3)]]
    prompts += [np.r_[system, rng.integers(2, VOCAB - 1, size=2)] for _ in range(3)]
    groups = [_group(rng, p, prompt_path=i == 0, id_masks=id_masks)
              for i, p in enumerate(prompts)]
    return [with_advantages(g, estimator) for g in groups]


def _builder(trees, seq_len, *, merge, shards=(0, 1), n_shards=2, micro=2, rows=None,
             mode="tree", normalization="seq_mean_token_mean", shared_masks=False,
             score_len=None, critic=False):
    """The builder of one step of `trees`, merged or not, at `rows` rows per micro-batch
    (default: the fewest that hold the step)."""
    cross = CrossGroup(shared_masks=shared_masks) if merge else None
    units = None if merge else all_units(trees, mode, seq_len)

    def config(rows):
        return StepConfig(mode, normalization, len(trees), shards,
                          LayoutConfig(seq_len, n_shards, micro, rows, score_len=score_len),
                          critic=critic, off_policy=critic, cross_group=cross)

    if rows is None:
        rows = StepBuilder(trees, units, config(None)).rows_to_hold([np.arange(len(trees))])
    return StepBuilder(trees, units, config(rows))


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=2, vocab_size=VOCAB)


def _grads(model, objective, *batches):
    """(loss, metrics, grads) of each batch, through one jitted gradient function."""
    graphdef, params = model
    grad_fn = jax.jit(make_grad_fn(graphdef, objective))
    return [grad_fn(params, b) for b in batches]


@pytest.mark.parametrize("kind, normalization, estimator, seq_len, n_shards, micro", [
    ("ppo", "token_mean", "tree", 40, 2, 2),  # 4 bins, merged trees cut into capacity parts
    ("gspo", "seq_mean_token_sum", "rloo", 128, 2, 1),  # merged only where masks agree
])
def test_merged_step_has_the_unmerged_and_per_path_loss_and_gradients(
        model, kind, normalization, estimator, seq_len, n_shards, micro):
    trees = _groups(seed=7, estimator=estimator, id_masks=kind == "gspo")
    objective = Objective(kind=kind, normalization=normalization)
    step = np.arange(len(trees))

    def built(merge, mode="tree", rows=None):
        return _builder(trees, seq_len, merge=merge, shards=tuple(range(n_shards)),
                        n_shards=n_shards, micro=micro, mode=mode, normalization=normalization,
                        shared_masks=kind == "gspo", rows=rows, score_len=seq_len)

    # One shape for the three steps (one compile): the most rows any of them needs.
    variants = {"merged": (True, "tree"), "unmerged": (False, "tree"),
                "per_path": (False, "baseline")}
    rows = max(built(*v).config.layout.rows for v in variants.values())
    merged, unmerged, per_path = (built(*v, rows=rows)(step) for v in variants.values())
    info = merged["info"]
    assert info["n_merge_saved_tokens"] > 0
    assert info["n_computed_tokens"] < unmerged["info"]["n_computed_tokens"]
    if seq_len == 128:  # every tree fits a row: the merge is all that changes what is computed
        assert info["n_computed_tokens"] == (unmerged["info"]["n_computed_tokens"]
                                             - info["n_merge_saved_tokens"])
    assert (info["n_tree_tokens"], info["n_flat_tokens"]) == (
        unmerged["info"]["n_tree_tokens"], unmerged["info"]["n_flat_tokens"])
    assert float(merged["inputs"].row_norm.sum()) == pytest.approx(
        float(unmerged["inputs"].row_norm.sum()), rel=1e-6)
    (loss_m, _, g_m), (loss_u, _, g_u), (loss_b, _, g_b) = _grads(
        model, objective, merged["inputs"], unmerged["inputs"], per_path["inputs"])
    assert float(loss_u) != 0.0
    assert float(loss_m) == pytest.approx(float(loss_u), rel=1e-5, abs=1e-7)
    assert float(loss_m) == pytest.approx(float(loss_b), rel=1e-5, abs=1e-7)
    assert_grads_close(g_m, g_u, tol=1e-5)
    assert_grads_close(g_m, g_b, tol=1e-5)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_every_path_keeps_its_group_advantages_and_data(estimator):
    groups = _groups(seed=3, estimator=estimator)
    merged = merge_trees(groups)
    sources = [(g, p) for g in groups for p in range(g.n_paths)]
    assert merged.n_paths == len(sources)
    for q, (g, p) in enumerate(sources):
        np.testing.assert_array_equal(merged.path_tokens(q), g.path_tokens(p))
        for field in ("loss_masks", "advantages", "old_logprobs", "turn_rewards"):
            np.testing.assert_array_equal(getattr(merged, field)[q], getattr(g, field)[p])
        assert merged.weights[q] == g.weights[p]
    if estimator not in ("given", "turn"):  # the merged tree is not one group: its own
        pooled = with_advantages(merged, estimator)  # estimate would differ
        assert not all(np.allclose(a, b) for a, b in zip(pooled.advantages, merged.advantages))


def test_saved_tokens_and_common_prefix_match_a_hand_count():
    sys4 = [1, 2, 3, 4]
    a = TrajectoryTree.from_sequences([sys4 + [5, 6], sys4 + [5, 7], sys4])  # 7 tree tokens
    b = TrajectoryTree.from_sequences([sys4 + [5, 6, 8], sys4 + [9]])  # 8
    c = TrajectoryTree.from_sequences([sys4[:2] + [10]])  # 3, shares [1, 2]
    d = TrajectoryTree.from_sequences([[11, 12], [13]])  # a forest: no common prefix
    assert common_prefix_len([a, b]) == 4 and common_prefix_len([a, b, c]) == 2
    assert common_prefix_len([a, d]) == 0
    one = merge_per_bin([a, b, c, d], 1)
    # merged: [1,2] -> ([3,4] -> [5] -> ([6] -> [8], [7]), [9]), [10]; [11,12]; [13]
    assert one.trees[0].n_tree_tokens == 2 + 2 + 1 + 1 + 1 + 1 + 1 + 1 + 2 + 1
    assert one.saved_tokens == (7 + 8 + 3 + 3) - 13
    two = merge_per_bin([a, b, c, d], 2)
    assert sorted(len(m) for m in two.members) == [2, 2]
    assert two.saved_tokens == (7 + 8 + 3 + 3) - sum(t.n_tree_tokens for t in two.trees)


def test_gspo_merges_only_where_the_trained_bit_agrees():
    a = TrajectoryTree.from_sequences([[1, 2, 3, 4]], loss_masks=[[0, 0, 0, 1]])
    b = TrajectoryTree.from_sequences([[1, 2, 3, 5]], loss_masks=[[0, 0, 1, 1]])
    with pytest.raises(ValueError, match="objective.kind=gspo"):
        check_shared_masks(merge_trees([a, b]))
    merged = merge_trees([a, b], shared_masks=True)
    check_shared_masks(merged)
    assert merged.n_tree_tokens == 2 + 2 + 2  # [1, 2] shared, token 3 trained by b only


def test_hosts_split_the_merged_step_and_its_normalizer(model):
    trees = _groups(seed=5)
    step = np.arange(len(trees))
    whole = _builder(trees, 128, merge=True)
    rows = whole.config.layout.rows
    parts = [_builder(trees, 128, merge=True, shards=(s,), rows=rows)(step)["inputs"]
             for s in (0, 1)]
    full = whole(step)["inputs"]
    np.testing.assert_array_equal(np.concatenate([p.tokens for p in parts], axis=1), full.tokens)
    assert sum(float(p.row_norm.sum()) for p in parts) == pytest.approx(
        float(_builder(trees, 128, merge=False)(step)["inputs"].row_norm.sum()), rel=1e-6)


def test_critic_and_off_policy_pairs_travel_with_their_paths():
    """PPO's critic and the off-policy weights read one (path, trained token) pair each, path
    after path: the merged step holds the unmerged step's pairs (coefficient, reward at the
    path's end, advantage, behavior log-prob), none lost or added."""
    trees = _groups(seed=9)
    step = np.arange(len(trees))

    def pairs(merge):
        found = _builder(trees, 128, merge=merge, critic=True)(step)["inputs"].pairs
        live = np.asarray(found.index) >= 0
        return sorted(zip(*(np.asarray(getattr(found, f))[live].round(6)
                            for f in ("coef", "reward", "advantage", "behavior"))))

    merged = pairs(True)
    assert merged == pairs(False) and len(merged) > 0


def _rfree_steps(trees, n_shards: int = 1) -> dict:
    """The redundancy-free step of `trees`, unmerged (None) and merged into `n_shards` trees."""
    return {merge: RfreeStepBuilder(trees, RfreeStepConfig(  # power-of-two rows: few shapes
        "seq_mean_token_mean", 64, 32, len(trees), row_steps_per_octave=1,
        uniform=n_shards > 1, merge_into=merge))(np.arange(len(trees)))
        for merge in (None, n_shards)}


@pytest.mark.parametrize("n_shards", [1, 2])
def test_redundancy_free_merges_per_row_shard_and_computes_each_merged_token_once(n_shards):
    trees = _groups(seed=11)
    steps = _rfree_steps(trees, n_shards)
    merged = merge_per_bin(trees, n_shards)
    info_m, info_u = steps[n_shards]["info"], steps[None]["info"]
    assert info_m["n_merge_saved_tokens"] == merged.saved_tokens > 0
    assert info_m["n_computed_tokens"] == sum(t.n_tree_tokens for t in merged.trees)
    assert info_u["n_computed_tokens"] == sum(t.n_tree_tokens for t in trees)


@pytest.mark.slow  # compiles the redundancy-free parts of both programs (about 20 s)
def test_redundancy_free_merged_program_has_the_unmerged_loss_and_gradients(model):
    trees = _groups(seed=11)[:3]  # whole system prompt, a piece of it, an extension
    graphdef, params = model
    rfree = RedundancyFreeStep(graphdef, Objective(kind="ppo"))
    steps = _rfree_steps(trees)
    loss_m, _, g_m = rfree(params, steps[1]["program"])
    loss_u, _, g_u = rfree(params, steps[None]["program"])
    assert float(loss_m) == pytest.approx(float(loss_u), rel=1e-5, abs=1e-7)
    assert_grads_close(g_m, g_u, tol=1e-5)


def test_run_config_merges_groups_refuses_baseline_and_logs_the_saving(tmp_path, capsys):
    import json
    path = tmp_path / "g.jsonl"
    system = [3, 4, 5, 6, 7, 8]
    groups = {0: ([system + [9, 10], system + [9, 11], system + [12]], [1.0, 0.0, 0.5]),
              1: ([system + [13, 14], system + [15]], [0.0, 1.0])}
    path.write_text("".join(json.dumps({"group": g, "tokens": s, "reward": r}) + "\n"
                            for g, (seqs, rs) in groups.items() for s, r in zip(seqs, rs)))
    base = tiny_overrides(path, **{"run.mode": "tree", "run.steps": 1, "data.trees_per_step": 2,
                                   "data.micro_batches": 1, "objective.kind": "ppo",
                                   "objective.advantage": "grpo",
                                   "data.share_prefixes": "across_groups"})
    cfg = load_config("configs/tiny.yaml", base)
    trees, _ = load_training_trees(cfg)
    assert [t.advantages[0][0] for t in trees] == [
        pytest.approx(a, rel=1e-4) for a in (0.5 / np.std([1.0, 0.0, 0.5]), -1.0)]
    builders = StepBuilders(cfg, trees, n_data=1, shards=(0,))
    assert "each step's trees merged at their common prefixes" in capsys.readouterr().out
    info = builders["tree"](np.arange(2))["info"]
    assert int(info["n_merge_saved_tokens"]) == 6  # the system prompt, once instead of twice
    with pytest.raises(ValueError, match="data.share_prefixes=across_groups: run.mode=baseline"):
        StepBuilders(load_config("configs/tiny.yaml", base + ["run.mode=baseline"]), trees,
                     n_data=1, shards=(0,))
    with pytest.raises(ValueError, match="data.share_prefixes"):
        load_config("configs/tiny.yaml", base + ["data.share_prefixes=everywhere"])
    record = dict(step=1, loss=0.5, tokens_per_s=1.0, device_s=1.0, host_s=0.1, compiles=0,
                  compile_s=0.0, n_tree_tokens=100, n_pruned_tokens=0, n_merge_saved_tokens=25)
    assert "; merged across groups: 25 tree tokens of 100 computed once" in summary(
        [record], 1.0, 0, None)
