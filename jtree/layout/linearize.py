"""DFS layout of trees into static-shape batches, and the way back.

`linearize` lays whole trees out in rows of S tokens where a plan puts them (`jtree.layout.planner`:
first-fit decreasing, several trees per row) and emits the `jtree.layout.batch.DeviceBatch` the jitted
step consumes (docs/design.md section 3; the fields, dtypes and padding values are defined there).
Chunk tables for the gated delta rule (`jtree.layout.gdn_tables`) come only when `gdn_chunk_size` is
given (models with linear-attention layers need them).

`score_index` [rows, K] lists the row-local positions of the tokens the loss reads (a non-zero W,
P or N), in order, padded with -1. The loss scores only these (`jtree.objectives.logprobs.scored_logprobs`):
prompt, tool and padding positions never reach the vocabulary projection. K is `score_len` when
given (the step plan's, equal across micro-batches and hosts), else the largest row's count
rounded up by `jtree.layout.planner.score_width`.

With context parallelism the plan splits each row over c devices (`jtree.layout.context_rows`): every
token and every index (`end`, `pred`, the chunk tables, critic pairs, `score_index`) is written at
its gapped position directly, so a CP row is an ordinary row that holds gaps of padding.

Trees larger than S must be partitioned first. Shapes (row length, rows, score width, GDN chunk
capacity) are the planner's decisions, from small sets, so the step compiles a bounded number of
times.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jtree.config.objective import Normalization
from jtree.layout.batch import DeviceBatch, GdnTables, LossCoefficients, padding, token_arrays
from jtree.layout.coefficients import COEFFICIENT_FIELDS, batch_normalizer, token_coefficients
from jtree.layout.context_rows import ContextSplit, place_in_rows, split_nodes
from jtree.layout.gdn_tables import (
    chunk_tables,
    chunks_needed,
    concat_ranges,
    default_chunk_count,
    node_chunk_tables,
    tree_nodes,
)
from jtree.layout.planner import RowPlan, plan_rows, score_width
from jtree.layout.routing import tree_routing
from jtree.trees.tree import TrajectoryTree, TreeStats


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """Where each tree of a batch sits: tree k occupies row `rows[k]` from `offsets[k]`, or,
    with a context split (`splits[r]` of row r, slices of `slice_len`), from the packed offset
    `offsets[k]` moved to its gapped positions (`token_positions`)."""

    trees: tuple[TrajectoryTree, ...]
    rows: np.ndarray
    offsets: np.ndarray
    splits: tuple[ContextSplit, ...] | None = None
    slice_len: int | None = None

    def token_positions(self, k: int) -> np.ndarray:
        """Row positions of tree k's tokens, in tree-token (DFS) order."""
        packed = self.offsets[k] + np.arange(self.trees[k].n_tree_tokens)
        if self.splits is None:
            return packed
        return place_in_rows(self.splits, np.full(packed.shape, self.rows[k]), packed,
                             self.slice_len)


@dataclasses.dataclass(frozen=True, eq=False)
class TreeBatch:
    """A linearized batch: the device inputs [rows, S] plus the host-side layout to map results
    back and the loss normalization they were built with."""

    inputs: DeviceBatch
    layout: BatchLayout
    normalization: str
    normalizer: float
    has_old_logprobs: bool
    old_logprob_disagreement: float
    routing_disagreements: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        return self.inputs.shape

    def stats(self) -> TreeStats:
        total = TreeStats(0, 0, 0, 0, 0, 0)
        for t in self.layout.trees:
            total = total + t.stats()
        return total

    @property
    def padding_fraction(self) -> float:
        return 1.0 - float(self.inputs.valid.mean())


