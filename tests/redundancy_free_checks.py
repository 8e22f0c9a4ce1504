"""Redundancy-free parts against the unpartitioned tree: a step of `RedundancyFreeStep` over
parts of trees (default `multi_part_trees(seed=7)`) at given capacities and prefix-backward modes
equals the tree-mode step on the whole trees (loss, metrics, gradients, log-probs; docs/design.md
section 9 tolerances), and the executor's schedule (post-order, children by need, buffers held
only on the running part's chain). Shared by tests/partitioning/test_redundancy_free.py and the
architectures' tests (tests/models/test_deepseek_v3.py, test_kimi_linear.py, test_nemotron_h.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
import pytest

from jtree.config.objective import Objective
from jtree.layout.linearize import linearize
from jtree.partitioning.redundancy_free.executor import RedundancyFreeStep
from jtree.partitioning.redundancy_free.layout import build_program
from jtree.partitioning.redundancy_free.schedule import LiveBuffers, child_order, part_slots
from jtree.step.batches import stack_microbatches
from jtree.step.train_step import make_grad_fn, make_logprob_fn
from jtree.trees.tree import TrajectoryTree
from tests.models_util import rel_l2
from tests.strategies import multi_part_trees

ROW, PREFIX = 16, [16]  # rows of 16 tokens, one prefix bucket

# The checks' objectives: PPO with a KL term (reference log-probs count) and SFT.
PPO = Objective(kind="ppo", normalization="token_mean", clip_low=0.1, clip_high=0.1,
                kl_coef=0.05)
SFT = Objective(kind="sft", normalization="seq_mean_token_mean")


def on_path_tokens(tree: TrajectoryTree) -> np.ndarray:
    """Tree tokens on at least one path (the ones training computes)."""
    return np.unique(np.concatenate([tree.path_token_index(p) for p in range(tree.n_paths)]))


def check_schedule(program, live: LiveBuffers, mode: str) -> None:
    """The executor ran parts in post-order, children in `child_order` (largest need first), and
    at every device call only the parts on the chain above the running part held buffers (in
    modes other than `residuals`, at most one part its residuals)."""
    parts = program.parts
    order = child_order(program)
    for k, kids in enumerate(order):
        assert sorted(kids) == sorted(parts[k].children)
        needs = [subtree_need(program, order, c) for c in kids]
        assert needs == sorted(needs, reverse=True)
    calls = [(name, k) for name, k, _, _ in live.events if k >= 0]
    ends = {"leaf", "backward", "forward_backward"}
    backward = {k: i for i, (name, k) in enumerate(calls) if name in ends}
    assert sorted(backward) == list(range(len(parts)))  # every part's backward, once
    assert sum(name in ends for name, _ in calls) == len(parts)
    for k, part in enumerate(parts):
        span = [i for i, (_, j) in enumerate(calls) if j == k]
        first = {c: min(i for i, (_, j) in enumerate(calls) if j == c) for c in part.children}
        for c in part.children:  # the child's whole subtree runs between k's calls
            assert span[0] < first[c] and backward[c] < backward[k]
        assert sorted(first, key=first.get) == list(order[k])
        for a, b in zip(order[k], order[k][1:]):  # subtree a finishes before b starts
            assert backward[a] < first[b]
    for name, k, held, nbytes in live.events:
        if k < 0:
            continue
        chain = {k}
        while parts[k].parent >= 0:
            k = parts[k].parent
            chain.add(k)
        assert {j for _, j in held} <= chain, (name, held, chain)
        assert 0 < nbytes <= live.peak_bytes
        if mode != "residuals":
            assert sum(kind == "residuals" for kind, _ in held) <= 1, (name, held)
    if mode == "auto":  # residuals kept exactly by the parts whose children are all leaves
        kept = {j for _, _, held, _ in live.events for kind, j in held if kind == "residuals"}
        assert kept == {k for k, p in enumerate(parts)
                        if p.children and not any(parts[c].children for c in p.children)}


def subtree_need(program, order, k: int) -> int:
    """need(k) of `jtree.partitioning.redundancy_free.schedule` for the given child order,
    recomputed recursively."""
    kids = order[k]
    slots = part_slots(program, k)
    return slots + max([subtree_need(program, order, c) + (slots if i else 0)
                        for i, c in enumerate(kids)], default=0)


def _reference(graphdef, params, trees, objective, chunk):
    """The unpartitioned trees in one tree-mode micro-batch of 64-token rows (no redundancy-free
    code): (loss, metrics, gradients, log-probs of each tree's tokens)."""
    full = linearize(trees, 64, normalization=objective.normalization, gdn_chunk_size=chunk,
                     gdn_chunks=64 if chunk else None)
    loss, metrics, grads = jax.jit(make_grad_fn(graphdef, objective))(
        params, stack_microbatches([full]))
    logp = np.asarray(jax.jit(make_logprob_fn(graphdef, temperature=objective.temperature))(
        params, full.inputs))
    per_tree = [logp[r, o : o + t.n_tree_tokens]
                for t, r, o in zip(full.layout.trees, full.layout.rows, full.layout.offsets)]
    return loss, metrics, grads, per_tree


def check_parts(graphdef, params, objective: Objective, capacities: Sequence[int],
                modes: Sequence[str], chunk: int | None = None,
                row_lengths: Sequence[int] | None = (8, ROW), paired: bool = False,
                trees: list[TrajectoryTree] | None = None,
                prefix_buckets: list[int] | None = PREFIX, seq_len: int = ROW) -> None:
    """The redundancy-free step (`RedundancyFreeStep`, each prefix-backward mode of `modes`) on
    `trees` (default `multi_part_trees(seed=7)`) cut into parts of at most each of `capacities`
    tokens equals the unpartitioned trees' step (`_reference`): loss, metrics and every gradient
    within 1e-5 relative, the log-probs of every on-path token within 1e-5; the executor keeps
    its schedule (`check_schedule`). Every mode runs at every capacity, or with `paired` mode k
    at capacity k mod len(capacities) only (each shape of rows compiles its own program: half
    the compiles of two capacities). `chunk`: GDN chunks of that many tokens."""
    trees = multi_part_trees(seed=7) if trees is None else trees
    loss_ref, metrics_ref, grads_ref, logp_ref = _reference(graphdef, params, trees, objective,
                                                            chunk)
    leaves_ref = jax.tree_util.tree_leaves(grads_ref)
    # One step per mode for all capacities: prefixes (and rows with `row_lengths=[ROW]`) keep
    # their shapes, compiled once.
    steps = {mode: RedundancyFreeStep(graphdef, objective, prefix_backward=mode) for mode in modes}
    for index, capacity in enumerate(capacities):
        program = build_program(trees, capacity, seq_len=seq_len, prefix_buckets=prefix_buckets,
                                row_lengths=row_lengths,
                                normalization=objective.normalization, gdn_chunk_size=chunk,
                                gdn_chunks=ROW if chunk else None,
                                gdn_exports=4 if chunk else None)
        for k, (mode, step) in enumerate(steps.items()):
            if paired and k % len(capacities) != index:
                continue
            loss, metrics, grads = step(params, program)
            assert float(loss) == pytest.approx(float(loss_ref), rel=1e-5, abs=1e-7), (capacity,
                                                                                      mode)
            assert metrics.keys() == metrics_ref.keys(), (metrics.keys(), metrics_ref.keys())
            for key, want in metrics_ref.items():  # clip fraction, KL, aux loss: ratios of sums
                assert float(metrics[key]) == pytest.approx(float(want), rel=1e-5, abs=1e-7), key
            leaves = jax.tree_util.tree_leaves(grads)
            assert len(leaves) == len(leaves_ref)
            for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), leaves_ref):
                assert rel_l2(a, b) <= 1e-5, (capacity, mode, jax.tree_util.keystr(path))
            check_schedule(program, step.live, mode)
        for got, want, tree in zip(step.logprobs(params, program), logp_ref, trees):
            on = on_path_tokens(tree)
            np.testing.assert_allclose(got[on], want[on], rtol=0, atol=1e-5)
