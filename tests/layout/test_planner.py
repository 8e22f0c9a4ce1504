"""The batch planner: its placement is what the batches get, its shapes hold every row, and the
trainer and the benchmark build their batches through the same function."""

import dataclasses
import itertools

import jax
import numpy as np
import pytest

from jtree.config import DataConfig
from jtree.layout.bin_packing import first_fit_decreasing
from jtree.layout.flop_model import tree_work
from jtree.layout.gdn_tables import tree_chunks
from jtree.layout.linearize import linearize
from jtree.layout.microbatches import unit_counts
from jtree.layout.planner import (
    LayoutConfig,
    plan_step,
    row_length_ladder,
    rows_to_hold,
    score_width,
)
from jtree.training.step_builders import (
    StepBuilder,
    StepConfig,
    all_units,
    step_builder,
    step_indices,
)
from jtree.trees.chat import ByteTokenizer, conversation_tree
from jtree.trees.synthetic import chat_record, por_forest
from tests.strategies import seeded_forests


def _layouts(seq_len):
    ladder = row_length_ladder(seq_len, 8)
    return [LayoutConfig(seq_len), LayoutConfig(seq_len, 2, 3, rows=6),
            LayoutConfig(seq_len, 3, 2, row_lengths=ladder),
            LayoutConfig(seq_len, 2, 2, rows=8, row_lengths=ladder, gdn_chunk_size=3),
            LayoutConfig(seq_len, micro_batches=None, rows=2, row_lengths=ladder)]


@pytest.mark.parametrize("k", range(5))
def test_linearize_lays_units_out_exactly_where_the_plan_says(k):
    """For every bin of every layout: linearize's rows and offsets are the plan's, its shape is
    the plan's, its score width and chunk capacity are the plan's and hold every row."""
    units = seeded_forests(14, seed=k, max_nodes=12, max_seg=6)
    layout = _layouts(64)[k]
    plan = plan_step([u.n_tree_tokens for u in units], layout,
                     **unit_counts(units, layout.gdn_chunk_size))
    assert sorted(i for b in plan.units for i in b) == list(range(len(units)))
    assert len(plan.placements) == plan.n_shards * plan.micro_batches
    for members, placement in zip(plan.units, plan.placements):
        assert (placement.row_len, placement.n_rows) == (plan.row_len, plan.rows)
        if not members:
            continue
        batch = linearize([units[i] for i in members], plan.row_len, plan=placement,
                          score_len=plan.score_len, gdn_chunk_size=layout.gdn_chunk_size,
                          gdn_chunks=plan.gdn_chunks)
        rows, offsets = placement.positions()
        np.testing.assert_array_equal(batch.layout.rows, rows)
        np.testing.assert_array_equal(batch.layout.offsets, offsets)
        assert batch.shape == (plan.rows, plan.row_len)
        inputs, c = batch.inputs, batch.inputs.coefficients
        scored = ((c.weight != 0) | (c.adv_pos != 0) | (c.adv_neg != 0)).sum(axis=1)
        assert inputs.score_index.shape[1] == plan.score_len >= scored.max()
        if layout.gdn_chunk_size is not None:
            used = (inputs.gdn.chunk_tokens >= 0).any(axis=-1).sum(axis=-1)
            assert inputs.gdn.chunk_tokens.shape[1] == plan.gdn_chunks >= used.max()
        for r, row in enumerate(placement.rows):  # units fill their row from position 0
            valid = inputs.valid[r]
            assert sum(units[members[i]].n_tree_tokens for i in row) == int(valid.sum())
            assert valid[: int(valid.sum())].all()


def test_a_plan_that_does_not_match_the_trees_is_rejected():
    units = seeded_forests(3, seed=1)
    plan = plan_step([u.n_tree_tokens for u in units], LayoutConfig(64)).placements[0]
    with pytest.raises(ValueError, match="plan: places units of"):
        linearize(units[:2], 64, plan=plan)


