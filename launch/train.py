"""Train on trees from JSONL: `python -m jtree.launch.train --config configs/tiny.yaml [--resume]
[--debug] [key.path=value ...]`, the same run as `jtree train` (see `jtree.commands.train`; the
trainer itself is `jtree.training.trainer`), with the same one-line errors (`jtree.cli`). The entry point
of `make demo` and of the multi-host recipes in launch/."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from jtree.cli import add_debug_argument, parse_args, run_reporting_errors
from jtree.commands import train

PROG = "python -m jtree.launch.train"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=train.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_arguments(parser)
    add_debug_argument(parser)
    return run_reporting_errors(PROG, train.run, parse_args(parser, argv))


if __name__ == "__main__":
    sys.exit(main())
