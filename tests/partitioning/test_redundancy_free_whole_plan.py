"""The redundancy-free program's whole trees are planned by the batch planner like every step."""

import numpy as np

from jtree.layout.microbatches import unit_counts
from jtree.layout.planner import LayoutConfig, StepPlan, plan_step
from jtree.partitioning.redundancy_free.layout import build_program
from tests.strategies import multi_part_trees


def test_whole_trees_go_where_the_planner_puts_them():
    trees = multi_part_trees(seed=7)
    program = build_program(trees, 3, rows_per_microbatch=2, gdn_chunk_size=3)
    assert program.whole is not None and program.whole_trees == (2,)
    whole = [trees[i] for i in program.whole_trees]
    layout = LayoutConfig(3, micro_batches=None, rows=2, gdn_chunk_size=3)
    want = plan_step([t.n_tree_tokens for t in whole], layout, **unit_counts(whole, 3))
    plan = program.whole.plan
    assert isinstance(plan, StepPlan)
    assert (plan.units, plan.placements, plan.row_len, plan.rows, plan.score_len,
            plan.gdn_chunks) == (want.units, want.placements, want.row_len, want.rows,
                                 want.score_len, want.gdn_chunks)
    for batch, units, placement in zip(program.whole.batches, plan.units, plan.placements):
        assert [id(t) for t in batch.layout.trees] == [id(whole[i]) for i in units]
        rows, offsets = placement.positions()
        np.testing.assert_array_equal(batch.layout.rows, rows)
        np.testing.assert_array_equal(batch.layout.offsets, offsets)
        assert batch.shape == (plan.rows, plan.row_len)
        assert batch.inputs.score_index.shape[1] == plan.score_len
        assert batch.inputs.gdn.chunk_tokens.shape[1] == plan.gdn_chunks
