"""Forest packing: many trees or parts into fixed-shape micro-batches for one jitted step.

`plan_rows` packs items (tree token counts) into rows first-fit decreasing and picks the row length
from a small set of buckets, so a step compiles for a bounded number of shapes, and reports the
padding it costs. `build_microbatches` turns trees (typically the parts of `jtree.partition`) into M
equally shaped `TreeBatch`es of R rows, all with the normalizer of the whole step, which is what
`jtree.train.make_grad_fn` scans over: the summed micro-batch gradients equal the full-batch
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

from jtree.chunk_tables import default_chunk_count
from jtree.linearize import TreeBatch, linearize, pack_rows
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


@dataclasses.dataclass(frozen=True, eq=False)
class MicroBatches:
    """M equally shaped micro-batches of one step (all with the step's normalizer)."""

    batches: tuple[TreeBatch, ...]
    plan: RowPlan

    def inputs(self) -> dict[str, np.ndarray]:
        """Step inputs: every array stacked to [M, rows, S]."""
        arrays = [b.arrays() for b in self.batches]
        return {k: np.stack([a[k] for a in arrays]) for k in arrays[0]}


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
    return MicroBatches(tuple(batches), plan)