@dataclasses.dataclass(frozen=True)
class RowOptions:
    """How trees are laid into rows: the keywords of `linearize`, and of everything that lays out
    through it (`jtree.layout.baseline.linearize_baseline`, `jtree.step.batches.build_batch`).

    Without a `plan`, the planner's `plan_rows` makes one (first fit decreasing; `n_rows` fixes the
    number of rows, padding with empty rows; `len_buckets` lists allowed row lengths, the smallest
    that holds the packed rows is taken, default: always `seq_len`).
    `normalizer` overrides the batch normalizer of `normalization` (pass the value computed over the
    global batch when this call is one micro-batch or one device's share).
    `gdn_chunk_size` (e.g. `jtree.config.run.DEFAULT_CHUNK_SIZE`) adds the gated-delta-rule
    chunk tables with chunks of that many tokens; `gdn_chunks` is their chunk capacity NC per row
    (default: `jtree.layout.gdn_tables.default_chunk_count`, at least ceil(S / C); fix it to give
    every micro-batch the same shape).
    `path_weights` holds, per tree, per-path weights folded into the policy coefficients
    (`jtree.layout.coefficients.token_coefficients`; the off-policy weights of
    `jtree.layout.off_policy.path_weights`).
    `routed_experts` holds, per tree, per-path routed experts [len(path), L, k] (-1: own
    routing) for routing replay: folded onto tree tokens by `jtree.layout.routing.tree_routing`
    into the batch's `routed_experts`.
    """

    normalization: Normalization = "seq_mean_token_mean"
    normalizer: float | None = None
    n_rows: int | None = None
    len_buckets: Sequence[int] | None = None
    gdn_chunk_size: int | None = None
    gdn_chunks: int | None = None
    path_weights: Sequence[Sequence[np.ndarray]] | None = None
    routed_experts: Sequence[Sequence[np.ndarray]] | None = None

    def __post_init__(self) -> None:
        if self.gdn_chunk_size is None and self.gdn_chunks is not None:
            raise ValueError("gdn_chunks: given without gdn_chunk_size")
        if self.gdn_chunk_size is not None and self.gdn_chunk_size < 1:
            raise ValueError(f"gdn_chunk_size: must be >= 1, got {self.gdn_chunk_size}")


def linearize(trees: Sequence[TrajectoryTree], seq_len: int, *, plan: RowPlan | None = None,
              score_len: int | None = None, **options: Any) -> TreeBatch:
    """Lay `trees` out in DFS order into rows of at most `seq_len` tokens, where `plan` places
    them (`jtree.layout.planner`: tree k in row `plan.rows`, from the offset `plan.positions()`
    gives). `options` are `RowOptions`' fields. `score_len` fixes the width K of `score_index`
    (see the module docstring).
    """
    if not trees:
        raise ValueError("trees: need at least one tree")
    opts = RowOptions(**options)
    normalization, normalizer = opts.normalization, opts.normalizer
    plan = _checked_plan(trees, seq_len, plan, opts)
    sizes = [t.n_tree_tokens for t in trees]
    row_len, n_rows = plan.row_len, plan.n_rows
    splits = plan.splits if plan.context > 1 else None
    slice_len = row_len // plan.context

    if normalizer is None:
        normalizer = batch_normalizer(trees, normalization)
    tree_row, tree_off = plan.positions()
    tree_node_off = np.zeros(len(trees), np.int64)
    for members in plan.rows:
        nodes = 0
        for i in members:
            tree_node_off[i] = nodes
            nodes += trees[i].n_nodes

    per_tree, has_old, disagreement = tree_token_fields(trees, normalization, normalizer,
                                                        opts.path_weights)

    size_arr = np.asarray(sizes, np.int64)
    tok_row = np.repeat(tree_row, size_arr)
    tok_shift = np.repeat(tree_off, size_arr)

    def place(packed: np.ndarray) -> np.ndarray:  # packed row positions -> final ones
        return packed if splits is None else place_in_rows(splits, tok_row, packed, slice_len)

    dest = tok_row * row_len + place(tok_shift + concat_ranges(size_arr))
    cat = {k: np.concatenate([a[k] for a in per_tree]) for k in per_tree[0]}

    pad = padding(n_rows, row_len, score_len=None)
    row = {name: a.reshape(-1) for name, a in token_arrays(pad).items()}  # flat views
    for name in ("tokens", "pos", "path_count", *COEFFICIENT_FIELDS, "old_logprobs"):
        row[name][dest] = cat[name]
    row["end"][dest] = place(cat["end"] + tok_shift - 1) + 1  # one past the subtree's last
    row["pred"][dest] = np.where(cat["pred"] >= 0, place(np.maximum(cat["pred"], 0) + tok_shift),
                                 -1)
    row["node"][dest] = cat["node"] + np.repeat(tree_node_off, size_arr)
    row["valid"][dest] = True
    gdn = None if opts.gdn_chunk_size is None else _gdn_tables(
        trees, tree_row, tree_off, n_rows, row_len, splits, slice_len, opts)
    routed, routing_disagreements = None, 0
    if opts.routed_experts is not None:
        routed, routing_disagreements = _routed_rows(trees, opts.routed_experts, dest,
                                                     (n_rows, row_len))
    return TreeBatch(
        inputs=dataclasses.replace(pad, gdn=gdn, routed_experts=routed,
                                   score_index=score_positions(pad.coefficients, score_len)),
        layout=BatchLayout(tuple(trees), tree_row, tree_off, splits,
                           None if splits is None else slice_len),
        normalization=normalization,
        normalizer=float(normalizer),
        has_old_logprobs=has_old,
        old_logprob_disagreement=disagreement,
        routing_disagreements=routing_disagreements,
    )


