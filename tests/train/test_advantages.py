"""Advantages from rewards: the documented values on hand-built trees, bad records, and training
with rewards as the only input equal to per-path training (docs/rl.md)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jtree.advantages import group_advantages, tree_token_advantages, with_advantages
from jtree.config import load_config
from jtree.data import load_trees
from jtree.linearize import linearize
from jtree.run_data import load_training_trees
from jtree.train_step import Objective
from jtree.tree import TrajectoryTree
from tests.models_util import assert_loss_and_grads_match, off_policy_ppo_inputs, tiny_model
from tests.strategies import random_forest

# root [1, 2] -> a [3] -> {b [4, 5], c [6]}; root -> d [7, 8]. Paths end at b, c, d and (inside)
# at a, with rewards 1, 0, 0, 2: group mean 3/4.
HAND = dict(parents=[-1, 0, 1, 1, 0], segments=[[1, 2], [3], [4, 5], [6], [7, 8]],
            path_nodes=[2, 3, 4, 1], rewards=[1.0, 0.0, 0.0, 2.0])


def test_tree_advantages_of_a_hand_built_tree():
    tree = with_advantages(TrajectoryTree.from_nodes(**HAND), "tree")
    # V(root) = 3/4, V(a) = (1 + 0 + 2) / 3 = 1, V(b) = 1, V(c) = 0, V(d) = 0:
    # root tokens 3/4 - 3/4 = 0, a 1 - 3/4, b 1 - 1, c 0 - 1, d 0 - 3/4.
    want = [[0, 0, 0.25, 0, 0], [0, 0, 0.25, -1], [0, 0, -0.75, -0.75], [0, 0, 0.25]]
    for got, w in zip(tree.advantages, want):
        np.testing.assert_allclose(got, w, atol=1e-7)


def test_group_advantages_of_known_rewards():
    r = np.array(HAND["rewards"])
    std = np.sqrt((0.25**2 + 2 * 0.75**2 + 1.25**2) / 4)
    np.testing.assert_allclose(group_advantages(r, "grpo"),
                               np.array([0.25, -0.75, -0.75, 1.25]) / (std + 1e-6))
    np.testing.assert_allclose(group_advantages(r, "dr_grpo"), [0.25, -0.75, -0.75, 1.25])
    np.testing.assert_allclose(group_advantages(r, "rloo"), [1 - 2 / 3, -1, -1, 2 - 1 / 3])
    np.testing.assert_allclose(group_advantages(np.array([3.0]), "rloo"), [0.0])
    np.testing.assert_allclose(group_advantages(np.array([3.0, 3.0]), "grpo"), [0.0, 0.0])
    tree = with_advantages(TrajectoryTree.from_nodes(**HAND), "rloo")
    assert [float(a[0]) for a in tree.advantages] == pytest.approx([1 / 3, -1, -1, 5 / 3])
    assert all(np.all(a == a[0]) for a in tree.advantages)  # one advantage per path


def test_per_turn_rewards_add_up():
    tree = TrajectoryTree.from_sequences([[1, 2, 3], [1, 2, 4]], rewards=[[0.5, 0.25], 1.0])
    assert tree.rewards.tolist() == [0.75, 1.0]


def _write(tmp_path, lines) -> str:
    path = tmp_path / "g.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return str(path)


@pytest.mark.parametrize("lines, advantage, match", [
    ([{"group": 0, "tokens": [1, 2], "reward": 1.0}, {"group": 0, "tokens": [1, 3]}], "grpo",
     r"g\.jsonl:2: reward is missing"),
    ([{"group": 0, "tokens": [1, 2]}, {"group": 0, "tokens": [1, 3]}], "tree",
     r"g\.jsonl:1: no reward \(objective\.advantage=tree"),
    ([{"group": 0, "tokens": [1, 2], "reward": 1.0},
      {"group": 0, "tokens": [1, 3], "reward": float("nan")}], "rloo",
     r"g\.jsonl:2: reward = nan is not finite"),
    ([{"group": 0, "tokens": [1, 2], "reward": [1.0, float("inf")]}], "grpo",
     r"g\.jsonl:1: reward\[1\] = inf is not finite"),
    ([{"group": 0, "tokens": [1, 2], "reward": 1.0}], "given",
     r"g\.jsonl:1: no advantage \(objective\.advantage=given"),
])
def test_bad_reward_records_name_line_and_field(tmp_path, lines, advantage, match):
    with pytest.raises(ValueError, match=match):
        load_trees(_write(tmp_path, lines), "groups", vocab_size=None, advantage=advantage)


def test_bad_reward_in_a_tree_record_names_line_and_path(tmp_path):
    rec = {"parents": [-1, 0, 0], "segments": [[1], [2], [3]],
           "paths": [{"node": 1, "reward": 1.0}, {"node": 2, "reward": "high"}]}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    with pytest.raises(ValueError, match=r"t\.jsonl:1: path 1: reward: expected numbers"):
        load_trees(str(path), "trees", vocab_size=None, advantage="grpo")
    rec["paths"][1]["reward"] = 0.0
    path.write_text(json.dumps(rec) + "\n")
    (tree,), _ = load_trees(str(path), "trees", vocab_size=None, advantage="dr_grpo")
    assert [float(a[0]) for a in tree.advantages] == [0.5, -0.5]


# --------------------------------------------------------------- training with rewards only


def _reference_advantages(seqs: list[list[int]], rewards: np.ndarray, estimator: str):
    """Per-path, per-token advantages from the token sequences alone (no tree): a token's node
    is the set of paths sharing the sequence up to it; `tree` credits a token with the mean
    reward of that set minus the mean reward of the set before the set last changed."""
    if estimator != "tree":
        return [np.full(len(s), a) for s, a in zip(seqs, group_advantages(rewards, estimator))]
    out = []
    for s in seqs:
        sets = [frozenset(q for q, t in enumerate(seqs) if t[:k + 1] == s[:k + 1])
                for k in range(len(s))]
        adv, parent_value = [], float(np.mean(rewards))
        for k, members in enumerate(sets):
            if k > 0 and members != sets[k - 1]:
                parent_value = float(np.mean(rewards[list(sets[k - 1])]))
            adv.append(float(np.mean(rewards[list(members)])) - parent_value)
        out.append(np.array(adv))
    return out


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "tree"])
def test_training_on_rewards_equals_per_path_training(estimator):
    """Tree mode with rewards as the only RL input vs every path trained on its own with the
    advantages computed per path from the sequences (float32: loss and every gradient)."""
    rng = np.random.default_rng(7)
    graphdef, params = tiny_model(vocab_size=64)
    trees, singles = [], []
    for _ in range(2):
        kw = random_forest(rng, max_nodes=8, vocab=64, with_rl=False)
        shape = TrajectoryTree.from_nodes(**kw)
        seqs = [shape.path_tokens(p).tolist() for p in range(shape.n_paths)]
        rewards = rng.normal(size=len(seqs))
        trees.append(with_advantages(TrajectoryTree.from_sequences(
            seqs, loss_masks=kw["loss_masks"], weights=kw["weights"], rewards=rewards),
            estimator))
        ref = _reference_advantages(seqs, rewards, estimator)
        singles += [TrajectoryTree.from_sequences([s], loss_masks=[m], weights=[w],
                                                  advantages=[a])
                    for s, m, w, a in zip(seqs, kw["loss_masks"], kw["weights"], ref)]
    tree = linearize(trees, 64, n_rows=4)  # the shape of the baseline: one compile
    base = linearize(singles, 64, n_rows=4)
    tree_in, base_in = off_policy_ppo_inputs(params, graphdef, tree, base, seed=3)
    assert_loss_and_grads_match(graphdef, params, tree_in, base_in, Objective(kind="ppo"))


def test_a_run_config_computes_the_advantages_it_names():
    """`configs/tiny_rl.yaml` (objective.advantage: tree) gives the trained trees the `tree`
    estimator's advantages of the records' rewards; `sft` reads none."""
    cfg = load_config("configs/tiny_rl.yaml")
    trees, _ = load_training_trees(cfg)
    plain, _ = load_trees(cfg.data.path, "groups", vocab_size=None)
    assert len(trees) == len(plain) and plain[0].rewards is not None
    for got, t in zip(trees[:3], plain):
        want = tree_token_advantages(t, t.rewards)
        for p in range(t.n_paths):
            np.testing.assert_allclose(got.advantages[p], want[t.path_token_index(p)], atol=1e-7)
    sft = load_config("configs/tiny_rl.yaml", ["objective.kind=sft"]).objective
    assert sft.advantage_estimator is None
