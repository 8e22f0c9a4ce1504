"""The input pipeline: JSONL -> trees -> per-step, per-host linearized arrays (grain).

Loading (`load_trees`) reads sequence groups, explicit trees or chat conversations (UTF-8),
validating every record; a bad record either stops the run with its `file:line` or, with
`on_bad_record="skip"`, is skipped and counted. A record with a path longer than a row is bad in
the modes that train whole paths in rows (`max_path_len`), not in `redundancy_free`, which splits
long paths.

Batching (`make_pipeline`) is a grain `MapDataset`: tree indices shuffled by seed (reshuffled
every epoch), grouped `trees_per_step` at a time, then mapped by `StepBuilder` to this host's
arrays. A tree larger than a row is cut into capacity parts (`jtree.partition`); the baseline
packs paths. Every host computes the same global step (so all hosts agree on shapes and
statistics without talking to each other), balances the step's units over the global data shards
x micro-batches (`jtree.balance`) and linearizes only the shards its devices hold. Loss
coefficients stay raw (normalizer 1) and `row_norm` carries each row's share of the normalizer;
the train step divides by the global sum (`jtree.train_step.normalize_coefficients`), so no host needs
another host's trees. The iterator state is grain's and is saved with every checkpoint.

Models with linear-attention layers also get the gated-delta-rule chunk tables
(`BatchPlan.gdn_chunk_size`). All micro-batches and shards of a step share one chunk capacity:
the bucket (`jtree.chunk_tables.default_chunk_count`) of the most chunks any row of the global
step needs, which every host computes alike; or a fixed `gdn_chunks` for the whole run.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import grain
import numpy as np

from jtree.balance import assign_to_ranks
from jtree.baseline import flatten_paths
from jtree.batch import DeviceBatch, concatenate_rows, padding, stack
from jtree.chat import conversation_tree, load_tokenizer
from jtree.chunk_tables import chunks_needed, default_chunk_count
from jtree.cost import FlopModel, choose_mode, tree_work
from jtree.linearize import aligned_score_len, linearize, pack_rows
from jtree.loss import Normalization, batch_normalizer
from jtree.packing import plan_rows as plan_packed_rows
from jtree.partition import Method as PartitionMethod
from jtree.partition import partition
from jtree.rfree.layout import ROW_STEPS_PER_OCTAVE, build_program
from jtree.tree import TrajectoryTree
from jtree.tree_jsonl import (
    check_group_line, group_key, iter_lines, parse_line, tree_from_group, tree_from_record,
)

Mode = Literal["tree", "baseline"]


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What loading read: records (lines), trees built, and the skipped bad records."""

    n_lines: int
    n_trees: int
    n_bad: int
    first_errors: tuple[str, ...]


class _BadRecords:
    """Raise on the first bad record, or count it (keeping the first few messages)."""

    def __init__(self, policy: str, keep: int = 5):
        if policy not in ("raise", "skip"):
            raise ValueError(f"on_bad_record: {policy!r} is not 'raise' or 'skip'")
        self.policy, self.keep = policy, keep
        self.count, self.errors = 0, []

    def __call__(self, error: ValueError, lines: int = 1) -> None:
        if self.policy == "raise":
            raise error
        self.count += lines
        if len(self.errors) < self.keep:
            self.errors.append(str(error))


def check_path_lengths(tree: TrajectoryTree, wheres: Sequence[str], record_id: Any,
                       max_path_len: int | None) -> TrajectoryTree:
    """`tree`, or a ValueError naming the record when its longest path does not fit a row of
    `max_path_len` tokens (None: no limit), with the two ways out. `wheres`: the `file:line` of
    each path (one entry: of the whole tree)."""
    longest = int(np.argmax(tree.path_lengths))
    n = int(tree.path_lengths[longest])
    if max_path_len is not None and n > max_path_len:
        where = wheres[longest] if len(wheres) > 1 else wheres[0]
        named = "" if record_id is None else f" (id {json.dumps(record_id)})"
        raise ValueError(f"{where}{named}: path {longest} has {n} tokens, more than a row holds "
                         f"(data.seq_len={max_path_len}); raise data.seq_len, or train with "
                         "run.mode=redundancy_free, which splits long paths")
    return tree


