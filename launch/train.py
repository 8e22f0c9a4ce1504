"""Train on trees from JSONL: `python -m jtree.launch.train --config configs/tiny.yaml [--resume]
[key.path=value ...]`, the same run as `jtree train` (see `jtree.commands.train`; the trainer
itself is `jtree.trainer`). The entry point of `make demo` and of the multi-host recipes in
launch/."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from jtree.commands import train


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jtree.launch.train", description=train.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_arguments(parser)
    return train.run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
