"""JSON Lines files of trees and of sequence groups.

Sequence groups: one sequence per line, `{"group": g, "tokens": [...], "loss_mask": [...],
"advantage": a | [...], "reward": r | [r_1, ..., r_T], "old_logprobs": [...], "weight": w}` (all but
`group` and `tokens` optional); all lines of one group merge into one tree, groups in order of
first appearance.

Trees: one tree per line, `{"parents": [...], "segments": [[...], ...], "paths": [{"node": n,
"loss_mask": [...], "advantage": ..., "reward": ..., "old_logprobs": [...], "weight": w}, ...]}`
(`paths` optional: one path per leaf). Errors name the file, line and field.

`reward` is a path's scalar reward, or a list of per-turn rewards of a multi-turn path, which add
up to the path's reward (the `turn` estimator credits each turn with its own and later ones).
The record readers take a `prepare` step run on each tree as it is read (the training pipeline
computes advantages from the rewards and checks what the objective needs there); its errors are
located in the file like the readers' own.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jtree.trees import json_values as jv
from jtree.trees.tree import TrajectoryTree

# What a reader runs on each tree it reads (advantages, objective checks); may raise ValueError.
Prepare = Callable[[TrajectoryTree], TrajectoryTree]

_PATH_FIELDS = {"loss_mask": "loss_masks", "advantage": "advantages", "reward": "rewards",
                "old_logprobs": "old_logprobs"}
# The JSON type of every optional per-path field (of a group line and of a tree's path).
_PATH_FIELD_TYPES = {"loss_mask": jv.integers, "advantage": jv.number_or_numbers,
                     "reward": jv.number_or_numbers, "old_logprobs": jv.numbers,
                     "weight": jv.number}


def iter_lines(path: str | Path) -> Iterator[tuple[str, bytes]]:
    """(`file:line`, raw bytes) for every non-blank line. Lines are decoded by `parse_line`, so a
    byte that is not UTF-8 is a bad record at its line, not the end of the file."""
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                yield f"{path}:{n}", line


def parse_line(where: str, line: bytes) -> dict[str, Any]:
    """One UTF-8 JSON object; errors name `where`."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 (byte 0x{line[e.start]:02x} at column "
                         f"{e.start + 1})") from None
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object")
    return rec


def _records(path: str | Path) -> Iterator[tuple[str, dict[str, Any]]]:
    for where, line in iter_lines(path):
        yield where, parse_line(where, line)


def _path_kwargs(items: Sequence[dict[str, Any]], where: Sequence[str]) -> dict[str, Any]:
    """Collect optional per-path fields; a field must be present on all paths or on none."""
    kwargs: dict[str, Any] = {}
    for field, kw in _PATH_FIELDS.items():
        present = [field in it for it in items]
        if any(present) and not all(present):
            missing = where[present.index(False)]
            raise ValueError(f"{missing}: {field} is missing but other paths of the tree have it")
        if all(present):
            kwargs[kw] = [it[field] for it in items]
    if any("weight" in it for it in items):
        kwargs["weights"] = [it.get("weight", 1.0) for it in items]
    return kwargs


def _check_path_fields(item: dict[str, Any], what: str) -> None:
    """The JSON types of the optional per-path fields `item` has (`jtree.trees.json_values`)."""
    for field, check in _PATH_FIELD_TYPES.items():
        if field in item:
            check(item[field], f"{what}: {field}")


def check_group_line(where: str, rec: dict[str, Any]) -> None:
    """Field names and JSON types of one sequence-group line."""
    for field in ("group", "tokens"):
        if field not in rec:
            raise ValueError(f"{where}: missing field {field!r}")
    unknown = set(rec) - {"group", "tokens", "weight", *_PATH_FIELDS}
    if unknown:
        raise ValueError(f"{where}: unknown field {sorted(unknown)[0]!r}")
    jv.group(rec["group"], f"{where}: group")
    jv.integers(rec["tokens"], f"{where}: tokens")
    _check_path_fields(rec, where)


def group_key(rec: dict[str, Any]) -> str:
    return json.dumps(rec["group"])


def tree_from_group(members: Sequence[tuple[str, dict[str, Any]]], *,
                    vocab_size: int | None = None, prepare: Prepare | None = None
                    ) -> TrajectoryTree:
    """Merge the lines of one group (`(where, record)` pairs) into a tree, then run `prepare` on
    it (an error naming path p is reported at line p)."""
    wheres = [w for w, _ in members]
    recs = [r for _, r in members]
    try:
        tree = TrajectoryTree.from_sequences(
            [r["tokens"] for r in recs], vocab_size=vocab_size, **_path_kwargs(recs, wheres))
    except ValueError as e:
        raise ValueError(_locate(str(e), "sequence", wheres)) from None
    try:
        return tree if prepare is None else prepare(tree)
    except ValueError as e:
        raise ValueError(_locate(str(e), "path", wheres)) from None


