"""Capacity partitioning: split a tree larger than memory into parts that fit, exactly.

`partition(tree, capacity, method)` groups the tree's paths into parts of at most `capacity` tree
tokens, minimizing the tokens computed in total (N_computed; shared prefixes are recomputed once per
part that needs them). Each part is a `TreePart`: a `TrajectoryTree` holding only the paths it owns
(`owned_paths`, indices into the input's paths), with their own per-path data. Every path is owned
by exactly one part, so a prefix duplicated into several parts carries, in each part, only the loss
weight of the paths that part owns. Linearize parts with the normalizer of the whole batch
(`jtree.batch_normalizer(all_trees, ...)`; the parts of a tree give the same value) and the part
losses and gradients add up exactly to the full tree's.

Methods (docs/design.md section 5; seed 000 section 3.3 and Appendix A; seed 001 section 3.2):
- `heuristic`: greedy bottom-up packing in DFS post-order. At each branching node the parts coming
  up from its children are packed first-fit decreasing into as few parts as fit (deepest, longest
  first; merging two parts at node u saves the tokens root..u, so merging as deep as possible is
  what saves most), a part is closed as soon as nothing outside it could still join it. Runs in
  time linear in the tree size for bounded branching (see launch/bench/partition.py).
- `dp_single`, `dp_multi`: the exact programs of `jtree.partitioning.exact_dp` (ground truth for small trees;
  `dp_multi` is the true optimum and refuses trees too large to enumerate).

Nodes that lie on no path are dropped from every part (they are never trained).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal, get_args

import numpy as np

from jtree.layout.bin_packing import first_fit_decreasing
from jtree.partitioning.exact_dp import DEFAULT_MAX_WORK, dp_multi, dp_single
from jtree.partitioning.path_skeleton import PathSkeleton, path_skeleton
from jtree.trees.part import TreePart
from jtree.trees.tree import TrajectoryTree

Method = Literal["heuristic", "dp_single", "dp_multi"]
METHODS: tuple[str, ...] = get_args(Method)


@dataclasses.dataclass(frozen=True, eq=False)
class PartitionResult:
    """The parts of one tree and how much they compute (docs/design.md section 8 metrics)."""

    method: str
    capacity: int
    parts: tuple[TreePart, ...]
    n_tree_tokens: int
    n_flat_tokens: int

    @property
    def n_parts(self) -> int:
        return len(self.parts)

    @property
    def n_computed(self) -> int:
        """Tokens computed over all parts (shared prefixes once per part that holds them)."""
        return int(sum(p.n_tree_tokens for p in self.parts))

    @property
    def err(self) -> float:
        """Effective reuse ratio 1 - N_computed / N_flat (equals POR when the tree fits)."""
        return 1.0 - self.n_computed / self.n_flat_tokens

    @property
    def por(self) -> float:
        return 1.0 - self.n_tree_tokens / self.n_flat_tokens

    def as_dict(self) -> dict[str, float | int | str]:
        return {"method": self.method, "capacity": self.capacity, "parts": self.n_parts,
                "n_computed": self.n_computed, "n_tree_tokens": self.n_tree_tokens,
                "n_flat_tokens": self.n_flat_tokens, "err": self.err, "por": self.por}


def partition(
    tree: TrajectoryTree,
    capacity: int,
    method: Method = "heuristic",
    *,
    max_work: int = DEFAULT_MAX_WORK,
) -> PartitionResult:
    """Split `tree` into parts of at most `capacity` tree tokens (see module docstring).

    Raises ValueError when a single path is longer than `capacity` (no partition can hold it), for
    an unknown method, or when `dp_multi` would enumerate more than `max_work` groupings.
    """
    if method not in METHODS:
        raise ValueError(f"method: {method!r} is not one of {METHODS}")
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
        raise ValueError(f"capacity: must be a positive integer, got {capacity!r}")
    capacity = int(capacity)
    longest = int(np.argmax(tree.path_lengths))
    if tree.path_lengths[longest] > capacity:
        raise ValueError(
            f"path {longest}: has {int(tree.path_lengths[longest])} tokens, more than "
            f"capacity={capacity}; no part can hold it (raise the capacity or truncate the path)"
        )
    groups = plan_groups(tree, capacity, method, max_work=max_work)
    stats = tree.stats()
    return PartitionResult(
        method=method, capacity=capacity,
        parts=tuple(TreePart.from_paths(tree, g) for g in groups),
        n_tree_tokens=stats.n_tree_tokens, n_flat_tokens=stats.n_flat_tokens,
    )


def plan_groups(
    tree: TrajectoryTree, capacity: int, method: Method = "heuristic", *,
    max_work: int = DEFAULT_MAX_WORK,
) -> list[list[int]]:
    """The input path indices of each part, in DFS order, without building the parts."""
    sk = path_skeleton(tree)
    if method == "heuristic":
        leaf_groups = heuristic(sk, capacity)
    elif method == "dp_single":
        leaf_groups = dp_single(sk, capacity)
    else:
        leaf_groups = dp_multi(sk, capacity, max_work)
    owned = sk.paths_by_leaf()
    groups = [sorted(p for leaf in g for p in owned[leaf]) for g in leaf_groups]
    return sorted(groups, key=lambda g: int(tree.path_nodes[g[0]]))


def heuristic(sk: PathSkeleton, capacity: int) -> list[list[int]]:
    """Greedy bottom-up first-fit-decreasing packing: groups of skeleton leaves.

    A part is carried as (size, id), size = tokens of the union of its paths from the root. At node
    u, parts from different children share exactly the tokens root..u, so merging them costs
    size - depth_end[u] each; first fit decreasing keeps any two parts it leaves apart too large to
    merge, so parts from the same child never need merging higher up (their sizes are exact).
    """
    merged: list[list[int]] = []  # merged[id - n_nodes] = ids merged into that part
    closed: list[int] = []
    room_outside = _room_outside(sk)
    open_parts: list[list[tuple[int, int]]] = [[] for _ in range(sk.n_nodes)]
    for u in range(sk.n_nodes - 1, -1, -1):
        if not sk.children[u]:
            items = [(int(sk.depth_end[u]), u)]  # a leaf's part id is the leaf itself
        elif len(sk.children[u]) == 1:  # paths end here: nothing new to merge
            items, open_parts[sk.children[u][0]] = open_parts[sk.children[u][0]], []
        else:
            items = [it for c in sk.children[u] for it in open_parts[c]]
            for c in sk.children[u]:
                open_parts[c] = []
            items = _first_fit_decreasing(items, int(sk.depth_end[u]), capacity, merged,
                                          sk.n_nodes)
        keep = []
        for size, pid in items:
            if size + room_outside[u] <= capacity:
                keep.append((size, pid))
            else:
                closed.append(pid)
        open_parts[u] = keep
    top = [it for r in sk.roots for it in open_parts[r]]
    closed.extend(pid for _, pid in _first_fit_decreasing(top, 0, capacity, merged, sk.n_nodes))
    return [_flatten(pid, merged, sk.n_nodes) for pid in closed]


def _first_fit_decreasing(
    items: list[tuple[int, int]], shared: int, capacity: int, merged: list[list[int]], n: int
) -> list[tuple[int, int]]:
    """Pack parts that share `shared` prefix tokens into as few parts of <= capacity as FFD finds
    (a part adds its tokens below the shared prefix to the part it joins)."""
    out = []
    for members in first_fit_decreasing([size - shared for size, _ in items], capacity - shared):
        ids = [items[i][1] for i in members]
        size = shared + sum(items[i][0] - shared for i in members)
        if len(ids) == 1:
            out.append((size, ids[0]))
        else:
            merged.append(ids)
            out.append((size, n + len(merged) - 1))
    return out


def _room_outside(sk: PathSkeleton) -> np.ndarray:
    """For each node u, the fewest tokens a part from outside u's subtree adds to a part reaching u.

    A part reaching u can only merge at a strict ancestor w with a part through another child x of
    w, which adds at least (shortest path below x) - depth_end[w] tokens. A part whose size plus
    this exceeds the capacity can be closed at u.
    """
    inf = np.iinfo(np.int64).max // 4
    shortest = sk.depth_end.astype(np.int64)  # shortest path to a leaf of each node's subtree
    for u in range(sk.n_nodes - 1, -1, -1):
        if sk.children[u]:
            shortest[u] = min(shortest[c] for c in sk.children[u])
    out = np.full(sk.n_nodes, inf, np.int64)

    def spread(siblings: Sequence[int], shared: int, above: int) -> None:
        extra = sorted((int(shortest[x]) - shared, x) for x in siblings)
        for x in siblings:
            best = next((e for e, y in extra if y != x), inf)
            out[x] = min(above, best)

    spread(sk.roots, 0, inf)
    for u in range(sk.n_nodes):
        if sk.children[u]:
            spread(sk.children[u], int(sk.depth_end[u]), int(out[u]))
    return out


def _flatten(pid: int, merged: list[list[int]], n: int) -> list[int]:
    leaves, stack = [], [pid]
    while stack:
        x = stack.pop()
        if x < n:
            leaves.append(x)
        else:
            stack.extend(merged[x - n])
    return sorted(leaves)
