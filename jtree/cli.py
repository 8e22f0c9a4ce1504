"""The `jtree` command line: one subcommand per module in `jtree.commands`.

Each command module exposes `register(subparsers)`, which adds its parser and sets `func`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from jtree.commands import compare_torch, export_hf, stats, train

COMMANDS = (train, stats, compare_torch, export_hf)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jtree", description="Tree-structured LLM training.")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS:
        module.register(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"jtree {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
