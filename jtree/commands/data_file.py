"""The data file of a command (`jtree stats`, `jtree compare-torch`): its `--format`,
`--tokenizer`, `--trace-drift`, `--truncated` and `--aborted` options, and reading it exactly as training does
(`jtree.training.tree_files.load_trees`), so a file that trains is a file these commands read,
chat conversations and engine traces included."""

from __future__ import annotations

import argparse

from jtree.training.tree_files import FORMAT_FIELDS, load_trees
from jtree.trees.traces import ABORTED_POLICIES, DRIFT_POLICIES, TRUNCATED_POLICIES
from jtree.trees.tree import TrajectoryTree


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """`--format`, `--tokenizer`, `--trace-drift`, `--truncated` and `--aborted` (read by
    `read_data`), the data settings of a run of the same names."""
    parser.add_argument("--format", choices=tuple(FORMAT_FIELDS), default="groups",
                        help="groups | trees | chat (conversations, tokenized with --tokenizer) | "
                             "traces (engine rollouts, token-in / token-out)")
    parser.add_argument("--tokenizer", default="bytes",
                        help="for --format chat: `bytes` (the built-in byte tokenizer) or a local "
                             "tokenizer.json or its directory")
    parser.add_argument("--trace-drift", choices=DRIFT_POLICIES, default="reject",
                        help="for --format traces: a turn whose prompt does not extend the "
                             "previous turn's tokens is rejected, or branched into a new path")
    parser.add_argument("--truncated", choices=tuple(TRUNCATED_POLICIES), default="mask",
                        help="for --format traces: a turn cut at the engine's length limit is "
                             "trained, masked (context only) or its rollout dropped")
    parser.add_argument("--aborted", choices=ABORTED_POLICIES, default="refuse",
                        help="for --format traces: a rollout with an aborted turn is refused "
                             "(a bad record) or dropped")


def read_data(path: str, args: argparse.Namespace, vocab_size: int | None = None
              ) -> list[TrajectoryTree]:
    """The trees of the file at `path` in `args.format`; the first bad record stops the command
    (naming its file:line), a file of another format names the `--format` to use."""
    return load_trees(path, args.format, vocab_size=vocab_size, tokenizer=args.tokenizer,
                      trace_drift=args.trace_drift, truncated=args.truncated,
                      aborted=args.aborted, format_key="--format")[0]