# The fields that make a record one of each format: what tells a file in another format apart.
FORMAT_FIELDS = {"groups": ("group", "tokens"), "trees": ("parents", "segments"),
                 "chat": ("messages",)}


def record_format(rec: dict[str, Any]) -> str | None:
    """The format whose required fields `rec` has (None: no format's, or several)."""
    found = [f for f, fields in FORMAT_FIELDS.items() if all(k in rec for k in fields)]
    return found[0] if len(found) == 1 else None


def _check_format(path: str | Path, fmt: str, format_key: str) -> None:
    """Refuse a file whose first record is of another format in one line naming the option, rather
    than a missing-field error on every record (a file is read in the format it is told)."""
    for where, line in iter_lines(path):
        try:
            found = record_format(parse_line(where, line))
        except ValueError:  # an unreadable first record is reported as a bad record
            return
        if found is not None and found != fmt:
            raise ValueError(f"{where}: a {found!r} record ({', '.join(FORMAT_FIELDS[found])}), "
                             f"but the file is read as {fmt!r}: set {format_key}={found}")
        return


def load_trees(path: str | Path, fmt: str, *, vocab_size: int | None,
               on_bad_record: str = "raise", tokenizer: str = "bytes",
               max_path_len: int | None = None, format_key: str = "data.format",
               ) -> tuple[list[TrajectoryTree], LoadReport]:
    """Every tree of a JSONL file, validated; see the module docstring for bad records.
    `max_path_len`: the longest path a row holds in the run's mode (None: no limit). A file of
    another format is refused naming `format_key` (the option that sets `fmt`)."""
    _check_format(path, fmt, format_key)
    bad = _BadRecords(on_bad_record)
    trees: list[TrajectoryTree] = []
    n_lines = 0
    if fmt == "groups":
        groups: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        for where, line in iter_lines(path):
            n_lines += 1
            try:
                rec = parse_line(where, line)
                check_group_line(where, rec)
                tree_from_group([(where, rec)], vocab_size=vocab_size)  # the line on its own
            except ValueError as e:
                bad(e)
                continue
            groups.setdefault(group_key(rec), []).append((where, rec))
        for members in groups.values():
            try:
                tree = tree_from_group(members, vocab_size=vocab_size)  # path p: line p
                trees.append(check_path_lengths(tree, [w for w, _ in members],
                                                members[0][1]["group"], max_path_len))
            except ValueError as e:  # the group as a whole is bad: count all its lines
                bad(e, lines=len(members))
    elif fmt in ("trees", "chat"):
        tok = load_tokenizer(tokenizer) if fmt == "chat" else None
        if tok is not None and vocab_size is not None and tok.vocab_size > vocab_size:
            raise ValueError(f"tokenizer: {tokenizer} has {tok.vocab_size} tokens, more than "
                             f"model.vocab_size={vocab_size}")
        for where, line in iter_lines(path):
            n_lines += 1
            try:
                rec = parse_line(where, line)
                tree = (tree_from_record(where, rec, vocab_size=vocab_size) if tok is None
                        else conversation_tree(rec, tok, where=where, vocab_size=vocab_size))
                trees.append(check_path_lengths(tree, [where], rec.get("id"), max_path_len))
            except ValueError as e:
                bad(e)
    else:
        raise ValueError(f"format: {fmt!r} is not one of ('groups', 'trees', 'chat')")
    if not trees:
        raise ValueError(f"{path}: no usable records ({bad.count} bad)"
                         + (f"; first: {bad.errors[0]}" if bad.errors else ""))
    return trees, LoadReport(n_lines, len(trees), bad.count, tuple(bad.errors))


