"""Forest packing: many trees or parts into fixed-shape micro-batches for one jitted step.

`plan_rows` packs items (tree token counts) into rows first-fit decreasing and picks the row length
from a small set of buckets, so a step compiles for a bounded number of shapes, and reports the
padding it costs. `build_microbatches` turns trees (typically the parts of `jtree.partition`) into M
equally shaped `TreeBatch`es of R rows, all with the normalizer of the whole step, which is what
`jtree.train_step.make_grad_fn` scans over: the summed micro-batch gradients equal the full-batch
gradient.

The rows of a micro-batch are whole rows of the global first-fit-decreasing plan, taken in order.
`linearize` re-packs each micro-batch's trees with the same first-fit decreasing rule, which puts
them back into exactly those rows (each item meets the same rows in the same state), so the plan's
padding report is what the step gets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jtree.batch import DeviceBatch, stack
from jtree.chunk_tables import default_chunk_count
from jtree.linearize import TreeBatch, linearize, pack_rows, pad_score_index
from jtree.loss import Normalization, batch_normalizer
from jtree.tree import TrajectoryTree


@dataclasses.dataclass(frozen=True)
class RowPlan:
    """Items per row, the chosen row length and the padding it leaves."""

    rows: tuple[tuple[int, ...], ...]
    row_len: int
    n_rows: int
    used_tokens: int

    @property
    def padding_tokens(self) -> int:
        return self.n_rows * self.row_len - self.used_tokens

    @property
    def padding_fraction(self) -> float:
        return self.padding_tokens / (self.n_rows * self.row_len)

    def as_dict(self) -> dict[str, float | int]:
        return {"rows": self.n_rows, "row_len": self.row_len, "used_tokens": self.used_tokens,
                "padding_tokens": self.padding_tokens, "padding_fraction": self.padding_fraction}


def plan_rows(
    sizes: Sequence[int],
    max_len: int,
    *,
    len_buckets: Sequence[int] | None = None,
    rows_multiple: int = 1,
) -> RowPlan:
    """First-fit-decreasing rows of at most `max_len` tokens, row length from `len_buckets`.

    The row length is the smallest bucket (default: `max_len` only) that holds the fullest row; the
    row count is rounded up to a multiple of `rows_multiple` (e.g. rows per micro-batch), the extra
    rows being padding.
    """
    sizes = [int(s) for s in sizes]
    if not sizes:
        raise ValueError("sizes: need at least one item")
    for i, s in enumerate(sizes):
        if s < 1 or s > max_len:
            raise ValueError(f"item {i}: has {s} tokens, outside [1, max_len={max_len}]; "
                             "partition larger trees first (jtree.partition)")
    if rows_multiple < 1:
        raise ValueError(f"rows_multiple: must be >= 1, got {rows_multiple}")
    rows = pack_rows(sizes, max_len)
    fullest = max(sum(sizes[i] for i in r) for r in rows)
    buckets = sorted(int(b) for b in (len_buckets or [max_len]) if fullest <= b <= max_len)
    if not buckets:
        raise ValueError(f"len_buckets: none between the fullest row ({fullest}) and "
                         f"max_len={max_len}")
    n_rows = -(-len(rows) // rows_multiple) * rows_multiple
    return RowPlan(tuple(tuple(r) for r in rows), buckets[0], n_rows, sum(sizes))


def least_padding_plan(sizes: Sequence[int], max_len: int, len_buckets: Sequence[int], *,
                       rows_multiple: int = 1) -> RowPlan:
    """The row length among `len_buckets` (those holding the largest item, at most `max_len`)
    whose first-fit-decreasing packing computes the fewest padded positions (rows x length).

    `plan_rows` packs at `max_len` and then shrinks the length to fit; this instead packs at every
    bucket length, which cuts padding when items are a large fraction of a row: three trees of
    0.4 S need two rows of S (40% padding) but exactly three rows of 0.4 S. Ties go to the longer
    rows (fewer, larger matmuls).
    """
    largest = max(int(s) for s in sizes)
    candidates = sorted({int(b) for b in len_buckets if largest <= b <= max_len})
    if not candidates:
        raise ValueError(f"len_buckets: none between the largest item ({largest}) and "
                         f"max_len={max_len}")
    total = sum(int(s) for s in sizes)

    def lower_bound(b: int) -> int:  # positions of the fewest rows of length b that could hold all
        return -(-(-(-total // b)) // rows_multiple) * rows_multiple * b

    best = None
    for b in sorted(candidates, key=lambda b: (lower_bound(b), -b)):
        if best is not None and lower_bound(b) > best.n_rows * best.row_len:
            break  # no remaining length can beat the best plan
        plan = plan_rows(sizes, b, rows_multiple=rows_multiple)
        if best is None or (plan.n_rows * plan.row_len, -plan.row_len) < \
                (best.n_rows * best.row_len, -best.row_len):
            best = plan
    return best


@dataclasses.dataclass(frozen=True, eq=False)
class MicroBatches:
    """M equally shaped micro-batches of one step (all with the step's normalizer)."""

    batches: tuple[TreeBatch, ...]
    plan: RowPlan

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
    len_buckets: Sequence[int] | None = None,
    gdn_chunk_size: int | None = None,
) -> MicroBatches:
    """Pack `trees` (each at most `seq_len` tokens) into micro-batches of `rows_per_microbatch`
    rows. `normalizer` defaults to the batch normalizer over all `trees`; pass the value over the
    whole step when `trees` is one device's share. `gdn_chunk_size` adds the Gated DeltaNet chunk
    tables, with one chunk capacity for all micro-batches."""
    if rows_per_microbatch < 1:
        raise ValueError(f"rows_per_microbatch: must be >= 1, got {rows_per_microbatch}")
    plan = plan_rows([t.n_tree_tokens for t in trees], seq_len, len_buckets=len_buckets,
                     rows_multiple=rows_per_microbatch)
    if normalizer is None:
        normalizer = batch_normalizer(trees, normalization)
    gdn_chunks = None
    if gdn_chunk_size is not None:
        per_row = [sum(int(np.sum(-(-np.diff(trees[i].node_offsets) // gdn_chunk_size)))
                       for i in row) for row in plan.rows]
        gdn_chunks = default_chunk_count(plan.row_len, gdn_chunk_size, max(per_row))
    batches = []
    for start in range(0, len(plan.rows), rows_per_microbatch):
        members = sorted(i for row in plan.rows[start : start + rows_per_microbatch] for i in row)
        batches.append(linearize([trees[i] for i in members], plan.row_len,
                                 normalization=normalization, normalizer=normalizer,
                                 n_rows=rows_per_microbatch, gdn_chunk_size=gdn_chunk_size,
                                 gdn_chunks=gdn_chunks))
    return MicroBatches(tuple(same_score_len(batches)), plan)


def same_score_len(batches: Sequence[TreeBatch]) -> list[TreeBatch]:
    """The batches with `score_index` widened to the widest one (one step shape)."""
    width = max(b.inputs.score_index.shape[1] for b in batches)
    return [dataclasses.replace(b, inputs=dataclasses.replace(
                b.inputs, score_index=pad_score_index(b.inputs.score_index, width)))
            for b in batches]