def test_row_length_is_the_one_computing_fewest_positions():
    """Brute force over the ladder: with rows free, the fewest bins x rows x length (ties to
    longer rows); with rows fixed, the shortest length whose packing fits them."""
    rng = np.random.default_rng(3)
    ladder = row_length_ladder(1024, 8)
    for _ in range(25):
        sizes = rng.integers(1, 700, size=int(rng.integers(1, 30))).tolist()
        for rows in (None, 6):
            layout = LayoutConfig(1024, 1, 2, rows=rows, row_lengths=ladder)
            try:
                plan = plan_step(sizes, layout)
            except ValueError:
                assert rows is not None  # no length fits the fixed rows
                continue
            bins = [[sizes[i] for i in b] for b in plan.units]
            best = None
            for length in ladder:
                if length < max(sizes):
                    continue
                need = max(len(first_fit_decreasing(b, length)) for b in bins)
                if rows is not None and need > rows:
                    continue
                key = (len(bins) * (rows or need) * length, -length)
                best = key if best is None or key < best else best
            assert (plan.n_rows * plan.row_len, -plan.row_len) == best


def test_dealt_rows_are_the_one_packing_in_order():
    """`micro_batches=None`: the rows of one packing, `rows` per micro-batch, none re-packed."""
    sizes = [30, 20, 50, 10, 40, 60, 5, 25]
    plan = plan_step(sizes, LayoutConfig(64, micro_batches=None, rows=2))
    whole = first_fit_decreasing(sizes, 64)
    dealt = [[members[i] for i in row] for members, p in zip(plan.units, plan.placements)
             for row in p.rows]
    assert dealt == whole
    assert plan.micro_batches == -(-len(whole) // 2) and plan.rows == 2


def test_score_width_is_bounded_to_a_ladder():
    widths = {score_width(n, 4096) for n in range(4097)}
    assert len(widths) <= 21  # a handful per octave, not one per multiple of 64
    for n in range(1, 4097):
        w = score_width(n, 4096)
        assert n <= w < n + max(64, n / 4)  # a quarter of the slots at most, or one step of 64
    assert score_width(5, 8) == 8  # never wider than the row


def test_rows_to_hold_is_the_most_any_step_needs_at_seq_len():
    steps = [[30, 30, 30], [60, 10], [64, 64, 64, 64, 1]]
    assert rows_to_hold(steps, LayoutConfig(64, micro_batches=2)) == 3
    assert rows_to_hold(steps, LayoutConfig(64)) == 5


def test_step_builder_inputs_are_its_plan():
    """The trainer's builder: each micro-batch of each shard holds the units of its bin, at the
    plan's rows and offsets, in the plan's shape."""
    trees = seeded_forests(10, seed=5, max_nodes=10)
    layout = LayoutConfig(64, 2, 2, rows=5, row_lengths=row_length_ladder(64, 4),
                          gdn_chunk_size=4)
    config = StepConfig("tree", "token_mean", 10, (0, 1), layout)
    builder = StepBuilder(trees, all_units(trees, "tree", 64), config)
    indices = step_indices(len(trees), 10, seed=0)[0]
    plan = builder.plan(indices)
    inputs = builder(indices)["inputs"]
    assert inputs.tokens.shape == (2, 2 * plan.rows, plan.row_len)
    assert inputs.score_index.shape[-1] == plan.score_len
    assert inputs.gdn.chunk_tokens.shape[2] == plan.gdn_chunks
    units = [u for i in indices for u in builder.units[int(i)]]
    for s, m in itertools.product(range(2), range(2)):
        b = plan.bin(s, m)
        tokens = inputs.tokens[m, s * plan.rows : (s + 1) * plan.rows]
        rows, offsets = plan.placements[b].positions()
        for i, r, o in zip(plan.units[b], rows, offsets):
            u = units[i]
            np.testing.assert_array_equal(tokens[r, o : o + u.n_tree_tokens],
                                          u.token_arrays["tokens"])


def test_unit_counts_are_what_the_planner_reads():
    trees = seeded_forests(4, seed=2)
    counts = unit_counts(trees, 3)
    assert counts["scored"] == [tree_work([t])[0].scored for t in trees]
    assert counts["chunks"] == [tree_chunks(t, 3) for t in trees]
    assert unit_counts(trees, None)["chunks"] is None


def test_bench_and_trainer_build_batches_with_the_same_function():
    """`make bench` times the trainer's batches: `prepare` goes through `jtree.training.step_builders.step_builder`,
    the function the trainer builds its steps with (`jtree.training.run_data`), and gets exactly its
    inputs."""
    from jtree.launch.bench import workloads as bench
    from jtree.training import run_data

    assert bench.step_builder is step_builder and run_data.step_builder is step_builder
    trees = por_forest(np.random.default_rng(1), 2000, 0.5, path_len=100, max_tree_tokens=512,
                       vocab_size=64)
    for mode in ("tree", "baseline"):
        prepared = bench.prepare(trees, mode, 512)
        data = DataConfig(seq_len=512, trees_per_step=len(trees),
                          row_steps_per_octave=bench.ROW_STEPS_PER_OCTAVE)
        builder = step_builder(trees, data, mode, normalization="seq_mean_token_mean",
                               n_shards=1, shards=(0,), steps=1)
        want = builder(step_indices(len(trees), len(trees), 0)[0])["inputs"]
        got, expected = (jax.tree_util.tree_flatten_with_path(x)[0]
                         for x in (prepared.inputs, want))
        assert [path for path, _ in got] == [path for path, _ in expected]
        for (_, value), (_, wanted) in zip(got, expected):
            np.testing.assert_array_equal(np.asarray(value), wanted)
        assert prepared.plan.row_len in row_length_ladder(512, bench.ROW_STEPS_PER_OCTAVE)


@pytest.mark.parametrize("mode", ["tree", "baseline"])
def test_a_run_on_chat_data_has_one_step_shape(mode):
    """Chat conversations of different lengths and numbers of assistant turns give steps that
    differ in scored tokens per row and in tree tokens; the trainer's builder fixes rows, score
    width and GDN capacity for the whole run, so every step has one shape (one compile) while a
    plan made step by step would need several score widths."""
    rng = np.random.default_rng(3)
    tok = ByteTokenizer()
    trees = [conversation_tree(chat_record(rng, system_words=int(rng.integers(5, 40)),
                                           turns=int(rng.integers(1, 5)), user_words=8,
                                           assistant_words=int(rng.integers(5, 30)),
                                           tool_words=10, reasoning_words=10), tok)
             for _ in range(24)]
    data = DataConfig(seq_len=2048, trees_per_step=3, micro_batches=2, gdn_chunk_size=16)
    builder = step_builder(trees, data, mode, normalization="token_mean", n_shards=2,
                           shards=(0, 1), steps=8, gdn_chunk_size=16)
    index = step_indices(len(trees), data.trees_per_step, data.shuffle_seed)
    per_step = dataclasses.replace(builder.config.layout, score_len=None, gdn_chunks=None)
    widths, shapes = set(), set()
    for k in range(8):
        inputs = builder(index[k])["inputs"]
        shapes.add(tuple((jax.tree_util.keystr(path), leaf.shape) for path, leaf in
                         jax.tree_util.tree_flatten_with_path(inputs)[0]))
        ids = [int(i) for i in index[k]]
        units = [u for i in ids for u in builder.units[i]]
        widths.add(plan_step([u.n_tree_tokens for u in units], per_step,
                             **unit_counts(units, 16)).score_len)
    assert len(shapes) == 1
    assert len(widths) > 1  # the data does vary: planned step by step it would compile more
