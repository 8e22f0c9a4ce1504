"""Zero-gradient pruning (`jtree.layout.pruning`, `StepBuilder(pruned=...)`): the pruned step's
loss and gradients equal the unpruned step's (the oracle: the same builder without pruning, which
runs none of the pruning code), nothing is pruned when a term reads every trained token, and the
saved tokens match a hand count."""

import jax
import numpy as np
import pytest

from jtree.config.objective import CriticConfig, Objective
from jtree.layout.planner import LayoutConfig
from jtree.layout.pruning import prune_trees, pruning_blocker
from jtree.step.train_step import make_grad_fn
from jtree.training.report import summary
from jtree.training.step_builders import StepBuilder, StepConfig, all_units, rows_for_run
from jtree.trees.tree import TrajectoryTree
from tests.models_util import assert_grads_close, tiny_model
from tests.strategies import consistent_tree


def _hand_tree() -> TrajectoryTree:
    """root [1,2,3] -> a [4,5] -> (b [9], c [10,11]); root -> d [6,7,8]. Paths: b (0), c (1.5),
    d (0), a (internal end, 0), c again (0: a zero duplicate of a kept path), d again (advantage
    only on its unscored first token: zero on every scored one). Kept: c -> nodes root, a, c
    (7 tokens) of 11; saved: b and d, 4 tokens."""
    adv_d = np.zeros(6)
    adv_d[0] = 3.0
    return TrajectoryTree.from_nodes(
        [-1, 0, 1, 1, 0], [[1, 2, 3], [4, 5], [9], [10, 11], [6, 7, 8]],
        path_nodes=[2, 3, 4, 1, 3, 4], advantages=[0.0, 1.5, 0.0, 0.0, 0.0, adv_d],
        loss_masks=[[0, 1, 1, 1, 1, 1], [1] * 7, [1] * 6, [1] * 5, [1] * 7, [1] * 6])


def _subtree_paths(tree: TrajectoryTree, top: int) -> set[int]:
    """The paths ending at `top` or below it."""
    def under(node: int) -> bool:
        while node >= 0 and node != top:
            node = int(tree.parents[node])
        return node == top
    return {p for p, n in enumerate(tree.path_nodes) if under(int(n))}


def _forest(seed: int) -> list[TrajectoryTree]:
    """Branching trees with consistent old log-probs and loss masks (GSPO needs one trained bit
    per tree token): one entirely zero, one with a zero subtree, one with every other path zero
    (zero paths sharing prefixes with kept ones, duplicates), one untouched, and `_hand_tree`."""
    rng = np.random.default_rng(seed)
    trees = []
    while len(trees) < 4:
        t = consistent_tree(rng, max_nodes=10, max_seg=3, roots=1, extra_paths=3)
        if t.n_paths >= 3 and t.n_nodes >= 4:
            mask = (rng.random(t.n_tree_tokens) < 0.8).astype(np.float32)
            masks = [mask[t.path_token_index(p)] for p in range(t.n_paths)]
            trees.append(TrajectoryTree.from_nodes(
                t.parents.tolist(), list(t.segments), path_nodes=t.path_nodes.tolist(),
                loss_masks=masks, advantages=list(t.advantages),
                old_logprobs=list(t.old_logprobs), weights=t.weights))
    children = [n for n in range(trees[1].n_nodes) if trees[1].parents[n] == 0]
    zero = [set(range(trees[0].n_paths)), _subtree_paths(trees[1], children[0]),
            set(range(0, trees[2].n_paths, 2)), set()]
    trees = [t.with_advantages([0.0 if p in z else a for p, a in enumerate(t.advantages)])
             for t, z in zip(trees, zero)]
    hand = _hand_tree()
    per_path = [np.full(n, -4.0) for n in hand.path_lengths]
    hand = TrajectoryTree.from_nodes(
        hand.parents.tolist(), list(hand.segments), path_nodes=hand.path_nodes.tolist(),
        loss_masks=list(hand.loss_masks), advantages=list(hand.advantages), old_logprobs=per_path)
    return trees + [hand]


def _builder(trees, mode, normalization, seq_len, shards=(0, 1), pruned=None):
    units = all_units(trees if pruned is None else [p.tree for p in pruned], mode, seq_len)
    rows = rows_for_run(units, seq_len, len(trees), 4, seed=0, steps=1)
    config = StepConfig(mode, normalization, len(trees), shards,
                        LayoutConfig(seq_len, 2, 2, rows))
    return StepBuilder(trees, units, config, pruned=pruned)