# ---------------------------------------------------------------------- step batching


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """Static shape of every step: `shards` are the global data-shard indices this host feeds,
    out of `n_shards`; each gets `micro_batches` micro-batches of `rows` rows of `seq_len`.
    `gdn_chunk_size`: add GDN chunk tables of that chunk size, with `gdn_chunks` chunks per row
    (None: per step, see the module docstring)."""

    mode: Mode
    normalization: Normalization
    seq_len: int
    trees_per_step: int
    micro_batches: int
    n_shards: int
    shards: tuple[int, ...]
    rows: int
    gdn_chunk_size: int | None = None
    gdn_chunks: int | None = None


def training_units(tree: TrajectoryTree, mode: Mode, seq_len: int,
                   method: PartitionMethod = "heuristic") -> list[TrajectoryTree]:
    """What gets packed into rows: the tree, its capacity parts when it is larger than a row
    (`jtree.partition` with `method`, exact: each path owned by one part), or its paths
    (baseline)."""
    if mode == "baseline":
        return flatten_paths([tree])
    if tree.n_tree_tokens <= seq_len:
        return [tree]
    return list(partition(tree, seq_len, method).parts)


def step_bins(units: Sequence[TrajectoryTree], n_bins: int) -> list[list[int]]:
    """Units of one step balanced over the data shards x micro-batches (`jtree.balance`)."""
    return [list(r) for r in assign_to_ranks([u.n_tree_tokens for u in units], n_bins).ranks]


def rows_needed(units: Sequence[TrajectoryTree], seq_len: int) -> int:
    """Rows of `seq_len` that first-fit-decreasing packing needs for `units`."""
    if not units:
        return 0
    return plan_packed_rows([u.n_tree_tokens for u in units], seq_len).n_rows


def step_gdn_chunks(bins: Sequence[Sequence[TrajectoryTree]], seq_len: int,
                    chunk_size: int) -> int:
    """The chunk capacity of every row of a step whose bins (micro-batches of all shards) hold
    `bins`: the bucket of the most chunks any row needs, rows packed as `linearize` packs them."""
    needed = 0
    for units in bins:
        if not units:
            continue
        rows = pack_rows([u.n_tree_tokens for u in units], seq_len)
        tree_row = np.empty(len(units), np.int64)
        for r, members in enumerate(rows):
            tree_row[members] = r
        needed = max(needed, int(chunks_needed(units, tree_row, len(rows), chunk_size).max()))
    return default_chunk_count(seq_len, chunk_size, needed)


def step_info(trees: Sequence[TrajectoryTree], units: Sequence[TrajectoryTree]
              ) -> dict[str, np.ndarray]:
    """Global statistics of a step (every host computes them from the same trees)."""
    stats = sum((t.stats() for t in trees[1:]), trees[0].stats())
    has_old = all(t.old_logprobs is not None for t in trees)
    disagreement = 0.0
    if has_old:
        for t in trees:  # position 0 is never scored, as in `linearize`
            old = [np.concatenate([[0.0], o[1:]]) for o in t.old_logprobs]
            disagreement = max(disagreement, t.tree_token_values(old)[1])
    return {
        "n_trees": np.int64(len(trees)), "n_paths": np.int64(stats.n_paths),
        "n_tree_tokens": np.int64(stats.n_tree_tokens),
        "n_flat_tokens": np.int64(stats.n_flat_tokens),
        "n_computed_tokens": np.int64(sum(u.n_tree_tokens for u in units)),
        "has_old_logprobs": np.bool_(has_old),
        "old_logprob_disagreement": np.float64(disagreement),
    }


