"""Reading a run's trees from JSONL: sequence groups, explicit trees, chat conversations or engine
traces (UTF-8).

Every record is validated, and the objective's needs are met as it is read (advantages from
rewards, GSPO's shared masks: `jtree.objectives.advantages.for_objective`). A bad record either
stops the run with its `file:line` or, with `on_bad_record="skip"`, is skipped and counted. A
record with a path longer than a row is bad in the modes that train whole paths in rows
(`max_path_len`), not in `redundancy_free`, which splits long paths. A trace rollout whose turns
drift and is branched (`trace_drift="branch"`) is not bad, but counted and reported; so are the
length-truncated turns (`truncated`) and the rollouts left out for a truncated or aborted turn
(`truncated="drop"`, `aborted="drop"`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jtree.config.objective import Estimator
from jtree.objectives.advantages import for_objective
from jtree.trees.chat import conversation_tree, load_tokenizer
from jtree.trees.jsonl import (
    Prepare,
    check_group_line,
    group_key,
    iter_lines,
    parse_line,
    tree_from_group,
    tree_from_record,
)
from jtree.trees.routed_experts import Experts
from jtree.trees.traces import Rollout, path_wheres, read_rollout, tree_from_rollouts
from jtree.trees.tree import TrajectoryTree


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What loading read: records (lines), trees built, the skipped bad records, the trace
    rollouts branched where their turns drift (`n_branched`, the first few messages), the
    trace turns the engine cut at its length limit (`n_truncated`, kept as `truncated` says) and
    the rollouts left out for a truncated or aborted turn (`n_dropped`, the first few
    messages)."""

    n_lines: int
    n_trees: int
    n_bad: int
    first_errors: tuple[str, ...]
    n_branched: int = 0
    first_branches: tuple[str, ...] = ()
    n_truncated: int = 0
    truncated: str = "mask"
    n_dropped: int = 0
    first_dropped: tuple[str, ...] = ()


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
                 "chat": ("messages",), "traces": ("group", "turns")}


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


@dataclasses.dataclass
class _Reading:
    """One file being read: the options every record is read with, and what has been read."""

    vocab_size: int | None
    max_path_len: int | None
    prepare: Prepare
    bad: _BadRecords
    trees: list[TrajectoryTree] = dataclasses.field(default_factory=list)
    n_lines: int = 0
    branched: list[str] = dataclasses.field(default_factory=list)
    n_truncated: int = 0
    dropped: list[str] = dataclasses.field(default_factory=list)

    def lines(self, path: str | Path) -> Iterator[tuple[str, dict[str, Any]]]:
        """(where, record) of every line that parses as a JSON object; the others are bad."""
        for where, line in iter_lines(path):
            self.n_lines += 1
            try:
                yield where, parse_line(where, line)
            except ValueError as e:
                self.bad(e)

    def keep(self, tree: TrajectoryTree, wheres: Sequence[str], record_id: Any) -> None:
        self.trees.append(check_path_lengths(tree, wheres, record_id, self.max_path_len))

    def groups(self, path: str | Path) -> None:
        groups: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        for where, rec in self.lines(path):
            try:
                check_group_line(where, rec)
                tree_from_group([(where, rec)], vocab_size=self.vocab_size)  # the line alone
            except ValueError as e:
                self.bad(e)
                continue
            groups.setdefault(group_key(rec), []).append((where, rec))
        for members in groups.values():
            try:  # path p: line p
                tree = tree_from_group(members, vocab_size=self.vocab_size, prepare=self.prepare)
                self.keep(tree, [w for w, _ in members], members[0][1]["group"])
            except ValueError as e:  # the group as a whole is bad: count all its lines
                self.bad(e, lines=len(members))

    def traces(self, path: str | Path, drift: str, experts: Experts | None, truncated: str,
               aborted: str) -> None:
        rollouts: dict[str, list[Rollout]] = {}
        for where, rec in self.lines(path):
            try:
                rollout = read_rollout(where, rec, vocab_size=self.vocab_size, drift=drift,
                                       experts=experts, truncated=truncated, aborted=aborted)
            except ValueError as e:
                self.bad(e)
                continue
            self.n_truncated += rollout.truncated
            if rollout.dropped is not None:
                self.dropped.append(rollout.dropped)
                continue
            self.branched.extend(rollout.drifts[:1])
            rollouts.setdefault(group_key(rec), []).append(rollout)
        for members in rollouts.values():
            try:
                tree = tree_from_rollouts(members, vocab_size=self.vocab_size,
                                          prepare=self.prepare)
                self.keep(tree, path_wheres(members), members[0].group)
            except ValueError as e:  # the group as a whole is bad: count all its lines
                self.bad(e, lines=len(members))

    def records(self, path: str | Path, tok: Any, advantage: Estimator | None) -> None:
        """One tree per line: explicit trees, or chat conversations tokenized with `tok`."""
        for where, rec in self.lines(path):
            try:
                if tok is None:
                    tree = tree_from_record(where, rec, vocab_size=self.vocab_size,
                                            prepare=self.prepare)
                else:
                    tree = conversation_tree(rec, tok, where=where, vocab_size=self.vocab_size)
                    if advantage is not None:  # chat records carry neither rewards nor advantages
                        raise ValueError(f"{where}: chat records carry no reward or advantage, "
                                         f"which objective.advantage={advantage} needs")
                self.keep(tree, [where], rec.get("id"))
            except ValueError as e:
                self.bad(e)


