"""Context-parallel rows on the host: the balanced split of a row over the `context` devices and
the gapped layout `linearize` writes from it (docs/design.md section 3; the CP convention)."""

import dataclasses

import numpy as np
import pytest

from jtree.config import DataConfig
from jtree.layout.context_rows import (
    ContextSplit,
    block_work,
    check_context,
    even_split,
    slice_work,
    split_row,
)
from jtree.layout.linearize import linearize, unlinearize
from jtree.layout.microbatches import unit_counts
from jtree.layout.planner import ROW_ALIGN, LayoutConfig, plan_rows, plan_step
from jtree.objectives.pairs import with_pairs
from jtree.training.step_builders import step_builder, step_indices
from jtree.trees.synthetic import AgentShape, agent_rollout_group
from jtree.trees.tree import TrajectoryTree
from tests.strategies import random_forest, seeded_forests

# Long agent trees (about 20-40k tokens: long prompt, many turns, rollouts branching at turns).
LONG = AgentShape(system_len=2000, task_len=500, turns=8, assistant_len=300, tool_len=400,
                  rollouts=12, branch_prob=0.6, think_len=200)


def _plan(units, context, seq_len, **layout):
    config = LayoutConfig(seq_len, context=context, **layout)
    return plan_step([u.n_tree_tokens for u in units], config,
                     **unit_counts(units, config.gdn_chunk_size, context))


