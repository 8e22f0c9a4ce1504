"""Prefixes shared across groups: a step's trees merged into one trie per data shard x micro-batch.

Each tree is one group, whose advantages were computed from that group alone when it was read;
`jtree.trees.merge.merge_trees` merges trees at their common prefixes with every path's data
travelling along, so the step's loss and gradients are those of the unmerged trees while a system
prompt common to every group is computed once per merged tree.

Why per bin and not one tree per step: the rows of different data shards run on different
devices and the micro-batches of a shard one after the other, so a prefix is computed once per
(shard, micro-batch) that holds any of its paths whatever the layout; one tree per step would then
have to be cut into parts again, each holding its own copy of the prefix, and the balancer could
only move those parts. Instead the step's trees are first balanced over the
n_shards x micro_batches bins by what each adds beyond the prefix common to the whole step
(`common_prefix_len`: the merged tree of a bin is about that prefix plus the rest of its trees),
then merged per bin. A bin's merged tree larger than a row goes through capacity partitioning
(tree mode) or the redundancy-free parts, as any tree larger than a row does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jtree.layout.balance import assign_to_ranks
from jtree.trees.merge import merge_trees
from jtree.trees.tree import TrajectoryTree


@dataclasses.dataclass(frozen=True, eq=False)
class MergedBins:
    """A step's trees merged per bin: `trees[b]` is bin b's merged tree (None: the bin got no
    tree), `members[b]` the indices of the step's trees merged into it, `saved_tokens` the tree
    tokens of the step's trees that the merge computes once instead of once per tree."""

    trees: tuple[TrajectoryTree | None, ...]
    members: tuple[tuple[int, ...], ...]
    saved_tokens: int


def common_prefix_len(trees: Sequence[TrajectoryTree]) -> int:
    """Tokens every path of every tree begins with (the step's common system prompt): the
    longest common beginning of the trees' root segments, 0 when a tree is a forest."""
    common, first = None, None
    for tree in trees:
        if int(np.sum(tree.parents < 0)) != 1:
            return 0
        root = tree.segments[0]  # every path of a one-root tree holds its whole root segment
        if first is None:
            first, common = root, len(root)
            continue
        n = min(common, len(root))
        diff = np.flatnonzero(first[:n] != root[:n])
        common = int(diff[0]) if diff.size else n
    return 0 if common is None else common


def merge_per_bin(trees: Sequence[TrajectoryTree], n_bins: int, *,
                  shared_masks: bool = False) -> MergedBins:
    """`trees` balanced over `n_bins` bins (`jtree.layout.balance.assign_to_ranks`, each tree
    costing its tree tokens beyond the step's `common_prefix_len`) and merged per bin
    (`merge_trees`; `shared_masks` for GSPO)."""
    if not trees:
        raise ValueError("trees: need at least one tree")
    common = common_prefix_len(trees)
    costs = [t.n_tree_tokens - common for t in trees]
    members = assign_to_ranks(costs, n_bins).ranks if n_bins > 1 else (tuple(range(len(trees))),)
    merged = tuple(merge_trees([trees[i] for i in m], shared_masks=shared_masks) if m else None
                   for m in members)
    saved = (sum(t.n_tree_tokens for t in trees)
             - sum(t.n_tree_tokens for t in merged if t is not None))
    return MergedBins(merged, tuple(members), saved)
