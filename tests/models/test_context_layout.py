"""A context-parallel row run on ONE device gives the loss and gradients of the same trees without
gaps (the CP convention's first test of a gapped layout), for dense, MoE and Qwen3-Next tiny
models, SFT and PPO. The cuts fall inside nodes, so gaps cut node segments: attention masks, the
scoring `pred`, the GDN chunk chains and the conv context all cross a gap. The default suite
runs the dense PPO case (the host-side test `tests/layout/test_context_rows.py` checks the chunk
chains and `pred` of a gapped row in every default run); MoE, Qwen3-Next and SFT are `slow`."""

import dataclasses
import functools

import numpy as np
import pytest

from jtree.config.objective import Objective
from jtree.kernels.attention.xla import DEFAULT_BLOCK
from jtree.kernels.block_tables import EMPTY, classify_blocks
from jtree.layout.context_rows import ContextSplit
from jtree.layout.linearize import linearize
from jtree.layout.planner import plan_rows
from jtree.trees.tree import TrajectoryTree
from tests.models_util import (
    assert_loss_and_grads_match,
    perturbed_moe_model,
    tiny_model,
    tiny_runtime,
)
from tests.strategies import random_forest

CONTEXT = 4
OBJECTIVES = {"sft": Objective(kind="sft"),
              "ppo": Objective(kind="ppo", clip_low=0.2, clip_high=0.28, kl_coef=0.05,
                               entropy_coef=0.01)}


@functools.lru_cache(maxsize=None)
def _batches(extra: int = 0):
    """(gapped, ungapped) batches of two random forests in one row of CONTEXT slices: the
    gapped row's pieces are cut at random tokens (inside nodes for these seeds); `extra` more
    positions per slice make longer gaps."""
    trees = [TrajectoryTree.from_nodes(**random_forest(np.random.default_rng(s), max_nodes=9,
                                                       max_seg=14)) for s in (1, 2)]
    sizes = [t.n_tree_tokens for t in trees]
    n = sum(sizes)
    cuts = np.sort(np.random.default_rng(0).choice(np.arange(1, n), CONTEXT - 1, replace=False))
    split = ContextSplit((0, *map(int, cuts), n))
    slice_len = 16 * -(-int(split.piece_tokens.max()) // 16) + extra
    plan = plan_rows(sizes, CONTEXT * slice_len)
    kw = dict(normalization="token_mean", gdn_chunk_size=3)
    gapped = linearize(trees, CONTEXT * slice_len, plan=dataclasses.replace(plan, splits=(split,)),
                       **kw)
    flat = linearize(trees, CONTEXT * slice_len, plan=plan,
                     gdn_chunks=gapped.inputs.gdn.chunk_src.shape[-1], **kw)
    starts = np.concatenate([t.node_offsets[:-1] + o
                             for t, o in zip(trees, plan.positions()[1])])
    assert not set(cuts.tolist()) <= set(starts.tolist())  # some gap cuts a node
    return gapped, flat


def _inputs(batch, seed):
    """PPO inputs: old / reference log-probs off any policy, the same on both layouts."""
    valid = batch.inputs.valid
    rng = np.random.default_rng(seed)
    old = np.zeros(valid.shape, np.float32)
    ref = np.zeros(valid.shape, np.float32)
    old[valid] = -rng.uniform(0.5, 5.0, valid.sum())
    ref[valid] = -rng.uniform(0.5, 5.0, valid.sum())
    return old, ref


@pytest.mark.parametrize("kind, objective", [
    ("dense", "ppo"),
    pytest.param("next", "sft", marks=pytest.mark.slow),
    pytest.param("dense", "sft", marks=pytest.mark.slow),
    pytest.param("moe", "sft", marks=pytest.mark.slow),
    pytest.param("moe", "ppo", marks=pytest.mark.slow),
    pytest.param("next", "ppo", marks=pytest.mark.slow),
])
def test_gapped_row_on_one_device_equals_the_ungapped_row(kind, objective):
    graphdef, params = tiny_model() if kind == "dense" else perturbed_moe_model(kind)
    gapped, flat = _batches()
    old, ref = _inputs(flat, seed=3)
    at = np.flatnonzero(gapped.inputs.valid[0])
    g_old, g_ref = np.zeros_like(old), np.zeros_like(ref)
    g_old[0, at], g_ref[0, at] = old[0, :len(at)], ref[0, :len(at)]
    assert_loss_and_grads_match(
        graphdef, params,
        gapped.inputs.with_coefficients(old_logprobs=g_old, ref_logprobs=g_ref),
        flat.inputs.with_coefficients(old_logprobs=old, ref_logprobs=ref), OBJECTIVES[objective])


@pytest.mark.parametrize("impl", ["cpu", pytest.param("xla", marks=pytest.mark.slow)])
def test_gap_query_blocks_skipped_by_the_kernel_keep_the_loss_and_gradients(impl):
    """Gaps of whole kernel blocks (64 tokens), inside the intervals of the nodes they cut: the
    kernel runs only their own key blocks (`TreeMask.real` from `valid`), and the loss and
    gradients still equal the ungapped row's."""
    gapped, flat = _batches(extra=2 * DEFAULT_BLOCK)
    end, valid = gapped.inputs.mask.end, gapped.inputs.valid
    gap_blocks = ~valid.reshape(1, -1, DEFAULT_BLOCK).any(-1)[0]
    plain = classify_blocks(end, DEFAULT_BLOCK, DEFAULT_BLOCK)[0]
    assert ((plain[gap_blocks] != EMPTY).sum(-1) > 1).any()  # a gap block sees ancestors
    graphdef, params = tiny_model(runtime=tiny_runtime(attention_impl=impl))
    assert_loss_and_grads_match(graphdef, params, gapped.inputs, flat.inputs, OBJECTIVES["sft"])