def load_trees(path: str | Path, fmt: str, *, vocab_size: int | None,
               on_bad_record: str = "raise", tokenizer: str = "bytes",
               max_path_len: int | None = None, format_key: str = "data.format",
               advantage: Estimator | None = None, shared_masks: bool = False,
               turn_discount: float = 1.0, trace_drift: str = "reject",
               experts: Experts | None = None, truncated: str = "mask",
               aborted: str = "refuse") -> tuple[list[TrajectoryTree], LoadReport]:
    """Every tree of a JSONL file, validated; see the module docstring for bad records.
    `max_path_len`: the longest path a row holds in the run's mode (None: no limit). A file of
    another format is refused naming `format_key` (the option that sets `fmt`). `advantage`: the
    estimator that gives every tree its advantages (`jtree.objectives.advantages`; None: the
    objective needs none; `turn` discounts by `turn_discount`); a record without the rewards or
    advantages it needs (or whose per-turn rewards do not match its turns) is a bad record, and so
    is one whose paths disagree on the loss mask of a shared token when `shared_masks` (GSPO).
    `trace_drift`: what a trace rollout whose turns drift is (`jtree.trees.traces`); `experts`:
    the model's routing, that traces' routed experts must fit (a bad record otherwise);
    `truncated` and `aborted`: what a trace turn the engine cut at its length limit or aborted
    makes of its rollout (`jtree.trees.traces.read_rollout`)."""
    _check_format(path, fmt, format_key)
    prepare = functools.partial(for_objective, advantage=advantage, shared_masks=shared_masks,
                                turn_discount=turn_discount)
    reading = _Reading(vocab_size, max_path_len, prepare, _BadRecords(on_bad_record))
    if fmt == "groups":
        reading.groups(path)
    elif fmt == "traces":
        reading.traces(path, trace_drift, experts, truncated, aborted)
    elif fmt in ("trees", "chat"):
        tok = load_tokenizer(tokenizer) if fmt == "chat" else None
        if tok is not None and vocab_size is not None and tok.vocab_size > vocab_size:
            raise ValueError(f"tokenizer: {tokenizer} has {tok.vocab_size} tokens, more than "
                             f"model.vocab_size={vocab_size}")
        reading.records(path, tok, advantage)
    else:
        raise ValueError(f"format: {fmt!r} is not one of {tuple(FORMAT_FIELDS)}")
    bad, branched, dropped = reading.bad, reading.branched, reading.dropped
    if not reading.trees:
        raise ValueError(f"{path}: no usable records ({bad.count} bad, {len(dropped)} dropped)"
                         + (f"; first: {bad.errors[0]}" if bad.errors else "")
                         + (f"; first dropped: {dropped[0]}" if dropped else ""))
    return reading.trees, LoadReport(reading.n_lines, len(reading.trees), bad.count,
                                     tuple(bad.errors), len(branched),
                                     tuple(branched[:bad.keep]), reading.n_truncated, truncated,
                                     len(dropped), tuple(dropped[:bad.keep]))
