"""`jtree stats FILE`: how much the trees of a JSONL file share, and what partitioning costs.

With `--capacity C`, every tree is partitioned into parts of at most C tree tokens by each method
(`--methods`), reporting parts, N_computed and ERR per tree and in total (`dp_multi` is reported as
refused on trees too large for it). Method `redundancy_free` plans the parts of `jtree.partitioning.redundancy_free` (no
prefix duplicated: N_computed == N_tree, ERR == POR, at any capacity, paths longer than it
included). `--plot OUT.png` draws one tree (node size by tokens; with a
capacity, colour by how many heuristic parts compute each node) and its overlap curve; `--json`
writes every number; `--vocab-size` refuses token ids outside the model's vocabulary, as a run
does. Files are read as training reads them (`jtree.training.tree_files.load_trees`): `--format
chat` tokenizes conversations with `--tokenizer`, one tree per conversation, one node per message.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from jtree.commands.data_file import add_data_arguments, read_data
from jtree.partitioning.exact_dp import DEFAULT_MAX_WORK, TooLargeForExactDP
from jtree.partitioning.partition import METHODS, partition
from jtree.partitioning.redundancy_free.plan import plan_parts
from jtree.trees.tree import TrajectoryTree


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stats", help="sharing statistics of a JSONL file of groups, trees or chats")
    p.add_argument("file")
    add_data_arguments(p)
    p.add_argument("--vocab-size", type=int, default=None,
                   help="refuse token ids outside a vocabulary of this size, as training does "
                        "with model.vocab_size")
    p.add_argument("--json", dest="json_out", default=None, help="write the numbers here")
    p.add_argument("--capacity", type=int, default=None,
                   help="partition every tree into parts of at most this many tree tokens")
    p.add_argument("--methods", "--method", default=",".join(METHODS),
                   help=f"comma-separated partition methods among {','.join(STATS_METHODS)} "
                        f"(default: {','.join(METHODS)})")
    p.add_argument("--max-work", type=int, default=DEFAULT_MAX_WORK,
                   help="dp_multi refuses trees that need more groupings than this")
    p.add_argument("--plot", default=None, metavar="OUT.png",
                   help="draw a tree and its overlap curve (tree vs baseline)")
    p.add_argument("--plot-tree", type=int, default=None,
                   help="index of the tree to draw (default: the one with most tree tokens)")
    p.set_defaults(func=run)


STATS_METHODS = METHODS + ("redundancy_free",)


def run(args: argparse.Namespace) -> int:
    trees = read_data(args.file, args, vocab_size=args.vocab_size)
    rows = [t.stats() for t in trees]
    total = sum(rows[1:], rows[0])
    header = f"{'tree':>6} {'paths':>6} {'nodes':>6} {'tree_tok':>9} {'flat_tok':>9} {'POR':>6} {'compr':>6}"
    print(header)
    for name, s in [*((str(i), s) for i, s in enumerate(rows)), ("total", total)]:
        print(f"{name:>6} {s.n_paths:6d} {s.n_nodes:6d} {s.n_tree_tokens:9d} {s.n_flat_tokens:9d} "
              f"{s.por:6.3f} {s.compression:6.2f}")
    report: dict = {"trees": [s.as_dict() for s in rows], "total": total.as_dict()}
    if args.capacity is not None:
        methods = _methods(args.methods)
        per_tree = [_partition_all(i, t, args.capacity, methods, args.max_work)
                    for i, t in enumerate(trees)]
        totals = _totals(per_tree, methods, total.n_flat_tokens)
        _print_partitions(per_tree, totals, methods, args.capacity)
        report["capacity"] = args.capacity
        for entry, parts in zip(report["trees"], per_tree):
            entry["partition"] = parts
        report["total"]["partition"] = totals
    if args.plot:
        _plot(trees, args)
        print(f"wrote {args.plot}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def _methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    for m in methods:
        if m not in STATS_METHODS:
            raise ValueError(f"--methods: {m!r} is not one of {STATS_METHODS}")
    return methods


def _partition_all(index: int, tree: TrajectoryTree, capacity: int, methods: list[str],
                   max_work: int) -> dict:
    out = {}
    for m in methods:
        if m == "redundancy_free":
            parts = plan_parts(tree, capacity)
            n_computed = sum(p.n_tree_tokens for p in parts)
            out[m] = {"parts": len(parts), "n_computed": n_computed,
                      "err": 1.0 - n_computed / tree.stats().n_flat_tokens}
            continue
        try:
            r = partition(tree, capacity, m, max_work=max_work)
        except TooLargeForExactDP as e:
            out[m] = {"refused": str(e)}
            continue
        except ValueError as e:
            raise ValueError(f"tree {index}: {e}") from None
        out[m] = {"parts": r.n_parts, "n_computed": r.n_computed, "err": r.err}
    return out


def _totals(per_tree: list[dict], methods: list[str], n_flat: int) -> dict:
    totals = {}
    for m in methods:
        done = [p[m] for p in per_tree if "refused" not in p[m]]
        if len(done) < len(per_tree):
            totals[m] = {"refused_trees": len(per_tree) - len(done)}
            continue
        computed = sum(d["n_computed"] for d in done)
        totals[m] = {"parts": sum(d["parts"] for d in done), "n_computed": computed,
                     "err": 1.0 - computed / n_flat}
    return totals


def _print_partitions(per_tree: list[dict], totals: dict, methods: list[str],
                      capacity: int) -> None:
    print(f"\npartition, capacity {capacity} tree tokens (parts / N_computed / ERR)")
    print(f"{'tree':>6} " + " ".join(f"{m:>26}" for m in methods))
    for name, entry in [*((str(i), p) for i, p in enumerate(per_tree)), ("total", totals)]:
        cells = []
        for m in methods:
            e = entry[m]
            if "parts" in e:
                cells.append(f"{e['parts']:>5d} {e['n_computed']:>12d} {e['err']:>7.3f}")
            else:
                cells.append(f"{'refused (too large)':>26}")
        print(f"{name:>6} " + " ".join(cells))


def _plot(trees: list[TrajectoryTree], args: argparse.Namespace) -> None:
    from jtree.trees.plot import plot_tree_overview

    index = args.plot_tree
    if index is None:
        index = int(np.argmax([t.n_tree_tokens for t in trees]))
    if not 0 <= index < len(trees):
        raise ValueError(f"--plot-tree: {index} is out of range (file has {len(trees)} trees)")
    tree = trees[index]
    copies = None
    title = f"tree {index}"
    if args.capacity is not None:
        parts = partition(tree, args.capacity).parts
        copies = np.bincount(np.concatenate([p.source_nodes for p in parts]),
                             minlength=tree.n_nodes)
        title += f", {len(parts)} heuristic parts at capacity {args.capacity}"
    plot_tree_overview(tree, args.plot, title=title, copies=copies)