def read_sequence_groups(path: str | Path, *, vocab_size: int | None = None) -> list[TrajectoryTree]:
    """One tree per group id, in order of first appearance."""
    groups: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for where, rec in _records(path):
        check_group_line(where, rec)
        groups.setdefault(group_key(rec), []).append((where, rec))
    trees = [tree_from_group(members, vocab_size=vocab_size) for members in groups.values()]
    if not trees:
        raise ValueError(f"{path}: no sequences")
    return trees


def _locate(message: str, label: str, wheres: Sequence[str]) -> str:
    """Rewrite a 'sequence 3: ...' message from the tree builder into 'file:line: ...'."""
    prefix, sep, rest = message.partition(": ")
    parts = prefix.split(" ")
    if sep and len(parts) == 2 and parts[0] == label and parts[1].isdigit():
        i = int(parts[1])
        if i < len(wheres):
            return f"{wheres[i]}: {rest}"
    return f"{wheres[0]} (group starting here): {message}"


def write_sequence_groups(path: str | Path, trees: Sequence[TrajectoryTree]) -> None:
    """Write every path of every tree as one line; tree k becomes group k."""
    with open(path, "w", encoding="utf-8") as f:
        for k, t in enumerate(trees):
            for p in range(t.n_paths):
                rec: dict[str, Any] = {"group": k, "tokens": t.path_tokens(p).tolist()}
                rec.update(_path_record(t, p))
                f.write(json.dumps(rec) + "\n")


def _path_record(t: TrajectoryTree, p: int) -> dict[str, Any]:
    rec: dict[str, Any] = {"loss_mask": t.loss_masks[p].astype(int).tolist()}
    if t.advantages is not None:
        a = t.advantages[p]
        rec["advantage"] = float(a[0]) if np.all(a == a[0]) else a.tolist()
    if t.turn_rewards is not None:
        r = t.turn_rewards[p]
        rec["reward"] = float(r[0]) if r.size == 1 else r.tolist()
    if t.old_logprobs is not None:
        rec["old_logprobs"] = t.old_logprobs[p].tolist()
    rec["weight"] = float(t.weights[p])
    return rec


def tree_from_record(where: str, rec: dict[str, Any], *, vocab_size: int | None = None,
                     prepare: Prepare | None = None) -> TrajectoryTree:
    """One explicit tree from its JSON record, then `prepare` run on it; errors name `where`."""
    for field in ("parents", "segments"):
        if field not in rec:
            raise ValueError(f"{where}: missing field {field!r}")
    unknown = set(rec) - {"parents", "segments", "paths", "id"}
    if unknown:
        raise ValueError(f"{where}: unknown field {sorted(unknown)[0]!r}")
    jv.integers(rec["parents"], f"{where}: parents")
    jv.integers(rec["segments"], f"{where}: segments", depth=2)
    kwargs: dict[str, Any] = {}
    if "paths" in rec:
        paths = jv.json_list(rec["paths"], f"{where}: paths", "a list of paths")
        for i, p in enumerate(paths):
            jv.json_object(p, f"{where}: path {i}")
            if "node" not in p:
                raise ValueError(f"{where}: path {i}: missing field 'node'")
            jv.integer(p["node"], f"{where}: path {i}: node")
            _check_path_fields(p, f"{where}: path {i}")
        kwargs["path_nodes"] = [p["node"] for p in paths]
        kwargs.update(_path_kwargs(paths, [f"{where}: path {i}" for i in range(len(paths))]))
    try:
        tree = TrajectoryTree.from_nodes(rec["parents"], rec["segments"], vocab_size=vocab_size,
                                         **kwargs)
        return tree if prepare is None else prepare(tree)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def read_trees(path: str | Path, *, vocab_size: int | None = None) -> list[TrajectoryTree]:
    """One explicit tree per line."""
    trees = [tree_from_record(where, rec, vocab_size=vocab_size) for where, rec in _records(path)]
    if not trees:
        raise ValueError(f"{path}: no trees")
    return trees


def write_trees(path: str | Path, trees: Sequence[TrajectoryTree]) -> None:
    """Write one explicit tree per line (nodes in DFS pre-order)."""
    with open(path, "w", encoding="utf-8") as f:
        for t in trees:
            rec = {
                "parents": t.parents.tolist(),
                "segments": [s.tolist() for s in t.segments],
                "paths": [dict(node=int(t.path_nodes[p]), **_path_record(t, p))
                          for p in range(t.n_paths)],
            }
            f.write(json.dumps(rec) + "\n")