class StepBuilder:
    """Grain transform: the tree indices of one global step -> this host's step inputs.

    Output: `{"inputs": DeviceBatch [micro_batches, rows * len(shards), seq_len] with `row_norm`,
    "info": step_info(...)}`. `units[i]` are the training units of `trees[i]` (`all_units`).
    """

    def __init__(self, trees: Sequence[TrajectoryTree], units: Sequence[Sequence[TrajectoryTree]],
                 plan: BatchPlan):
        self.trees, self.units, self.plan = list(trees), list(units), plan
        self.scored = [[tree_work([u])[0].scored for u in us] for us in self.units]

    def __call__(self, indices: np.ndarray) -> dict[str, Any]:
        plan = self.plan
        units = [u for i in indices for u in self.units[int(i)]]
        scored = [n for i in indices for n in self.scored[int(i)]]
        index_bins = step_bins(units, plan.n_shards * plan.micro_batches)
        score_len = self._score_len(units, scored, index_bins)
        bins = [[units[i] for i in b] for b in index_bins]
        gdn_chunks = plan.gdn_chunks
        if plan.gdn_chunk_size is not None and gdn_chunks is None:
            gdn_chunks = step_gdn_chunks(bins, plan.seq_len, plan.gdn_chunk_size)
        micro = []
        for m in range(plan.micro_batches):
            parts = [self._linearize(bins[s * plan.micro_batches + m], score_len, gdn_chunks)
                     for s in plan.shards]
            micro.append(concatenate_rows(parts))
        info = step_info([self.trees[int(i)] for i in indices], units)
        return {"inputs": stack(micro), "info": info}

    def _score_len(self, units: list[TrajectoryTree], scored: list[int],
                   bins: list[list[int]]) -> int:
        """The `score_index` width of this step, the same on every host: the most scored tokens
        of any row of any (global) bin, packed as `linearize` packs them."""
        need = 0
        for b in bins:
            for row in pack_rows([units[i].n_tree_tokens for i in b], self.plan.seq_len):
                need = max(need, sum(scored[b[j]] for j in row))
        return aligned_score_len(need, self.plan.seq_len)

    def _linearize(self, units: list[TrajectoryTree], score_len: int, gdn_chunks: int | None
                   ) -> DeviceBatch:
        plan = self.plan
        if not units:  # a bin that got no tree
            empty = padding(plan.rows, plan.seq_len, score_len=score_len,
                            gdn_chunk_size=plan.gdn_chunk_size, gdn_chunks=gdn_chunks)
            return dataclasses.replace(empty, row_norm=np.zeros(plan.rows, np.float32))
        batch = linearize(units, plan.seq_len, normalization=plan.normalization, normalizer=1.0,
                          n_rows=plan.rows, score_len=score_len,
                          gdn_chunk_size=plan.gdn_chunk_size, gdn_chunks=gdn_chunks)
        row_norm = np.zeros(plan.rows, np.float64)
        for t, r in zip(batch.layout.trees, batch.layout.rows):
            row_norm[r] += batch_normalizer([t], plan.normalization)
        return dataclasses.replace(batch.inputs, row_norm=row_norm.astype(np.float32))


class AutoStepBuilder:
    """Grain transform that trains each step in tree mode or in baseline mode, whichever the cost
    model (`jtree.cost.choose_mode`) predicts faster: baseline when the predicted gain of tree
    mode is below `min_gain` (little sharing, so the tree layout's padding and partitioning
    cannot pay). Both modes give the same loss and gradients; the choice only changes speed.
    `builders` maps "tree" and "baseline" to their `StepBuilder`s (same trees, each with its own
    step shape). `info` gains the chosen `mode`, the `predicted_gain` and the `mode_reason`.
    """

    def __init__(self, builders: dict[str, StepBuilder], flop_model: FlopModel,
                 min_gain: float):
        if set(builders) != {"tree", "baseline"}:
            raise ValueError(f"builders: need 'tree' and 'baseline', got {sorted(builders)}")
        self.builders, self.flop_model, self.min_gain = builders, flop_model, min_gain
        self.trees = builders["tree"].trees
        self.plan = builders["tree"].plan

    def padded_tokens(self, mode: str) -> int:
        """Positions one step of `mode` computes over all data shards (its static shape)."""
        p = self.builders[mode].plan
        return p.n_shards * p.micro_batches * p.rows * p.seq_len

    def __call__(self, indices: np.ndarray) -> dict[str, Any]:
        choice = choose_mode(self.flop_model, [self.trees[int(i)] for i in indices],
                             tree_tokens=self.padded_tokens("tree"),
                             baseline_tokens=self.padded_tokens("baseline"),
                             min_gain=self.min_gain)
        element = self.builders[choice.mode](indices)
        element["info"] = dict(element["info"], mode=choice.mode,
                               predicted_gain=np.float64(choice.predicted_gain),
                               mode_reason=choice.reason)
        return element