@pytest.mark.parametrize("mode, normalization, kind, seq_len", [
    ("tree", "seq_mean_token_mean", "ppo", 64),
    ("tree", "token_mean", "gspo", 64),
    ("tree", "token_mean", "ppo", 8),  # trees cut into capacity parts
    ("baseline", "seq_mean_token_sum", "ppo", 64),
])
def test_pruned_step_has_the_unpruned_loss_and_gradients(mode, normalization, kind, seq_len):
    trees = _forest(seed=3)
    objective = Objective(kind=kind, normalization=normalization)
    pruned = prune_trees(trees, objective)
    assert pruned[0].tree is None  # (tree 3 may lose a path that trains no token)
    assert all(p.saved_tokens > 0 for p in pruned[1:3])
    step = np.arange(len(trees))
    got = _builder(trees, mode, normalization, seq_len, pruned=pruned)(step)
    want = _builder(trees, mode, normalization, seq_len)(step)
    assert got["info"]["n_computed_tokens"] < want["info"]["n_computed_tokens"]
    graphdef, params = tiny_model(seed=2)
    grad_fn = jax.jit(make_grad_fn(graphdef, objective))
    loss_p, _, g_p = grad_fn(params, got["inputs"])
    loss_u, _, g_u = grad_fn(params, want["inputs"])
    assert float(loss_u) != 0.0
    assert float(loss_p) == pytest.approx(float(loss_u), rel=1e-5, abs=1e-7)
    assert_grads_close(g_p, g_u, tol=1e-5)


def test_hosts_split_the_unpruned_normalizer_and_an_all_zero_step_trains_nothing():
    trees = _forest(seed=4)
    objective = Objective(kind="ppo", normalization="token_mean")
    pruned = prune_trees(trees, objective)
    step = np.arange(len(trees))
    want = _builder(trees, "tree", "token_mean", 64)(step)["inputs"].row_norm.sum()
    got = sum(_builder(trees, "tree", "token_mean", 64, shards=(s,), pruned=pruned)(step)
              ["inputs"].row_norm.sum() for s in (0, 1))
    assert got == pytest.approx(want, rel=1e-6)
    # A step of one tree pruned away entirely: a zero-coefficient stand-in, zero loss.
    element = _builder(trees[:1], "tree", "token_mean", 64, pruned=pruned[:1])(np.arange(1))
    assert element["info"]["n_pruned_tokens"] == trees[0].n_tree_tokens
    graphdef, params = tiny_model(seed=2)
    loss, _, grads = jax.jit(make_grad_fn(graphdef, objective))(params, element["inputs"])
    assert float(loss) == 0.0
    assert all(not np.any(np.asarray(g)) for g in jax.tree_util.tree_leaves(grads))


@pytest.mark.parametrize("objective, router_aux", [
    (Objective(kind="sft"), False),
    (Objective(kind="ppo", kl_coef=0.1), False),
    (Objective(kind="ppo", entropy_coef=0.01), False),
    (Objective(kind="ppo", critic=CriticConfig()), False),
    (Objective(kind="gspo"), True),
])
def test_nothing_is_pruned_when_a_term_reads_every_trained_token(objective, router_aux):
    trees = _forest(seed=5)
    assert pruning_blocker(objective, router_aux) is not None
    pruned = prune_trees(trees, objective, router_aux)
    assert [p.tree for p in pruned] == trees
    assert [p.saved_tokens for p in pruned] == [0] * len(trees)


def test_saved_tokens_match_a_hand_count():
    hand = _hand_tree()
    (p,) = prune_trees([hand], Objective(kind="ppo"))
    assert (hand.n_tree_tokens, p.saved_tokens, p.tree.n_tree_tokens) == (11, 4, 7)
    assert p.tree.owned_paths.tolist() == [1]
    assert p.tree.source_nodes.tolist() == [0, 1, 3]
    assert p.normalizer == 6.0  # seq_mean_token_mean: one per path, dropped ones included
    zero = TrajectoryTree.from_sequences([[1, 2, 3], [1, 2, 4]], advantages=[0.0, 0.0])
    trees = [hand, zero]
    pruned = prune_trees(trees, Objective(kind="ppo"))
    info = _builder(trees, "tree", "seq_mean_token_mean", 64, pruned=pruned)(np.arange(2))["info"]
    assert info["n_pruned_tokens"] == 4 + 4
    assert info["n_computed_tokens"] == 7


def test_summary_reports_the_pruned_tokens():
    record = dict(step=1, loss=0.5, tokens_per_s=1.0, device_s=1.0, host_s=0.1, compiles=0,
                  compile_s=0.0, n_tree_tokens=100)
    history = [dict(record, n_pruned_tokens=30), dict(record, step=2, n_pruned_tokens=10)]
    assert "; pruned 40 zero-gradient tree tokens of 200 (20.0%, mean 20 per step)" in summary(
        history, 1.0, 0, None)
    assert "pruned" not in summary([dict(record, n_pruned_tokens=0)], 1.0, 0, None)
