"""Regenerate the bundled sample data: `python -m jtree.launch.make_sample_data`.

Writes data/sample_groups.jsonl: agent-rollout groups from `jtree.trees.synthetic` (fixed seed), one
sequence per line with its group id, loss mask and GRPO-style advantage.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import numpy as np

from jtree.trees.jsonl import write_sequence_groups
from jtree.trees.synthetic import AgentShape, agent_rollout_group


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="data/sample_groups.jsonl")
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    shape = AgentShape(system_len=200, rollouts=8, turns=3, assistant_len=28, tool_len=24,
                       think_len=16, task_len=24)
    trees = [agent_rollout_group(rng, shape) for _ in range(args.groups)]
    write_sequence_groups(args.out, trees)
    flat = sum(t.stats().n_flat_tokens for t in trees)
    tree = sum(t.n_tree_tokens for t in trees)
    print(f"wrote {args.out}: {len(trees)} groups, {flat} flat tokens, {tree} tree tokens, "
          f"POR {1 - tree / flat:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