@pytest.mark.parametrize("seed, context", [(0, 8), (1, 8), (2, 4), (3, 2)])
def test_split_balances_attention_blocks_on_long_agent_trees(seed, context):
    """max / mean attention blocks <= 1.1 over the devices, counted from the block tables of the
    row `linearize` lays out; pieces are contiguous DFS ranges at the start of each slice."""
    tree = agent_rollout_group(np.random.default_rng(seed), LONG)
    seq_len = context * ROW_ALIGN * -(-2 * tree.n_tree_tokens // (context * ROW_ALIGN))
    plan = _plan([tree], context, seq_len)
    assert plan.row_len % (context * ROW_ALIGN) == 0 and plan.context == context
    batch = linearize([tree], plan.row_len, plan=plan.placements[0], score_len=plan.score_len)
    end, valid = batch.inputs.mask.end[0], batch.inputs.valid[0]
    work = slice_work(end, valid, context, block=ROW_ALIGN)
    assert work.blocks.max() / work.blocks.mean() <= 1.1, work.blocks
    # Also what the kernels run: each gap query block keeps its own key block (`TreeMask.real`).
    assert work.kernel_blocks.max() / work.kernel_blocks.mean() <= 1.1, work.kernel_blocks
    # The split's own count is the block tables' count of the gapped row.
    split = plan.placements[0].splits[0]
    per_block = block_work(tree.token_arrays["end"], ROW_ALIGN)
    bounds = -(-np.asarray(split.bounds) // ROW_ALIGN)
    np.testing.assert_array_equal(
        work.blocks, [per_block[a:b].sum() for a, b in zip(bounds[:-1], bounds[1:])])
    # Contiguous, in DFS order: each slice holds a prefix of real tokens, the tree's in order.
    slice_len = plan.row_len // context
    for k, n in enumerate(split.piece_tokens):
        assert valid[k * slice_len:(k + 1) * slice_len].tolist() == [True] * n + [False] * (
            slice_len - n)
    np.testing.assert_array_equal(batch.inputs.tokens[0][valid], tree.token_arrays["tokens"])
    np.testing.assert_array_equal(work.tokens, split.piece_tokens)
    # The even token split of the same row is what the balanced one improves on.
    even = even_split(tree.n_tree_tokens, context, block=ROW_ALIGN)
    assert even.bounds[-1] == split.bounds[-1] == tree.n_tree_tokens


def _masks(batch):
    """The visibility matrix (query i sees key j) of every row's real tokens, in row order."""
    out = []
    for end, valid in zip(batch.inputs.mask.end, batch.inputs.valid):
        at = np.flatnonzero(valid)
        i, j = at[:, None], at[None, :]
        out.append((j <= i) & (i < end[at][None, :]))
    return out


@pytest.mark.parametrize("seed", range(3))
def test_gapped_row_holds_the_same_trees_and_indices(seed):
    """Cuts anywhere (inside nodes, at tree boundaries, empty pieces): the real tokens see the
    same keys, are scored by the same tokens, sit in the same GDN chunk chains (no chunk spans
    two slices), and map back to the same paths, critic pairs included."""
    rng = np.random.default_rng(seed)
    units = []
    for _ in range(3):
        kw = random_forest(rng, max_nodes=9, max_seg=12)
        units.append(TrajectoryTree.from_nodes(
            **kw, rewards=rng.normal(size=len(kw["path_nodes"])).tolist()))
    sizes = [u.n_tree_tokens for u in units]
    n, c = sum(sizes), 4
    cuts = np.sort(rng.integers(0, n + 1, c - 1))
    split = ContextSplit((0, *map(int, cuts), n))
    slice_len = 16 * -(-int(split.piece_tokens.max()) // 16)
    plan = plan_rows(sizes, c * slice_len, n_rows=1)
    kw = dict(gdn_chunk_size=3, gdn_chunks=c * slice_len, normalization="token_mean")
    flat = with_pairs(linearize(units, c * slice_len, plan=plan, **kw))
    gapped = with_pairs(linearize(
        units, c * slice_len, plan=dataclasses.replace(plan, splits=(split,)), **kw))
    at = np.flatnonzero(gapped.inputs.valid[0])
    np.testing.assert_array_equal(at, split.place(np.arange(n), slice_len))
    for a, b in zip(_masks(flat), _masks(gapped)):
        np.testing.assert_array_equal(a, b)
    g, f = gapped.inputs, flat.inputs
    to_gapped = np.full(c * slice_len + 1, -1)
    to_gapped[:n] = at
    np.testing.assert_array_equal(g.pred[0][at], to_gapped[f.pred[0][:n]])
    np.testing.assert_array_equal(g.score_index, np.where(f.score_index >= 0,
                                                          to_gapped[f.score_index], -1))
    np.testing.assert_array_equal(g.pairs.index, np.where(f.pairs.index >= 0,
                                                           to_gapped[f.pairs.index], -1))
    for name in ("tokens", "pos", "node", "path_count"):
        np.testing.assert_array_equal(getattr(g, name)[0][at], getattr(f, name)[0][:n])
    # Chunks: every real token in one chunk, no chunk across a slice boundary, and the chain
    # of entering states visits the same tokens before each token as the ungapped tables do.
    chunk_tokens = g.gdn.chunk_tokens[0]
    used = chunk_tokens[chunk_tokens >= 0]
    np.testing.assert_array_equal(np.sort(used), at)
    for row in chunk_tokens:
        real = row[row >= 0]
        assert len(set(real // slice_len)) <= 1
    assert _token_histories(g.gdn, at) == _token_histories(f.gdn, np.arange(n))
    # Back to paths.
    for a_paths, b_paths in zip(unlinearize(flat, f.tokens), unlinearize(gapped, g.tokens)):
        for a, b in zip(a_paths, b_paths):
            np.testing.assert_array_equal(a, b)


def _token_histories(tables, positions):
    """For every real token (by its index in `positions`): the tokens (same indexing) the gated
    delta rule's state has run through when it reaches the token (its path's earlier tokens)."""
    chunk_tokens, src = tables.chunk_tokens[0], tables.chunk_src[0]
    back = {int(p): i for i, p in enumerate(positions)}
    seen: dict[int, frozenset] = {0: frozenset()}  # buffer slot -> tokens its state has seen
    out = {}
    for ch, row in enumerate(chunk_tokens):
        real = [back[int(p)] for p in row if p >= 0]
        if not real:
            continue
        before = seen[int(src[ch])]
        for j, t in enumerate(real):
            out[t] = before | frozenset(real[:j])
        seen[ch + 1] = before | frozenset(real)
    return out


def test_context_errors_name_the_setting():
    tree = seeded_forests(1, seed=0, max_nodes=6, max_seg=30)[0]
    end = tree.token_arrays["end"]
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="context"):
            check_context(bad)
        with pytest.raises(ValueError, match="context"):
            LayoutConfig(1024, context=bad)
    with pytest.raises(ValueError, match="context=3: seq_len=1024"):
        LayoutConfig(1024, context=3)
    with pytest.raises(ValueError, match="context=2: a row of"):
        split_row(np.arange(1, 300), 2, block=64, max_slice=128)
    with pytest.raises(ValueError, match="ends: context=2"):
        plan_step([tree.n_tree_tokens], LayoutConfig(1024, context=2))
    with pytest.raises(ValueError, match="context=4: no row length"):
        plan_step([tree.n_tree_tokens], LayoutConfig(1024, context=4, row_lengths=(128, 320)),
                  ends=[end])


def test_planner_splits_every_row_of_a_step_to_one_shape():
    """Several shards, micro-batches and rows: every listed row has a split of `context`
    pieces whose largest fits row_len / context, and GDN tables fit the planned capacity."""
    units = seeded_forests(12, seed=4, max_nodes=10, max_seg=40)
    plan = _plan(units, 4, 1024, n_shards=2, micro_batches=2, gdn_chunk_size=8)
    slice_len = plan.row_len // 4
    for members, placement in zip(plan.units, plan.placements):
        assert len(placement.splits) == len(placement.rows)
        for split, row in zip(placement.splits, placement.rows):
            assert split.context == 4 and split.piece_tokens.max() <= slice_len
            assert split.bounds[-1] == sum(units[members[i]].n_tree_tokens for i in row)
        if members:
            linearize([units[i] for i in members], plan.row_len, plan=placement,
                      score_len=plan.score_len, gdn_chunk_size=8, gdn_chunks=plan.gdn_chunks)


def test_step_builder_lays_every_row_out_split_over_context():
    """The trainer's builder with `context`: rows fixed for the run, every step's rows c slices
    of one length, each slice's real tokens a prefix of it, GDN tables in gapped positions."""
    trees = [agent_rollout_group(np.random.default_rng(s), AgentShape(system_len=300, turns=3))
             for s in range(6)]
    data = DataConfig(seq_len=4096, trees_per_step=3, micro_batches=2, gdn_chunk_size=16)
    builder = step_builder(trees, data, "tree", normalization="token_mean", n_shards=1,
                           shards=(0,), steps=2, gdn_chunk_size=16, context=4)
    index = step_indices(len(trees), data.trees_per_step, data.shuffle_seed)
    for k in range(2):
        inputs = builder(index[k])["inputs"]
        _, rows, s = inputs.shape
        assert s % (4 * ROW_ALIGN) == 0 and builder.config.layout.context == 4
        valid = inputs.valid.reshape(-1, 4, s // 4)
        first_gap = valid.argmin(-1) + valid.all(-1) * (s // 4)
        assert (valid.sum(-1) == first_gap).all()  # real tokens fill each slice's start
        slot = inputs.gdn.token_slot.reshape(-1, 4, s // 4)
        assert ((slot >= 0) == valid).all()
