"""Static-shape batches of a redundancy-free plan: one row per part, with its prefix layout.

A part's row is laid out in *combined coordinates*: the prefix (the chain of tokens above the part,
root first) fills positions [P - n, P) of a prefix region of P slots (P from a few buckets;
[0, P - n) is padding that no query sees), and the row's own tokens follow at P + i. The part's
own tokens come first in the row, in DFS order; trees small enough to fit whole may fill the rest
of the row. In these coordinates the tree mask is still j <= i < end[j], so:

- `mask.end`, `pred` of the own tokens are combined coordinates; a subtree top's `pred` is P - 1,
  the attach token (scored with the hidden state the parent part computed there);
- `mask.prefix_end` [1, P]: a prefix token sees the whole part (end = P + part size); padding
  j + 1;
- `prefix_pred` [1, P]: the previous chain token (the conv's left context), -1 at the root;
- GDN chunk tables start the part's subtrees from initial slot 1 (the state at the attach token)
  and other trees from slot 0 (zeros); `gdn.export_slots` [1, E] lists the buffer slots of the
  states at the tokens this part's children hang below.

A part row is as long as its content needs, rounded up to tree mode's row lengths (`row_length`:
`jtree.layout.planner.row_length_ladder`, multiples of the attention block, at most `seq_len`): a
part is often much shorter than the capacity (the top of a tree above its branch points, the last
piece of a long node), and every slot of its row costs the projections, MLP and loss of a token.

Every part of a program has the same prefix region P: the longest prefix's bucket
(`prefix_bucket`). The executor compiles its per-part functions once per (row length, P) and its
prefix gather (parent row length, P) rather than once per combination of a parent's and a child's
prefix lengths, so a program compiles at most a handful of programs per row length. Shorter
prefixes (and parts without one: the top of a tree) fill the end of the region and leave the
start as padding, masked so that no query sees it (a part without a prefix reads zeros there):
padding costs gathers and attention over masked keys, not the projections, MLP or loss.

Every coefficient is the full tree's (W_t, P_t, N_t with the batch normalizer): each tree token is
computed once, so it carries its whole weight.

`build_program` chooses per tree: trees that fit in `capacity` are packed whole (into the spare
room of part rows first, then into ordinary micro-batches), larger trees are split by
`jtree.partitioning.redundancy_free.plan.plan_parts`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jtree.config.objective import Normalization
from jtree.config.run import ROW_STEPS_PER_OCTAVE
from jtree.layout.batch import DeviceBatch, GdnTables, padding, token_arrays
from jtree.layout.coefficients import COEFFICIENT_FIELDS, batch_normalizer
from jtree.layout.gdn_tables import default_chunk_count, node_chunk_tables
from jtree.layout.linearize import tree_token_fields
from jtree.layout.microbatches import MicroBatches, build_microbatches
from jtree.layout.planner import check_steps_per_octave, octave_step_length, row_length_ladder
from jtree.partitioning.redundancy_free.plan import RfreePart, plan_parts
from jtree.trees.tree import TrajectoryTree


@dataclasses.dataclass(frozen=True)
class Member:
    """Tree `tree` (index into the program's trees) contributes tree tokens `tokens` at own
    positions `offset`, `offset + 1`, ... of row `row` of its batch."""

    tree: int
    tokens: np.ndarray
    offset: int
    row: int = 0


@dataclasses.dataclass(frozen=True, eq=False)
class PartBatch:
    """One row holding one part (and possibly whole small trees after it).

    `inputs`: the step inputs ([1, S] own arrays, the prefix layout `mask.prefix_end` /
    `prefix_pred` [1, P], and with GDN layers the chunk tables with `export_slots` [1, E]).
    `parent` / `children`: indices into `RfreeProgram.parts`. `gather_index` [1, P]: each prefix
    slot's position in the parent's combined coordinates (-1: padding); `gather_state` [1]: which
    of the parent's exported GDN states the part starts from. Both None for a part without a
    prefix.
    """

    inputs: DeviceBatch
    parent: int
    children: tuple[int, ...]
    gather_index: np.ndarray | None
    gather_state: np.ndarray | None
    members: tuple[Member, ...]

    @property
    def prefix_len(self) -> int:
        """P, the prefix region's slots (all padding for a part without a prefix)."""
        return self.inputs.mask.prefix_len


@dataclasses.dataclass(frozen=True, eq=False)
class RfreeProgram:
    """Everything one step of redundancy-free training runs (see module docstring)."""

    trees: tuple[TrajectoryTree, ...]
    parts: tuple[PartBatch, ...]
    whole: MicroBatches | None
    whole_trees: tuple[int, ...]
    capacity: int
    normalization: str
    normalizer: float
    old_logprob_disagreement: float

    @property
    def n_computed(self) -> int:
        """Tokens computed by the whole step (every tree token once)."""
        return sum(len(m.tokens) for p in self.parts for m in p.members) + sum(
            self.trees[i].n_tree_tokens for i in self.whole_trees)

    @property
    def n_rows(self) -> int:
        return len(self.parts) + (0 if self.whole is None else sum(
            b.shape[0] for b in self.whole.batches))


def prefix_bucket(n: int, buckets: Sequence[int] | None = None) -> int:
    """Prefix length P >= n: the smallest of `buckets`, or by default from quarter steps between
    powers of two (two steps per octave, at least 8; `octave_step_length`), so parts compile for a
    bounded number of shapes."""
    if n == 0:
        return 0
    if buckets:
        fitting = [b for b in buckets if b >= n]
        if not fitting:
            raise ValueError(f"prefix_buckets: none holds a prefix of {n} tokens")
        return min(fitting)
    return octave_step_length(n, 2, min_step=2)


def row_length(n: int, seq_len: int, buckets: Sequence[int] | None = None,
               steps_per_octave: int = ROW_STEPS_PER_OCTAVE) -> int:
    """Row length S >= n of a part row holding n tokens: the smallest of `buckets` (default: tree
    mode's `row_length_ladder` of `steps_per_octave`, so part rows compile for as few lengths as
    tree-mode rows) that holds them, never more than `seq_len`."""
    if not buckets:
        buckets = row_length_ladder(seq_len, steps_per_octave)
    elif max(buckets) > seq_len:
        raise ValueError(f"row_lengths: {max(buckets)} exceeds seq_len={seq_len}")
    return min([b for b in buckets if b >= n] + [seq_len])


def build_program(
    trees: Sequence[TrajectoryTree],
    capacity: int,
    *,
    seq_len: int | None = None,
    prefix_buckets: Sequence[int] | None = None,
    row_lengths: Sequence[int] | None = None,
    row_steps_per_octave: int = ROW_STEPS_PER_OCTAVE,
    normalization: Normalization = "seq_mean_token_mean",
    normalizer: float | None = None,
    rows_per_microbatch: int = 1,
    gdn_chunk_size: int | None = None,
    gdn_chunks: int | None = None,
    gdn_exports: int | None = None,
    uniform: bool = False,
) -> RfreeProgram:
    """Plan and lay out `trees` for redundancy-free training: parts of at most `capacity` tokens
    in rows of at most `seq_len` (default `capacity`) tokens.

    `prefix_buckets` lists the allowed prefix lengths (default: `prefix_bucket`'s steps; the
    program's one prefix region is the bucket of its longest prefix), `row_lengths` the allowed
    lengths of part rows (default: `row_length_ladder(seq_len, row_steps_per_octave)`;
    `[seq_len]` gives every part row the same length, fewer shapes to compile for more padding);
    `normalizer` defaults to the batch normalizer of `trees`; `gdn_chunk_size` adds the Gated
    DeltaNet chunk tables (hybrid models), `gdn_chunks` fixes their chunk count per row and
    `gdn_exports` the number of exported states per row (default: a power of two per part; fixed
    values compile fewer shapes). Whole
    trees that do not fit into part rows go to micro-batches of `rows_per_microbatch` rows.

    `uniform` lays the program out for the mesh executor (`jtree.partitioning.redundancy_free.mesh_executor`), which stacks part
    rows into one array: every part row gets the same shapes (the largest row length, GDN chunk
    count and export width of the program's rows) and the small trees that
    fit no part row get rows of their own (parts without prefix or children) instead of
    micro-batches.
    """
    if not trees:
        raise ValueError("trees: need at least one tree")
    check_steps_per_octave(row_steps_per_octave, "row_steps_per_octave")
    seq_len = capacity if seq_len is None else seq_len
    if seq_len < capacity:
        raise ValueError(f"seq_len={seq_len}: rows must hold a part of capacity={capacity}")
    if normalizer is None:
        normalizer = batch_normalizer(trees, normalization)
    fields, _, disagreement = tree_token_fields(trees, normalization, normalizer)
    big = [i for i, t in enumerate(trees) if t.n_tree_tokens > capacity]
    small = [i for i, t in enumerate(trees) if t.n_tree_tokens <= capacity]
    planned: list[tuple[int, RfreePart]] = []
    for i in big:
        base = len(planned)
        for part in plan_parts(trees[i], capacity):
            planned.append((i, dataclasses.replace(
                part, parent=part.parent + base if part.parent >= 0 else -1,
                children=tuple(c + base for c in part.children))))
    tails, leftover = _fill_tails([len(p.own) for _, p in planned], small, trees, seq_len)
    if uniform:
        _leftover_rows(planned, tails, leftover, trees, capacity, seq_len)
        leftover = []
    shape = _RowShape(seq_len, prefix_buckets, gdn_chunk_size, gdn_chunks, gdn_exports)
    rows = _rows(planned, tails, trees, fields, shape, row_lengths, row_steps_per_octave)
    if uniform:  # again, at the largest shapes of the first layout
        shape = dataclasses.replace(
            shape, gdn_chunks=None if gdn_chunk_size is None else max(
                r.inputs.gdn.chunk_tokens.shape[1] for r in rows),
            gdn_exports=None if gdn_chunk_size is None else max(
                r.inputs.gdn.export_slots.shape[1] for r in rows))
        rows = _rows(planned, tails, trees, fields, shape,
                     [max(r.inputs.shape[1] for r in rows)], row_steps_per_octave)
    parts = tuple(_link(rows, planned))
    whole = None
    if leftover:
        whole = build_microbatches([trees[i] for i in leftover], seq_len,
                                   rows_per_microbatch=rows_per_microbatch,
                                   normalization=normalization, normalizer=normalizer,
                                   gdn_chunk_size=gdn_chunk_size)
    return RfreeProgram(tuple(trees), parts, whole, tuple(leftover), capacity, normalization,
                        float(normalizer), disagreement)


def _rows(planned, tails: list[list[int]], trees, fields, shape: _RowShape,
          row_lengths: Sequence[int] | None, row_steps_per_octave: int) -> list[_Row]:
    """The rows of the planned parts (and the small trees packed after them), all with the
    prefix region of the longest prefix (one P per program: see the module docstring)."""
    prefix_len = max([prefix_bucket(len(p.prefix), shape.prefix_buckets) for _, p in planned],
                     default=0) or prefix_bucket(1, shape.prefix_buckets)
    rows = []
    for k, (_, part) in enumerate(planned):
        content = len(part.own) + sum(trees[i].n_tree_tokens for i in tails[k])
        row_shape = dataclasses.replace(shape, seq_len=row_length(
            content, shape.seq_len, row_lengths, row_steps_per_octave))
        rows.append(_part_row(planned, k, tails[k], trees, fields, row_shape, prefix_len))
    return rows


def _leftover_rows(planned: list[tuple[int, RfreePart]], tails: list[list[int]],
                   leftover: list[int], trees: Sequence[TrajectoryTree], capacity: int,
                   seq_len: int) -> None:
    """Small trees left over by `_fill_tails` laid out as rows of their own, first fit
    decreasing: the largest becomes a part without prefix or children (its one part of
    `plan_parts`), the next ones fill its spare room, and so on (appended to `planned` and
    `tails`)."""
    leftover = sorted(leftover, key=lambda i: -trees[i].n_tree_tokens)
    while leftover:
        i = leftover.pop(0)
        (part,) = plan_parts(trees[i], capacity)
        planned.append((i, part))
        more, leftover = _fill_tails([len(part.own)], leftover, trees, seq_len)
        tails.append(more[0])
        leftover = sorted(leftover, key=lambda i: -trees[i].n_tree_tokens)


def _fill_tails(part_sizes: list[int], small: list[int], trees: Sequence[TrajectoryTree],
                capacity: int) -> tuple[list[list[int]], list[int]]:
    """Small trees into the spare room of part rows (first fit decreasing); the rest left over."""
    room = [capacity - n for n in part_sizes]
    tails: list[list[int]] = [[] for _ in part_sizes]
    leftover = []
    for i in sorted(small, key=lambda i: -trees[i].n_tree_tokens):
        n = trees[i].n_tree_tokens
        k = next((k for k, r in enumerate(room) if n <= r), None)
        if k is None:
            leftover.append(i)
        else:
            tails[k].append(i)
            room[k] -= n
    return tails, sorted(leftover)


@dataclasses.dataclass(frozen=True)
class _RowShape:
    seq_len: int
    prefix_buckets: Sequence[int] | None
    gdn_chunk_size: int | None
    gdn_chunks: int | None
    gdn_exports: int | None


@dataclasses.dataclass
class _Row:
    """A part row before its prefix gather is known (it needs the parent's layout)."""

    inputs: DeviceBatch
    members: tuple[Member, ...]
    prefix: np.ndarray  # tree tokens of the prefix, root first
    prefix_len: int
    export_tokens: np.ndarray  # tree tokens whose GDN state is exported, in export order


def _part_row(planned, k: int, tail: list[int], trees, fields, shape: _RowShape,
              p: int) -> _Row:
    """Row of part k with a prefix region of `p` slots (its prefix at the end, padding before)."""
    tree_index, part = planned[k]
    prefix = part.prefix
    n_prefix = len(prefix)
    members = [Member(tree_index, part.own, 0)]
    offset = len(part.own)
    for i in tail:
        members.append(Member(i, np.arange(trees[i].n_tree_tokens, dtype=np.int32), offset))
        offset += trees[i].n_tree_tokens
    export_tokens = np.unique([planned[c][1].attach for c in part.children]).astype(np.int32)
    inputs, nodes = _row_arrays(members, trees, fields, shape.seq_len, p, part.attach)
    j = np.arange(p, dtype=np.int32)
    chain = j >= p - n_prefix
    inputs.mask.prefix_end[0] = np.where(chain, p + len(part.own), j + 1)
    inputs.prefix_pred[0] = np.where(chain & (j > p - n_prefix), j - 1, -1)
    if shape.gdn_chunk_size is not None:
        inputs = dataclasses.replace(inputs, gdn=_gdn_tables(nodes, shape, n_initial=2,
                                                             export_tokens=export_tokens))
    return _Row(inputs, tuple(members), prefix, p, export_tokens)


def _row_arrays(members: list[Member], trees, fields, capacity: int, p: int, attach: int):
    """[1, S] step inputs of a row (with an all-padding prefix layout of P slots), and its node
    pieces for the GDN tables."""
    inputs = padding(1, capacity, score_len=None, prefix_len=p)
    out = {name: a[0] for name, a in token_arrays(inputs).items()}  # views of the row
    node_parts: list[dict[str, np.ndarray]] = []
    node_base = 0
    for m in members:
        f = fields[m.tree]
        tok = m.tokens
        n = len(tok)
        dest = slice(m.offset, m.offset + n)
        for name in ("tokens", "pos", "path_count", *COEFFICIENT_FIELDS, "old_logprobs"):
            out[name][dest] = f[name][tok]
        out["valid"][dest] = True
        local_end = np.searchsorted(tok, f["end"][tok])
        out["end"][dest] = local_end + m.offset + p
        pred = f["pred"][tok]
        rank = np.searchsorted(tok, pred)
        inside = (pred >= 0) & (rank < n) & (tok[np.minimum(rank, n - 1)] == pred)
        outside = (pred >= 0) & ~inside
        if np.any(outside & (pred != attach)):
            raise AssertionError("a part's token is scored from outside its prefix")
        out["pred"][dest] = np.where(inside, rank + m.offset + p, np.where(outside, p - 1, -1))
        # Node pieces: runs of consecutive own tokens of one tree node.
        tree_node = f["node"][tok]
        first = np.r_[True, tree_node[1:] != tree_node[:-1]]
        piece = np.cumsum(first) - 1
        out["node"][dest] = piece + node_base
        starts = np.flatnonzero(first)
        lengths = np.diff(np.r_[starts, n])
        first_pred = pred[starts]
        parent_rank = rank[starts]
        has_parent = inside[starts]
        node_parts.append({
            "length": lengths, "start": starts + m.offset,
            "parent": np.where(has_parent, piece[np.minimum(parent_rank, n - 1)] + node_base, -1),
            "root_slot": np.where((first_pred >= 0) & ~has_parent, 1, 0),
            "last_token": tok[starts + lengths - 1],
            "of_part": np.full(len(starts), m is members[0]),
        })
        node_base += len(starts)
    nodes = {k: np.concatenate([d[k] for d in node_parts]) for k in node_parts[0]}
    return inputs, nodes


def _gdn_tables(nodes: dict[str, np.ndarray], shape: _RowShape, n_initial: int,
                export_tokens: np.ndarray) -> GdnTables:
    lengths = nodes["length"].astype(np.int64)
    chunk_size = shape.gdn_chunk_size
    n_chunks = shape.gdn_chunks or default_chunk_count(
        shape.seq_len, chunk_size, int(np.sum(-(-lengths // chunk_size))))
    built = node_chunk_tables(lengths, nodes["start"].astype(np.int64),
                              np.zeros(len(lengths), np.int64), nodes["parent"].astype(np.int64),
                              nodes["root_slot"].astype(np.int64), 1, shape.seq_len, chunk_size,
                              n_chunks, n_initial=n_initial)
    # The attach token of a child part is the last token of one of the part's own node pieces
    # (tree-token indices of the whole trees packed after it would collide).
    piece_of = {int(t): i for i, t in enumerate(nodes["last_token"]) if nodes["of_part"][i]}
    slots = [int(built["last_slot"][piece_of[int(t)]]) for t in export_tokens]
    width = shape.gdn_exports or (1 if len(slots) <= 1 else 1 << (len(slots) - 1).bit_length())
    if len(slots) > width:
        raise ValueError(f"gdn_exports={width}: a part has {len(slots)} child parts starting "
                         "below different tokens")
    slots = (slots + [slots[0] if slots else 0] * width)[:width]
    return dataclasses.replace(built["tables"], export_slots=np.asarray(slots, np.int32)[None])


def _link(rows: list[_Row], planned) -> list[PartBatch]:
    """PartBatches with each part's gather from its parent's combined coordinates."""
    out = []
    for k, row in enumerate(rows):
        part = planned[k][1]
        gather_index = gather_state = None
        if part.parent >= 0:
            par, par_part = rows[part.parent], planned[part.parent][1]
            n_par = len(par.prefix)
            n = len(row.prefix)
            coords = np.empty(n, np.int32)
            coords[:n_par] = par.prefix_len - n_par + np.arange(n_par)
            rest = row.prefix[n_par:]
            rank = np.searchsorted(par_part.own, rest)
            if not np.array_equal(par_part.own[np.minimum(rank, len(par_part.own) - 1)], rest):
                raise AssertionError("a part's prefix leaves its parent's tokens")
            coords[n_par:] = par.prefix_len + rank
            gather_index = np.concatenate([np.full(row.prefix_len - n, -1, np.int32),
                                           coords])[None]
            gather_state = np.searchsorted(par.export_tokens, part.attach).astype(np.int32)[None]
        out.append(PartBatch(row.inputs, part.parent, part.children, gather_index, gather_state,
                             row.members))
    return out