def _routed_rows(trees: Sequence[TrajectoryTree], per_tree: Sequence[Sequence[np.ndarray]],
                 dest: np.ndarray, shape: tuple[int, int]) -> tuple[np.ndarray, int]:
    """The batch's `routed_experts` [rows, S, L, k] (-1 on padding and unrouted tokens), the
    trees' tokens written at `dest` (their flat row positions, tree-token order), and the
    number of tokens whose paths disagree (`jtree.layout.routing`)."""
    if len(per_tree) != len(trees):
        raise ValueError(f"routed_experts: {len(per_tree)} trees' routings for {len(trees)} "
                         "trees")
    folded = [tree_routing(t, r) for t, r in zip(trees, per_tree)]
    shapes = {f.shape[1:] for f, _ in folded}
    if len(shapes) > 1:
        raise ValueError(f"routed_experts: trees route [layers, k] of shapes {sorted(shapes)}")
    out = np.full((shape[0] * shape[1], *shapes.pop()), -1, np.int32)
    out[dest] = np.concatenate([f for f, _ in folded])
    return out.reshape(*shape, *out.shape[1:]), sum(n for _, n in folded)


def _checked_plan(trees: Sequence[TrajectoryTree], seq_len: int, plan: RowPlan | None,
                  opts: RowOptions) -> RowPlan:
    """`plan`, or the planner's rows for `trees`, checked against the trees and `seq_len`."""
    sizes = [t.n_tree_tokens for t in trees]
    for i, n in enumerate(sizes):
        if n > seq_len:
            raise ValueError(
                f"tree {i}: has {n} tree tokens, more than seq_len={seq_len}; partition it into "
                "parts of at most seq_len tokens first (capacity partitioning, "
                "jtree.partitioning.partition)")
    if plan is None:
        plan = plan_rows(sizes, seq_len, len_buckets=opts.len_buckets, n_rows=opts.n_rows)
    elif plan.sizes != tuple(sizes) or plan.row_len > seq_len:
        raise ValueError(f"plan: places units of {list(plan.sizes)} tokens in rows of "
                         f"{plan.row_len}; the trees have {sizes}, seq_len={seq_len}")
    if plan.row_len % plan.context:
        raise ValueError(f"plan: rows of {plan.row_len} tokens are not context={plan.context} "
                         "equal slices")
    return plan


