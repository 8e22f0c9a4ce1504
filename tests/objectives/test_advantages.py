"""Advantages from rewards: the documented values on hand-built trees, bad records, and training
with rewards as the only input equal to per-path training (docs/rl.md)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jtree.config import load_config
from jtree.config.objective import Objective
from jtree.layout.linearize import linearize
from jtree.objectives.advantages import (
    group_advantages,
    tree_token_advantages,
    turn_spans,
    with_advantages,
)
from jtree.training.run_data import load_training_trees
from jtree.training.tree_files import load_trees
from jtree.trees.tree import TrajectoryTree
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
    assert [r.tolist() for r in tree.turn_rewards] == [[0.5, 0.25], [1.0]]


# Prompt [1, 2] (untrained), then turns (runs of loss mask 1) split by a tool token 9: paths 0 and
# 1 take two turns, 2 and 3 one; token 3 (turn 1) is shared by paths 0, 1 and 3. Turn 1 rewards
# 1, 1, 0, 0 normalize to +-1; turn 2 (paths 0 and 1 only) 0, 2 to -1, +1 (docs/rl.md).
TURNS = dict(sequences=[[1, 2, 3, 4, 9, 5, 6], [1, 2, 3, 4, 9, 7], [1, 2, 8, 9], [1, 2, 3, 5]],
             loss_masks=[[0, 0, 1, 1, 0, 1, 1], [0, 0, 1, 1, 0, 1], [0, 0, 1, 0], [0, 0, 1, 1]],
             rewards=[[1.0, 0.0], [1.0, 2.0], 0.0, [0.0]])


@pytest.mark.parametrize("discount, want", [
    (0.5, [[0, 0, 0.5, 0.5, 0, -1, -1], [0, 0, 1.5, 1.5, 0, 1], [0, 0, -1, 0], [0, 0, -1, -1]]),
    (1.0, [[0, 0, 0, 0, 0, -1, -1], [0, 0, 2, 2, 0, 1], [0, 0, -1, 0], [0, 0, -1, -1]]),
])
def test_turn_advantages_of_a_hand_built_tree(discount, want):
    tree = with_advantages(TrajectoryTree.from_sequences(**TURNS), "turn", discount)
    for got, w in zip(tree.advantages, want):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5)  # std + 1e-6: 1 - 2e-6, not 1
    # The shared token 3 is credited per path: 0.5, 1.5 and -1 on paths 0, 1 and 3.
    assert len({float(tree.advantages[p][2]) for p in (0, 1, 3)}) == 3


def test_turn_spans_and_one_turn_paths_are_grpo():
    assert turn_spans(np.array([1, 1, 0, 1, 1, 0, 0, 1])) == [(1, 2), (3, 5), (7, 8)]
    assert turn_spans(np.array([1, 0, 0])) == []  # position 0 is never scored
    plain = TrajectoryTree.from_nodes(**HAND)  # every path one turn (the whole path trained)
    turn, grpo = with_advantages(plain, "turn"), with_advantages(plain, "grpo")
    for p, (a, b) in enumerate(zip(turn.advantages, grpo.advantages)):
        np.testing.assert_allclose(a[1:], b[1:], rtol=1e-6, err_msg=f"path {p}")


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
    ([{"group": 0, "tokens": [1, 2, 3], "loss_mask": [0, 1, 1], "reward": 1.0},
      {"group": 0, "tokens": [1, 2, 4, 5], "loss_mask": [0, 1, 0, 1], "reward": [1.0, -1.0, 2.0]}],
     "turn", r"g\.jsonl:2: reward: 3 per-turn reward\(s\) for 2 turn\(s\) \(runs of loss_mask 1 "
             r"at tokens: 1\.\.1, 3\.\.3"),
    ([{"group": 0, "tokens": [1, 2, 3], "loss_mask": [0, 1, 1], "reward": 1.0},
      {"group": 0, "tokens": [1, 2, 4], "loss_mask": [0, 1, 1], "reward": [float("-inf")]}],
     "turn", r"g\.jsonl:2: reward\[0\] = -inf is not finite"),
])
def test_bad_reward_records_name_line_and_field(tmp_path, lines, advantage, match):
    with pytest.raises(ValueError, match=match):
        load_trees(_write(tmp_path, lines), "groups", vocab_size=None, advantage=advantage)


def test_bad_reward_in_a_tree_record_names_line_and_path(tmp_path):
    rec = {"parents": [-1, 0, 0], "segments": [[1], [2], [3]],
           "paths": [{"node": 1, "reward": 1.0}, {"node": 2, "reward": "high"}]}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    with pytest.raises(ValueError, match=r"t\.jsonl:1: path 1: reward: expected a number or a "
                                         r"list of numbers"):
        load_trees(str(path), "trees", vocab_size=None, advantage="grpo")
    rec["paths"][1]["reward"] = 0.0
    path.write_text(json.dumps(rec) + "\n")
    (tree,), _ = load_trees(str(path), "trees", vocab_size=None, advantage="dr_grpo")
    assert [float(a[0]) for a in tree.advantages] == [0.5, -0.5]
    rec["paths"][1]["reward"] = [0.0, 1.0]  # two rewards, one turn (token 1)
    path.write_text(json.dumps(rec) + "\n")
    with pytest.raises(ValueError, match=r"t\.jsonl:1: path 1: reward: 2 per-turn reward\(s\) "
                                         r"for 1 turn\(s\)"):
        load_trees(str(path), "trees", vocab_size=None, advantage="turn")


# --------------------------------------------------------------- training with rewards only


def _reference_turn_advantages(masks: list[list[int]], turn_rewards: list[list[float]],
                               discount: float) -> list[np.ndarray]:
    """The `turn` estimator per path, token by token: a trained token (position 0 excepted)
    after an untrained one starts the next turn; each turn's reward is normalized over the
    paths that have that turn, and a turn's tokens get the discounted sum over it and later
    turns."""
    n_turns = max(len(r) for r in turn_rewards)
    norm = {}
    for k in range(n_turns):
        have = [p for p, r in enumerate(turn_rewards) if len(r) > k]
        values = np.array([turn_rewards[p][k] for p in have])
        for p, v in zip(have, values):
            norm[p, k] = (v - values.mean()) / (values.std() + 1e-6)
    out = []
    for p, mask in enumerate(masks):
        returns = [0.0] * (len(turn_rewards[p]) + 1)
        for k in reversed(range(len(turn_rewards[p]))):
            returns[k] = norm[p, k] + discount * returns[k + 1]
        adv, turn, inside = np.zeros(len(mask)), -1, False
        for i in range(1, len(mask)):
            if mask[i] and not inside:
                turn += 1
            inside = bool(mask[i])
            if inside:
                adv[i] = returns[turn]
        out.append(adv)
    return out


def _n_turns(mask: list[int]) -> int:
    return sum(1 for i in range(1, len(mask)) if mask[i] and not (i > 1 and mask[i - 1]))


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


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "tree", "turn"])
def test_training_on_rewards_equals_per_path_training(estimator):
    """Tree mode with rewards as the only RL input vs every path trained on its own with the
    advantages computed per path from the sequences (float32: loss and every gradient); `turn`
    with per-turn rewards on multi-turn paths (random loss masks: several turns per path, and
    shared tokens in different turns of different paths)."""
    rng = np.random.default_rng(7)
    graphdef, params = tiny_model(vocab_size=64)
    trees, singles = [], []
    for _ in range(2):
        kw = random_forest(rng, max_nodes=8, vocab=64, with_rl=False)
        shape = TrajectoryTree.from_nodes(**kw)
        seqs = [shape.path_tokens(p).tolist() for p in range(shape.n_paths)]
        if estimator == "turn":  # paths of 2+ tokens that train their last: 1+ turns each
            keep = [p for p, s in enumerate(seqs) if len(s) > 1]
            seqs = [seqs[p] for p in keep]
            kw["weights"] = [kw["weights"][p] for p in keep]
            kw["loss_masks"] = [kw["loss_masks"][p][:-1] + [1] for p in keep]
            rewards = [rng.normal(size=_n_turns(m)).tolist() for m in kw["loss_masks"]]
            ref = _reference_turn_advantages(kw["loss_masks"], rewards, 0.7)
        else:
            rewards = rng.normal(size=len(seqs))
            ref = _reference_advantages(seqs, rewards, estimator)
        trees.append(with_advantages(TrajectoryTree.from_sequences(
            seqs, loss_masks=kw["loss_masks"], weights=kw["weights"], rewards=rewards),
            estimator, *([0.7] if estimator == "turn" else [])))
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
