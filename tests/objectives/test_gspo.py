"""GSPO on trees: loss and gradients equal an independent float64 numpy per-path GSPO, on random
multi-level trees with paths ending at internal nodes; tree mode equals per-path training."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtree.config.objective import NORMALIZATIONS, Objective
from jtree.layout.baseline import linearize_baseline
from jtree.layout.linearize import linearize
from jtree.objectives.losses import gspo_loss
from jtree.partitioning.redundancy_free.executor import RedundancyFreeStep
from jtree.training.tree_files import load_trees
from jtree.trees.loss_masks import check_shared_masks
from jtree.trees.tree import TrajectoryTree
from tests.models_util import assert_loss_and_grads_match, off_policy_ppo_inputs, tiny_model
from tests.strategies import gspo_tree


def reference_gspo(trees, logp, normalization, clip_low, clip_high):
    """Per-path GSPO in float64 from the paths alone: (loss, d loss / d logp per tree token of each
    tree). s_p = exp(mean over the path's trained tokens of logp - old); the path's weight c_p is
    w_p / sum w (seq_mean_token_mean), w_p n_p / sum w (seq_mean_token_sum) or
    w_p n_p / sum w n (token_mean)."""
    paths = []
    for k, t in enumerate(trees):
        for p in range(t.n_paths):
            m = t.loss_masks[p].astype(np.float64).copy()
            m[0] = 0.0  # a sequence's first token has no context
            paths.append((k, t.path_token_index(p), m, float(t.weights[p]),
                          float(t.advantages[p][0]), t.old_logprobs[p].astype(np.float64)))
    w_sum = sum(w for _, _, _, w, _, _ in paths)
    wn_sum = sum(w * m.sum() for _, _, m, w, _, _ in paths)
    loss = 0.0
    grads = [np.zeros(t.n_tree_tokens) for t in trees]
    for k, idx, m, w, a, old in paths:
        n = m.sum()
        c = {"seq_mean_token_mean": w / w_sum, "seq_mean_token_sum": w * n / w_sum,
             "token_mean": w * n / wn_sum}[normalization] if n > 0 else 0.0
        mean = float(np.sum(m * (logp[k][idx] - old)) / max(n, 1.0))
        s = np.exp(mean)
        clipped = min(max(s, 1 - clip_low), 1 + clip_high)
        loss -= c * (min(s * a, clipped * a))
        unclipped = (s <= 1 + clip_high) if a >= 0 else (s >= 1 - clip_low)
        if unclipped and n > 0:
            np.add.at(grads[k], idx, -c * a * s * m / n)
    return loss, grads


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@pytest.mark.parametrize("seed", [0, 1])
def test_gspo_loss_equals_float64_per_path_reference(seed, normalization):
    rng = np.random.default_rng(seed)
    trees = [gspo_tree(rng, max_nodes=9, extra_paths=4) for _ in range(4)]
    assert max(int(t.node_levels.max()) for t in trees) >= 3
    assert any(set(t.parents.tolist()) & set(t.path_nodes.tolist()) for t in trees)  # internal ends
    batch = linearize(trees, 96, normalization=normalization)
    inputs = batch.inputs
    logp = (inputs.coefficients.old_logprobs
            + rng.normal(0, 0.3, inputs.shape).astype(np.float32)) * inputs.valid
    clip_low, clip_high = 0.05, 0.08

    def loss_fn(lp):
        return gspo_loss(lp, inputs.coefficients, jnp.asarray(inputs.mask.end),
                         clip_low=clip_low, clip_high=clip_high)[0]

    loss, grad = jax.value_and_grad(loss_fn)(jnp.asarray(logp))
    per_tree = [np.asarray(logp[r, o:o + t.n_tree_tokens], np.float64)
                for t, r, o in zip(trees, batch.layout.rows, batch.layout.offsets)]
    want_loss, want_grads = reference_gspo(trees, per_tree, normalization, clip_low, clip_high)
    got_grads = [np.asarray(grad[r, o:o + t.n_tree_tokens])
                 for t, r, o in zip(trees, batch.layout.rows, batch.layout.offsets)]
    scale = sum(float(np.abs(x).sum()) for x in (inputs.coefficients.seq_pos,
                                                   inputs.coefficients.seq_neg))
    assert abs(float(loss) - want_loss) <= 1e-5 * max(abs(want_loss), scale)
    flat_got, flat_want = np.concatenate(got_grads), np.concatenate(want_grads)
    assert np.linalg.norm(flat_got - flat_want) <= 1e-5 * np.linalg.norm(flat_want)
    assert np.any(flat_want == 0) and np.any(flat_want != 0)  # some paths clip, some do not


def test_gspo_tree_training_equals_per_path_training():
    """A tiny model: tree-mode GSPO loss and every parameter gradient equal the per-path
    baseline's (which packs each path as its own sequence)."""
    rng = np.random.default_rng(5)
    graphdef, params = tiny_model(vocab_size=64)
    trees = [gspo_tree(rng, max_nodes=8, vocab=64) for _ in range(2)]
    tree = linearize(trees, 64, n_rows=4)
    base = linearize_baseline(trees, 64, n_rows=4)
    tree_in, base_in = off_policy_ppo_inputs(params, graphdef, tree, base, seed=1)
    assert_loss_and_grads_match(graphdef, params, tree_in, base_in,
                                Objective(kind="gspo", clip_low=0.05, clip_high=0.08))


def test_paths_disagreeing_on_a_shared_mask_are_refused():
    tree = TrajectoryTree.from_sequences([[1, 2, 3], [1, 2, 4]],
                                         loss_masks=[[0, 1, 1], [0, 0, 1]])
    with pytest.raises(ValueError, match=r"path 1: loss_mask\[1\] = 0 differs from path 0's"):
        check_shared_masks(tree)


def test_gspo_refuses_records_with_mixed_masks_and_redundancy_free_mode(tmp_path):
    lines = ['{"group": 0, "tokens": [1, 2, 3], "loss_mask": [0, 1, 1], "advantage": 1}',
             '{"group": 0, "tokens": [1, 2, 4], "loss_mask": [0, 0, 1], "advantage": -1}']
    path = tmp_path / "g.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"g\.jsonl:2: loss_mask\[1\] = 0 differs from path 0"):
        load_trees(str(path), "groups", vocab_size=None, advantage="given", shared_masks=True)
    graphdef, _ = tiny_model()
    with pytest.raises(ValueError, match="objective.kind=gspo: not available with run.mode="
                                         "redundancy_free"):
        RedundancyFreeStep(graphdef, Objective(kind="gspo"))
