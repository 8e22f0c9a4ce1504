"""`jtree stats FILE`: how much the trees of a JSONL file share."""

from __future__ import annotations

import argparse
import json

from jtree.tree import TrajectoryTree
from jtree.tree_jsonl import read_sequence_groups, read_trees


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stats", help="sharing statistics of a JSONL file of trees or groups")
    p.add_argument("file")
    p.add_argument("--format", choices=("groups", "trees"), default="groups")
    p.add_argument("--json", dest="json_out", default=None, help="write the numbers here")
    p.set_defaults(func=run)


def load(path: str, fmt: str) -> list[TrajectoryTree]:
    return (read_sequence_groups if fmt == "groups" else read_trees)(path)


def run(args: argparse.Namespace) -> int:
    trees = load(args.file, args.format)
    rows = [t.stats() for t in trees]
    total = sum(rows[1:], rows[0])
    header = f"{'tree':>6} {'paths':>6} {'nodes':>6} {'tree_tok':>9} {'flat_tok':>9} {'POR':>6} {'compr':>6}"
    print(header)
    for name, s in [*((str(i), s) for i, s in enumerate(rows)), ("total", total)]:
        print(f"{name:>6} {s.n_paths:6d} {s.n_nodes:6d} {s.n_tree_tokens:9d} {s.n_flat_tokens:9d} "
              f"{s.por:6.3f} {s.compression:6.2f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"trees": [s.as_dict() for s in rows], "total": total.as_dict()}, f, indent=1)
    return 0