def _gdn_tables(trees: Sequence[TrajectoryTree], tree_row: np.ndarray, tree_off: np.ndarray,
                n_rows: int, row_len: int, splits: Any, slice_len: int, opts: RowOptions
                ) -> GdnTables:
    """The gated-delta-rule chunk tables of the placed trees, on whole rows or, when `splits`
    cut the rows over the `context` devices, on the slices."""
    size, chunks = opts.gdn_chunk_size, opts.gdn_chunks
    if splits is None:
        if chunks is None:
            needed = chunks_needed(trees, tree_row, n_rows, size)
            chunks = default_chunk_count(row_len, size, int(needed.max()))
        return chunk_tables(trees, tree_row, tree_off, n_rows, row_len, size, chunks)
    nodes = split_nodes(*tree_nodes(trees, tree_row, tree_off), splits, slice_len)
    if chunks is None:
        needed = np.bincount(nodes[2], weights=-(-nodes[0] // size), minlength=n_rows)
        chunks = default_chunk_count(row_len, size, int(needed.max()))
    return node_chunk_tables(*nodes, np.zeros(len(nodes[0]), np.int64), n_rows, row_len, size,
                             chunks, n_initial=1)["tables"]


def score_positions(coefficients: LossCoefficients, score_len: int | None = None) -> np.ndarray:
    """[rows, K] row-local positions of the tokens with a non-zero loss coefficient, -1 padded."""
    c = coefficients
    scored = (c.weight != 0) | (c.adv_pos != 0) | (c.adv_neg != 0)
    rows, s = scored.shape
    counts = scored.sum(axis=1)
    need = int(counts.max(initial=0))
    if score_len is None:
        score_len = score_width(need, s)
    elif need > score_len:
        raise ValueError(f"score_len={score_len}: a row has {need} scored tokens")
    order = np.argsort(~scored, axis=1, kind="stable")[:, :score_len]
    if order.shape[1] < score_len:  # score_len > S: more slots than positions
        order = np.pad(order, ((0, 0), (0, score_len - order.shape[1])))
    slot = np.arange(score_len)
    return np.where(slot[None] < counts[:, None], order, -1).astype(np.int32)


def pad_score_index(index: np.ndarray, score_len: int) -> np.ndarray:
    """`score_index` widened to `score_len` slots (so batches of one step share a shape)."""
    if index.shape[-1] > score_len:
        raise ValueError(f"score_len={score_len}: narrower than the batch's {index.shape[-1]}")
    width = [(0, 0)] * (index.ndim - 1) + [(0, score_len - index.shape[-1])]
    return np.pad(index, width, constant_values=-1)


def tree_token_fields(
    trees: Sequence[TrajectoryTree], normalization: Normalization, normalizer: float,
    path_weights: Sequence[Sequence[np.ndarray]] | None = None,
) -> tuple[list[dict[str, np.ndarray]], bool, float]:
    """Every per-token field of each tree in tree-token (DFS) order, tree-local indices: the
    `token_arrays`, loss coefficients (with tree k's `path_weights[k]` folded in, when given),
    `path_count` and `old_logprobs`. Also whether the trees carry old log-probs and the largest
    disagreement of per-path old log-probs on shared tokens."""
    if path_weights is not None and len(path_weights) != len(trees):
        raise ValueError(f"path_weights: {len(path_weights)} trees' weights for {len(trees)} "
                         "trees")
    per_tree = [dict(t.token_arrays) for t in trees]
    has_old = any(t.old_logprobs is not None for t in trees)
    if has_old and not all(t.old_logprobs is not None for t in trees):
        missing = next(i for i, t in enumerate(trees) if t.old_logprobs is None)
        raise ValueError(f"tree {missing}: old_logprobs missing while other trees have them")
    disagreement = 0.0
    for k, (t, arrs) in enumerate(zip(trees, per_tree)):
        weights = None if path_weights is None else path_weights[k]
        arrs.update(token_coefficients(t, normalization, normalizer, weights))
        arrs["path_count"] = np.bincount(t.flat_token_index, minlength=t.n_tree_tokens)
        if has_old:
            # Position 0 is never scored, so rollout engines may leave anything there.
            old = [np.concatenate([[0.0], o[1:]]) for o in t.old_logprobs]
            arrs["old_logprobs"], d = t.tree_token_values(old)
            disagreement = max(disagreement, d)
        else:
            arrs["old_logprobs"] = np.zeros(t.n_tree_tokens, np.float32)
    return per_tree, has_old, disagreement


def unlinearize(batch: TreeBatch, per_token_values: np.ndarray) -> list[list[np.ndarray]]:
    """Map a [rows, S] per-token array back to one array per path, per tree.

    Result[k][p] is aligned with the tokens of path p of tree k (the p-th input sequence for trees
    built with `from_sequences`). Values at a path's first position are whatever the array holds
    there (0 for `token_logprobs`, which cannot score a first token).
    """
    values = np.asarray(per_token_values)
    if values.shape[:2] != batch.shape:
        raise ValueError(f"per_token_values: shape {values.shape} does not match batch {batch.shape}")
    out = []
    for k, (tree, row) in enumerate(zip(batch.layout.trees, batch.layout.rows)):
        tree_vals = values[row, batch.layout.token_positions(k)]
        flat = tree_vals[tree.flat_token_index]
        splits = np.cumsum(tree.path_lengths)[:-1]
        out.append(np.split(flat, splits))
    return out
