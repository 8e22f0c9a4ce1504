"""Micro-batches of one step laid out where the planner puts them, all with one normalizer.

`build_microbatches` plans `trees` (typically the parts of `jtree.partitioning.partition`, or whole trees of
a redundancy-free program) with `jtree.layout.planner.plan_step` and linearizes each micro-batch of the
plan: M equally shaped `TreeBatch`es of R rows with the normalizer of the whole step, which is
what `jtree.step.train_step.make_grad_fn` scans over (the summed micro-batch gradients equal the
full-batch gradient). The trainer's step builder (`jtree.training.step_builders.StepBuilder`) lays out the same
plans, with raw coefficients and per-row normalizer shares for many hosts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jtree.config.objective import Normalization
from jtree.layout.batch import DeviceBatch, stack
from jtree.layout.coefficients import batch_normalizer
from jtree.layout.flop_model import tree_work
from jtree.layout.gdn_tables import tree_chunks
from jtree.layout.linearize import TreeBatch, linearize, pad_score_index
from jtree.layout.planner import LayoutConfig, StepPlan, plan_step
from jtree.trees.tree import TrajectoryTree


@dataclasses.dataclass(frozen=True, eq=False)
class MicroBatches:
    """M equally shaped micro-batches of one step (all with the step's normalizer)."""

    batches: tuple[TreeBatch, ...]
    plan: StepPlan

    def inputs(self) -> DeviceBatch:
        """Step inputs: every array stacked to [M, rows, S]."""
        return stack([b.inputs for b in self.batches])


def build_microbatches(
    trees: Sequence[TrajectoryTree],
    seq_len: int,
    *,
    rows_per_microbatch: int,
    normalization: Normalization = "seq_mean_token_mean",
    normalizer: float | None = None,
    row_lengths: Sequence[int] | None = None,
    gdn_chunk_size: int | None = None,
) -> MicroBatches:
    """Pack `trees` (each at most `seq_len` tokens) into as many micro-batches of
    `rows_per_microbatch` rows as they fill (`LayoutConfig(micro_batches=None)`), rows of a length
    from `row_lengths` (default `seq_len`; the least padding). `normalizer` defaults to the batch
    normalizer over all `trees`; pass the value over the whole step when `trees` is one share of
    it. `gdn_chunk_size` adds the Gated DeltaNet chunk tables, with the plan's one chunk capacity
    for all micro-batches."""
    layout = LayoutConfig(seq_len, micro_batches=None, rows=rows_per_microbatch,
                          row_lengths=None if row_lengths is None else tuple(row_lengths),
                          gdn_chunk_size=gdn_chunk_size)
    plan = plan_step([t.n_tree_tokens for t in trees], layout, **unit_counts(trees, gdn_chunk_size))
    if normalizer is None:
        normalizer = batch_normalizer(trees, normalization)
    batches = tuple(
        linearize([trees[i] for i in units], plan.row_len, normalization=normalization,
                  normalizer=normalizer, plan=placement, score_len=plan.score_len,
                  gdn_chunk_size=gdn_chunk_size, gdn_chunks=plan.gdn_chunks)
        for units, placement in zip(plan.units, plan.placements))
    return MicroBatches(batches, plan)


def unit_counts(units: Sequence[TrajectoryTree], gdn_chunk_size: int | None, context: int = 1
                ) -> dict[str, list[Any] | None]:
    """What the planner needs of each unit besides its tree tokens: `scored` tokens (a loss
    coefficient, `jtree.layout.flop_model.tree_work`), with GDN tables `chunks` (`tree_chunks`) and with
    context parallelism (`context` > 1 devices per row) `ends`, the masks it splits rows by."""
    return {"scored": [tree_work([u])[0].scored for u in units],
            "chunks": None if gdn_chunk_size is None else
            [tree_chunks(u, gdn_chunk_size) for u in units],
            "ends": None if context == 1 else [u.token_arrays["end"] for u in units]}


def same_score_len(batches: Sequence[TreeBatch]) -> list[TreeBatch]:
    """The batches with `score_index` widened to the widest one (one step shape), for batches
    linearized one by one rather than from one step plan."""
    width = max(b.inputs.score_index.shape[1] for b in batches)
    return [dataclasses.replace(b, inputs=dataclasses.replace(
                b.inputs, score_index=pad_score_index(b.inputs.score_index, width)))
            for b in batches]
