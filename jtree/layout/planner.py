"""The batch planner: where every unit of a step goes, and the step's shape, decided once.

A *unit* is what gets laid out whole in a row: a tree, a capacity part of a tree larger than a row
(`jtree.partitioning.partition`), or one path (the per-branch baseline). The planner sees only integers per
unit (tree tokens, scored tokens, Gated DeltaNet chunks) and returns a `StepPlan`: which unit goes
to which data shard, micro-batch, row and offset, the row length, the rows per micro-batch, the
`score_index` width and the GDN chunk capacity. `jtree.layout.linearize.linearize` lays the units out
where the plan says (it takes a `RowPlan`, the placement of one micro-batch of one shard); the
step builders (`jtree.training.step_builders.StepBuilder`, `jtree.layout.microbatches.build_microbatches`) and every benchmark
get their batches that way, so nothing else decides or predicts the packing.

Layout policy (`LayoutConfig`), one step at a time:

1. Units are balanced over the n_shards x micro_batches bins by tree tokens
   (`jtree.layout.balance.assign_to_ranks`): every data shard and micro-batch gets about the same work.
   (`micro_batches=None` instead packs all units together and deals the rows out, `rows` at a
   time, into as many micro-batches as they fill: the redundancy-free executor's whole trees.)
2. Each bin is packed into rows first fit decreasing (`jtree.layout.bin_packing`; units in one row
   cannot see each other, so any packing is exact).
3. The row length is one of `row_lengths` (default: `seq_len` only, one shape per run). With a
   ladder of lengths (`row_length_ladder`: `k` steps per octave, multiples of the 64-token
   attention block) the step packs at every length that holds its largest unit and keeps the one
   that computes the fewest positions (bins x rows x length; ties to longer rows: fewer, larger
   matmuls). With `rows` fixed for the run (the trainer: `data.rows_per_micro_batch` or
   `jtree.training.step_builders.rows_for_run`, the fewest rows of `seq_len` that hold every step) that is the
   shortest length whose packing fits the rows; with `rows=None` the rows follow the step.
   A small step of a run with long rows (high POR: the tree holds a tenth of the baseline's
   tokens) thus gets short rows instead of one mostly padded row of `seq_len`.
4. The `score_index` width is the most scored tokens of any row, rounded up on a ladder of four
   steps per octave (at least 64, at most the row length; `score_width`), or `score_len` fixed
   for the run: the trainer fixes it at the widest any of its steps needs, since the width
   otherwise changes with nearly every batch of chat data, and every width is a compile.
5. The GDN chunk capacity is the bucket (`jtree.layout.gdn_tables.default_chunk_count`) of the most
   chunks any row needs, or `gdn_chunks` fixed for the run (the trainer: the most any step needs).
6. With context parallelism (`context` = c > 1 devices per row, the `context` mesh axis) every
   packed row is split over its c devices by attention work (`jtree.layout.context_rows.split_row`,
   from the units' `end` arrays; each device's work within `context_slack` of the least
   possible largest, the fewest tokens per device among those), each device holding at most
   max(length) / c tokens; the row
   length is the shortest allowed length of c * L positions, L the largest piece rounded up to
   the attention block, so the row lengths allowed are the multiples of c * `ROW_ALIGN`. Every
   piece boundary that cuts a node may add one GDN chunk per row (counted in the capacity).

Every host plans the whole global step from the same units, so all hosts agree on every shape
without talking to each other, and each lays out only the shards it feeds. The shape of a step is
therefore (micro_batches, rows x shards, row length, score width, chunk capacity). The trainer fixes
everything but the row length for the whole run, so it compiles one step program per mode and row
length: one per mode with the default `row_lengths`, at most |row_lengths| with a ladder.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jtree.layout.balance import assign_to_ranks
from jtree.layout.bin_packing import first_fit_decreasing
from jtree.layout.context_rows import ContextSplit, check_context, slice_length, split_row
from jtree.layout.gdn_tables import default_chunk_count

ROW_ALIGN = 64  # row lengths of a ladder are multiples of the attention kernels' block
SCORE_MIN = 64  # the narrowest `score_index`
SCORE_STEPS_PER_OCTAVE = 4


def check_row_slices(seq_len: int, context: int,
                     names: tuple[str, str] = ("context", "seq_len")) -> None:
    """A ValueError naming the settings `names` (context size, row length) when a row of
    `seq_len` tokens is not `context` slices of whole `ROW_ALIGN` blocks."""
    if context > 1 and seq_len % (context * ROW_ALIGN):
        raise ValueError(f"{names[0]}={context}: {names[1]}={seq_len} is not {context} device "
                         f"slices of a multiple of {ROW_ALIGN} tokens (the attention block; the "
                         "planner balances rows over the slices in whole blocks, "
                         "jtree.layout.context_rows)")


# ---------------------------------------------------------------------------- length ladders


def check_steps_per_octave(value: int, name: str) -> None:
    """ValueError naming `name` unless `value` is a power of two >= 1 (so that the grid's steps
    divide the powers of two it runs between)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1 \
            or value & (value - 1):
        raise ValueError(f"{name}: must be a power of two >= 1, got {value!r}")


