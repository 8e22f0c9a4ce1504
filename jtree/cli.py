"""The `jtree` command line: one subcommand per module in `jtree.commands`.

Each command module exposes `register(subparsers)`, which adds its parser and sets `func`.

Errors. A user error ends a command (and `python -m jtree.launch.train`) with one line on stderr,
`<prog>: error: <ExceptionType>: <message>`, the message naming the file:line, record or config
key at fault, and exit code 2, the code argparse gives a bad command line. User errors are what bad
input raises: `ValueError` (config keys and values, bad records, a checkpoint that does not match
the config; `UnicodeDecodeError` and `json.JSONDecodeError` are ValueErrors), `OSError` (a missing
or unreadable file or directory: `FileNotFoundError`, `IsADirectoryError`, `PermissionError`) and
`yaml.YAMLError` (a config file that is not YAML). Any other exception is a bug in jtree and keeps
its traceback. `--debug`, or `JTREE_DEBUG=1` in the environment, shows the traceback of user
errors too.

`key.path=value` overrides may come before or after the options (`--resume run.steps=40`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

import yaml

from jtree.commands import compare_torch, export_hf, stats, train

COMMANDS = (train, stats, compare_torch, export_hf)
USER_ERRORS = (ValueError, OSError, yaml.YAMLError)
DEBUG_ENV = "JTREE_DEBUG"


def add_debug_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true",
                        help=f"show the traceback of an error (or set {DEBUG_ENV}=1)")


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None
               ) -> argparse.Namespace:
    """`parser.parse_args`, with `key=value` words anywhere: argparse fills a `nargs='*'`
    positional from one run of words only, so overrides after an option (`--resume a.b=1`) would
    be 'unrecognized arguments'."""
    args, extra = parser.parse_known_args(argv)
    overrides = [a for a in extra if "=" in a and not a.startswith("-")]
    if len(overrides) < len(extra) or (overrides and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if overrides:
        args.overrides = [*args.overrides, *overrides]
    return args


def run_reporting_errors(prog: str, func: Callable[[argparse.Namespace], int | None],
                         args: argparse.Namespace) -> int:
    """`func(args)`'s exit code; a user error (see the module docstring) printed as one line
    (a message of several lines joined), exit code 2, unless `args.debug` or JTREE_DEBUG asks
    for its traceback."""
    try:
        return int(func(args) or 0)
    except USER_ERRORS as e:
        if args.debug or os.environ.get(DEBUG_ENV, "0") not in ("", "0"):
            raise
        message = " ".join(line.strip() for line in str(e).splitlines())  # YAML's span lines
        print(f"{prog}: error: {type(e).__name__}: {message}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jtree", description="Tree-structured LLM training.")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS:
        module.register(sub)
    for command in sub.choices.values():
        add_debug_argument(command)
    args = parse_args(parser, argv)
    return run_reporting_errors(f"jtree {args.command}", args.func, args)


if __name__ == "__main__":
    sys.exit(main())