@dataclasses.dataclass(frozen=True)
class RfreePlan:
    """What every redundancy-free step is built with (`RfreeStepBuilder`)."""

    normalization: Normalization
    seq_len: int
    capacity: int
    trees_per_step: int
    gdn_chunk_size: int | None = None
    row_steps_per_octave: int = ROW_STEPS_PER_OCTAVE


class RfreeStepBuilder:
    """Grain transform for `run.mode=redundancy_free`: the tree indices of one step -> the step's
    `jtree.rfree` program (`{"program": RfreeProgram, "info": step_info(...)}`), run part by part
    on one device by `jtree.rfree.execute.RedundancyFreeStep`."""

    def __init__(self, trees: Sequence[TrajectoryTree], plan: RfreePlan):
        self.trees, self.plan = list(trees), plan

    def __call__(self, indices: np.ndarray) -> dict[str, Any]:
        trees = [self.trees[int(i)] for i in indices]
        plan = self.plan
        program = build_program(trees, plan.capacity, seq_len=plan.seq_len,
                                normalization=plan.normalization,
                                gdn_chunk_size=plan.gdn_chunk_size,
                                row_steps_per_octave=plan.row_steps_per_octave)
        info = dict(step_info(trees, trees), n_computed_tokens=np.int64(program.n_computed))
        return {"program": program, "info": info}


def step_indices(n_trees: int, trees_per_step: int, seed: int) -> grain.MapDataset:
    """Tree indices of every step: a seeded shuffle of all trees, reshuffled every epoch."""
    return (grain.MapDataset.range(n_trees).seed(seed).shuffle().repeat()
            .batch(trees_per_step, drop_remainder=True))


def all_units(trees: Sequence[TrajectoryTree], mode: Mode, seq_len: int,
              method: PartitionMethod = "heuristic") -> list[list[TrajectoryTree]]:
    """`training_units` of every tree, computed once for the run."""
    return [training_units(t, mode, seq_len, method) for t in trees]


def rows_for_run(units: Sequence[Sequence[TrajectoryTree]], seq_len: int, trees_per_step: int,
                 n_bins: int, seed: int, steps: int) -> int:
    """The fewest rows per micro-batch that hold every one of the first `steps` steps."""
    index = step_indices(len(units), trees_per_step, seed)
    most = 1
    for k in range(steps):
        step_units = [u for i in index[k] for u in units[int(i)]]
        for b in step_bins(step_units, n_bins):
            most = max(most, rows_needed([step_units[i] for i in b], seq_len))
    return most


def make_pipeline(builder: StepBuilder | AutoStepBuilder | RfreeStepBuilder, *, seed: int,
                  worker_count: int = 0) -> grain.IterDataset:
    """Step inputs for this host, in step order (iterate it, checkpoint its iterator state)."""
    ds = step_indices(len(builder.trees), builder.plan.trees_per_step, seed).map(builder)
    it_ds = ds.to_iter_dataset()
    if worker_count > 0:
        from absl import flags  # grain's workers read absl flags, which a script never parses

        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=worker_count),
                                  worker_init_fn=_exit_with_parent)
    return it_ds


def _exit_with_parent(worker_index: int, worker_count: int) -> None:
    """Grain worker start-up: exit when the training process is gone (a SIGKILLed trainer gives
    its workers no chance to stop them, and they would hold its output pipes open)."""
    import os
    import threading
    import time

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()