def octave_step_length(n: int, steps_per_octave: int, min_step: int = 8) -> int:
    """The smallest length >= n (at least 8) on a grid of `steps_per_octave` equal steps between
    consecutive powers of two (2: 96, 128, 192, 256, ...; 8: 144, 160, ..., 256, 288, ...), with
    steps of at least `min_step` tokens: the padding stays under max(n / steps_per_octave,
    min_step), and the number of distinct lengths up to L is at most steps_per_octave * log2(L)."""
    check_steps_per_octave(steps_per_octave, "steps_per_octave")
    step = max(min_step, (1 << (max(n, 8) - 1).bit_length()) // (2 * steps_per_octave))
    return max(8, -(-n // step) * step)


def row_length_ladder(seq_len: int, steps_per_octave: int) -> tuple[int, ...]:
    """Row lengths up to `seq_len`: `steps_per_octave` steps between powers of two, multiples of
    `ROW_ALIGN` (64, 128, ..., 512, 576, ... for 8 steps), and `seq_len` itself."""
    lengths, n = [], 1
    while True:
        length = octave_step_length(n, steps_per_octave, min_step=ROW_ALIGN)
        if length >= seq_len:
            return tuple(lengths + [seq_len])
        lengths.append(length)
        n = length + 1


def score_width(need: int, row_len: int) -> int:
    """The `score_index` width for rows of at most `need` scored tokens (see the module
    docstring, point 4)."""
    return min(row_len, octave_step_length(max(int(need), 1), SCORE_STEPS_PER_OCTAVE,
                                           min_step=SCORE_MIN))


# ---------------------------------------------------------------------------- one bin's rows


@dataclasses.dataclass(frozen=True)
class RowPlan:
    """The placement of one micro-batch (of one shard): `rows[r]` lists the items (indices into
    the micro-batch's units) in row r, in order from position 0; `n_rows` rows of `row_len`
    tokens (rows past the listed ones are padding). With context parallelism `splits[r]` is
    listed row r's split over the `context` devices (`jtree.layout.context_rows`): the items sit back
    to back at the packed offsets of `positions`, and `jtree.layout.linearize` places packed position p
    of row r at `splits[r].place(p, row_len // context)`."""

    rows: tuple[tuple[int, ...], ...]
    row_len: int
    n_rows: int
    used_tokens: int
    sizes: tuple[int, ...]
    splits: tuple[ContextSplit, ...] | None = None

    @property
    def context(self) -> int:
        return self.splits[0].context if self.splits else 1

    @property
    def padding_tokens(self) -> int:
        return self.n_rows * self.row_len - self.used_tokens

    @property
    def padding_fraction(self) -> float:
        return self.padding_tokens / (self.n_rows * self.row_len)

    def positions(self) -> tuple[np.ndarray, np.ndarray]:
        """(row, packed offset) of every item: items fill their row in listed order from
        position 0 (before the context split, if any, moves them to their gapped positions)."""
        row = np.zeros(len(self.sizes), np.int64)
        offset = np.zeros(len(self.sizes), np.int64)
        for r, members in enumerate(self.rows):
            at = 0
            for i in members:
                row[i], offset[i] = r, at
                at += self.sizes[i]
        return row, offset

    def as_dict(self) -> dict[str, float | int]:
        return {"rows": self.n_rows, "row_len": self.row_len, "used_tokens": self.used_tokens,
                "padding_tokens": self.padding_tokens, "padding_fraction": self.padding_fraction}


def _check_sizes(sizes: Sequence[int], max_len: int) -> list[int]:
    sizes = [int(s) for s in sizes]
    for i, s in enumerate(sizes):
        if s < 1 or s > max_len:
            raise ValueError(f"item {i}: has {s} tokens, outside [1, max_len={max_len}]; "
                             "partition larger trees first (jtree.partitioning.partition)")
    return sizes


def plan_rows(
    sizes: Sequence[int],
    max_len: int,
    *,
    len_buckets: Sequence[int] | None = None,
    rows_multiple: int = 1,
    n_rows: int | None = None,
) -> RowPlan:
    """First-fit-decreasing rows of at most `max_len` tokens, row length from `len_buckets`.

    The row length is the smallest bucket (default: `max_len` only) that holds the fullest row;
    the row count is `n_rows` when given, else rounded up to a multiple of `rows_multiple` (e.g.
    rows per micro-batch), the extra rows being padding. This is the plan `linearize` lays a batch
    out with when it is given none.
    """
    if not len(sizes):
        raise ValueError("sizes: need at least one item")
    sizes = _check_sizes(sizes, max_len)
    if rows_multiple < 1:
        raise ValueError(f"rows_multiple: must be >= 1, got {rows_multiple}")
    rows = first_fit_decreasing(sizes, max_len)
    fullest = max(sum(sizes[i] for i in r) for r in rows)
    buckets = sorted(int(b) for b in (len_buckets or [max_len]) if fullest <= b <= max_len)
    if not buckets:
        raise ValueError(f"len_buckets: none between the fullest row ({fullest}) and "
                         f"max_len={max_len}")
    if n_rows is None:
        n_rows = -(-len(rows) // rows_multiple) * rows_multiple
    elif n_rows < len(rows):
        raise ValueError(f"n_rows={n_rows}: the trees need {len(rows)} rows of {buckets[0]} "
                         "tokens")
    return RowPlan(tuple(tuple(r) for r in rows), buckets[0], n_rows, sum(sizes), tuple(sizes))


def _least_positions(bins: Sequence[list[int]], lengths: Sequence[int], *, rows: int | None,
                     rows_multiple: int) -> list[RowPlan]:
    """Each bin's rows at the one length among `lengths` (all >= the largest item) that computes
    the fewest positions over all bins, bins x rows x length, ties to longer rows. Rows per bin:
    `rows` when fixed (lengths whose packing needs more are out), else the most any bin needs,
    rounded up to a multiple of `rows_multiple`."""
    totals = [sum(b) for b in bins]

    def round_rows(n: int) -> int:
        return -(-n // rows_multiple) * rows_multiple

    def lower_bound(length: int) -> float:  # positions of the fewest rows that could hold all
        need = round_rows(max(-(-t // length) for t in totals))
        if rows is not None:
            return float("inf") if need > rows else rows * length * len(bins)
        return need * length * len(bins)

    best: tuple[int, int, list[RowPlan]] | None = None
    for length in sorted(lengths, key=lambda b: (lower_bound(b), -b)):
        bound = lower_bound(length)
        if bound == float("inf") or (best is not None and bound > best[0]):
            break  # no remaining length can do better
        packed = [first_fit_decreasing(b, length) if b else [] for b in bins]
        need = round_rows(max(len(p) for p in packed))
        if rows is not None and need > rows:
            continue
        n = rows if rows is not None else need
        key = (n * length * len(bins), -length)
        if best is None or key < best[:2]:
            best = (key[0], key[1], [RowPlan(tuple(tuple(r) for r in p), length, n, sum(b),
                                             tuple(b)) for p, b in zip(packed, bins)])
    if best is None:
        largest = max((max(b) for b in bins if b), default=0)
        raise ValueError(f"rows={rows}: no row length in {sorted(lengths)} packs every bin of the "
                         f"step (largest unit {largest} tokens, fullest bin {max(totals)}) into "
                         f"{rows} rows")
    return best[2]


def least_padding_plan(sizes: Sequence[int], max_len: int, len_buckets: Sequence[int], *,
                       rows_multiple: int = 1) -> RowPlan:
    """The row length among `len_buckets` (those holding the largest item, at most `max_len`)
    whose first-fit-decreasing packing computes the fewest padded positions (rows x length).

    `plan_rows` packs at `max_len` and then shrinks the length to fit; this instead packs at every
    bucket length, which cuts padding when items are a large fraction of a row: three trees of
    0.4 S need two rows of S (40% padding) but exactly three rows of 0.4 S. Ties go to the longer
    rows (fewer, larger matmuls).
    """
    sizes = [int(s) for s in sizes]
    candidates = _fitting(len_buckets, max(sizes), max_len)
    return _least_positions([sizes], candidates, rows=None, rows_multiple=rows_multiple)[0]


def _fitting(lengths: Sequence[int], largest: int, max_len: int) -> list[int]:
    out = sorted({int(b) for b in lengths if largest <= b <= max_len})
    if not out:
        raise ValueError(f"len_buckets: none between the largest item ({largest}) and "
                         f"max_len={max_len}")
    return out


# ---------------------------------------------------------------------------- one step


@dataclasses.dataclass(frozen=True)
class LayoutConfig:
    """The layout policy of a run (module docstring): rows of at most `seq_len` tokens,
    `n_shards` data shards x `micro_batches` micro-batches of `rows` rows each (None: as the step
    needs; `micro_batches=None`: as many micro-batches of `rows` rows as the packed rows fill),
    row lengths from `row_lengths` (None: `seq_len` only), `score_len` scored slots per row (None:
    per step, `score_width`), GDN chunk tables of `gdn_chunk_size` with `gdn_chunks` chunks per
    row (None: per step). A run fixes rows, score width and chunk capacity at the most any of its
    steps needs (`jtree.training.step_builders.step_builder`), so it compiles one step program per row length.
    `context` > 1 splits every row over that many devices of the `context` mesh axis, by
    attention work within `context_slack` of the best balance (module docstring, point 6)."""

    seq_len: int
    n_shards: int = 1
    micro_batches: int | None = 1
    rows: int | None = None
    row_lengths: tuple[int, ...] | None = None
    gdn_chunk_size: int | None = None
    gdn_chunks: int | None = None
    score_len: int | None = None
    context: int = 1
    context_slack: float = 0.05

    def __post_init__(self) -> None:
        check_context(self.context)
        if not self.context_slack >= 0:
            raise ValueError(f"context_slack: must be >= 0, got {self.context_slack}")
        check_row_slices(self.seq_len, self.context)
        for name in ("seq_len", "n_shards", "micro_batches", "rows", "gdn_chunk_size",
                     "gdn_chunks", "score_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        if self.micro_batches is None and (self.rows is None or self.n_shards != 1):
            raise ValueError("micro_batches=None: needs rows fixed and one shard")
        if self.gdn_chunk_size is None and self.gdn_chunks is not None:
            raise ValueError("gdn_chunks: given without gdn_chunk_size")
        if self.row_lengths is not None and (not self.row_lengths
                                             or max(self.row_lengths) > self.seq_len):
            raise ValueError(f"row_lengths: {self.row_lengths} must be non-empty and at most "
                             f"seq_len={self.seq_len}")


@dataclasses.dataclass(frozen=True, eq=False)
class StepPlan:
    """Where every unit of one step goes and the step's shape.

    `units[b]` are the unit indices of bin b = shard * micro_batches + micro-batch and
    `placements[b]` their rows (items of the `RowPlan` index into `units[b]`). Every micro-batch
    of every shard has `rows` rows of `row_len` tokens, `score_len` scored slots per row and
    `gdn_chunks` chunks per row (None without GDN tables); with context parallelism every row is
    `context` slices of `row_len // context` positions (`RowPlan.splits`).
    """

    units: tuple[tuple[int, ...], ...]
    placements: tuple[RowPlan, ...]
    n_shards: int
    micro_batches: int
    row_len: int
    rows: int
    score_len: int
    gdn_chunks: int | None
    context: int = 1

    def bin(self, shard: int, micro_batch: int) -> int:
        return shard * self.micro_batches + micro_batch

    @property
    def n_rows(self) -> int:
        """Rows of the whole step (all shards and micro-batches)."""
        return len(self.placements) * self.rows

    @property
    def used_tokens(self) -> int:
        return sum(p.used_tokens for p in self.placements)

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.used_tokens / (self.n_rows * self.row_len)


def plan_step(tokens: Sequence[int], config: LayoutConfig, *, scored: Sequence[int] | None = None,
              chunks: Sequence[int] | None = None,
              ends: Sequence[np.ndarray] | None = None,
              bins: Sequence[Sequence[int]] | None = None) -> StepPlan:
    """The plan of one step whose units have `tokens` tree tokens, `scored` scored tokens (those
    with a loss coefficient; default: every token), with GDN tables `chunks` chunks of
    `config.gdn_chunk_size` (sum over their nodes of ceil(node length / chunk size)) and, with
    context parallelism (`config.context` > 1), `ends` their masks (`end`, unit-local).
    `bins`: the units of each shard x micro-batch bin when the caller balanced them already
    (cross-group merging builds each bin's units from the trees it gave that bin,
    `jtree.layout.cross_group`); every unit in exactly one bin."""
    if not len(tokens):
        raise ValueError("tokens: need at least one unit")
    tokens = _check_sizes(tokens, config.seq_len)
    if bins is not None:
        _check_bins(bins, len(tokens), config)
    lengths = _fitting(config.row_lengths or [config.seq_len], max(tokens), config.seq_len)
    if config.context > 1:
        if ends is None or len(ends) != len(tokens):
            raise ValueError(f"ends: context={config.context} splits rows by attention work and "
                             f"needs every unit's `end` ({len(tokens)} units)")
        lengths = [n for n in lengths if n % (config.context * ROW_ALIGN) == 0]
        if not lengths:
            raise ValueError(f"context={config.context}: no row length in "
                             f"{config.row_lengths} is {config.context} slices of a multiple of "
                             f"{ROW_ALIGN} tokens")
    if config.micro_batches is None:  # one packing, its rows dealt out `rows` at a time
        whole = least_padding_plan(tokens, config.seq_len, lengths, rows_multiple=config.rows)
        units, placements = [], []
        for k in range(0, whole.n_rows, config.rows):
            members = sorted(i for row in whole.rows[k : k + config.rows] for i in row)
            local = {i: j for j, i in enumerate(members)}
            units.append(members)
            placements.append(RowPlan(
                tuple(tuple(local[i] for i in row) for row in whole.rows[k : k + config.rows]),
                whole.row_len, config.rows, sum(tokens[i] for i in members),
                tuple(tokens[i] for i in members)))
    else:
        units = [list(r) for r in (bins if bins is not None else assign_to_ranks(
            tokens, config.n_shards * config.micro_batches).ranks)]
        placements = _least_positions([[tokens[i] for i in u] for u in units], lengths,
                                      rows=config.rows, rows_multiple=1)
    if config.context > 1:
        placements = _split_rows(units, placements, ends, lengths, config.context,
                                 config.context_slack)
    row_len = placements[0].row_len
    scored = tokens if scored is None else [int(s) for s in scored]
    for name, values in (("scored", scored), ("chunks", chunks)):
        if values is not None and len(values) != len(tokens):
            raise ValueError(f"{name}: {len(values)} values for {len(tokens)} units")
    need = max((sum(scored[u[i]] for i in row) for u, p in zip(units, placements)
                for row in p.rows), default=0)
    gdn_chunks = None
    if config.gdn_chunk_size is not None:
        gdn_chunks = config.gdn_chunks
        if gdn_chunks is None:
            if chunks is None:
                raise ValueError("chunks: needed for the GDN chunk capacity (gdn_chunk_size set)")
            most = max((sum(int(chunks[u[i]]) for i in row) for u, p in zip(units, placements)
                        for row in p.rows), default=0)
            gdn_chunks = default_chunk_count(row_len, config.gdn_chunk_size,
                                             most + config.context - 1)
    if config.score_len is None:
        score_len = score_width(need, row_len)
    elif need > config.score_len:
        raise ValueError(f"score_len={config.score_len}: a row of this step has {need} scored "
                         "tokens (the run's score width must hold every step)")
    else:
        score_len = min(config.score_len, row_len)
    return StepPlan(tuple(tuple(u) for u in units), tuple(placements), config.n_shards,
                    len(units) // config.n_shards, row_len, placements[0].n_rows, score_len,
                    gdn_chunks, config.context)


def _check_bins(bins: Sequence[Sequence[int]], n_units: int, config: LayoutConfig) -> None:
    """A ValueError unless `bins` puts each of `n_units` units in one of the config's bins."""
    if config.micro_batches is None:
        raise ValueError("bins: given with micro_batches=None (which deals packed rows out)")
    if len(bins) != config.n_shards * config.micro_batches:
        raise ValueError(f"bins: {len(bins)} bins for {config.n_shards} shard(s) x "
                         f"{config.micro_batches} micro-batch(es)")
    if sorted(i for b in bins for i in b) != list(range(n_units)):
        raise ValueError(f"bins: must hold each of the {n_units} units exactly once")


def _split_rows(units: Sequence[Sequence[int]], placements: Sequence[RowPlan],
                ends: Sequence[np.ndarray], lengths: Sequence[int], context: int,
                slack: float) -> list[RowPlan]:
    """`placements` with every listed row split over `context` devices of at most
    max(lengths) / context tokens (module docstring, point 6), all at the one row length that
    holds the largest piece of any row."""
    max_slice = max(lengths) // context
    splits = []
    for members, placement in zip(units, placements):
        _, offsets = placement.positions()
        splits.append(tuple(
            split_row(np.concatenate([np.asarray(ends[members[i]], np.int64) + offsets[i]
                                      for i in row]), context, block=ROW_ALIGN,
                      max_slice=max_slice, slack=slack)
            for row in placement.rows))
    need = context * slice_length([s for row in splits for s in row], ROW_ALIGN)
    row_len = min(n for n in lengths if n >= need)
    return [dataclasses.replace(p, row_len=row_len, splits=s)
            for p, s in zip(placements, splits)]


def rows_to_hold(steps: Sequence[Sequence[int]], config: LayoutConfig,
                 bins: Sequence[Sequence[Sequence[int]] | None] | None = None) -> int:
    """The fewest rows per micro-batch that hold every step (each given by its units' tree
    tokens, and `bins[k]` step k's bins when balanced already, `plan_step`) packed at
    `config.seq_len`: the rows a run fixes (`jtree.training.step_builders.rows_for_run`)."""
    at_seq_len = dataclasses.replace(config, rows=None, row_lengths=None, gdn_chunk_size=None,
                                     gdn_chunks=None, context=1)  # a split moves no unit
    bins = [None] * len(steps) if bins is None else bins
    return max([1] + [plan_step(s, at_seq_len, bins=b).rows for s, b in zip(steps, bins)
                      if len(s)])
