"""The branching structure of a tree's paths, as the partitioners see it.

Partitioning only cares about which paths share which prefixes and how many tokens each piece has.
`PathSkeleton` keeps exactly that: the nodes that lie on some path, with every unary chain (a node
with one child and no path ending at it) merged into the node below it, so every internal skeleton
node is a branching point or the end of a path. Its leaves are the *maximal* path ends (no other
path ends below them). A path ending at an internal node never costs a token in any partition (a
part that owns a leaf below it already computes its whole prefix), so partitioners group leaves and
let those paths ride along with `attach_leaf`.

Built in O(nodes) from the tree's DFS pre-order arrays; skeleton nodes are in DFS pre-order too.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jtree.trees.tree import TrajectoryTree


@dataclasses.dataclass(frozen=True, eq=False)
class PathSkeleton:
    """Compressed relevant tree. Lengths are token counts; `depth_end[u]` counts root..end of u."""

    parent: np.ndarray
    length: np.ndarray
    depth_end: np.ndarray
    children: tuple[tuple[int, ...], ...]
    ends: tuple[tuple[int, ...], ...]
    attach_leaf: np.ndarray

    @property
    def n_nodes(self) -> int:
        return len(self.parent)

    @property
    def roots(self) -> list[int]:
        return [int(u) for u in np.flatnonzero(self.parent < 0)]

    @property
    def leaves(self) -> list[int]:
        return [u for u in range(self.n_nodes) if not self.children[u]]

    def depth_above(self, u: int) -> int:
        """Tokens on the path above node u (its prefix, excluding u's own tokens)."""
        return int(self.depth_end[u] - self.length[u])

    def subtree_tokens(self) -> np.ndarray:
        """Tokens in each node's subtree (what a part owning every leaf below it computes there)."""
        out = self.length.astype(np.int64)
        for u in range(self.n_nodes - 1, -1, -1):
            if self.parent[u] >= 0:
                out[self.parent[u]] += out[u]
        return out

    def leaves_below(self) -> list[list[int]]:
        """Skeleton leaves in each node's subtree, in DFS order."""
        out: list[list[int]] = [[] for _ in range(self.n_nodes)]
        for u in range(self.n_nodes - 1, -1, -1):
            if not self.children[u]:
                out[u] = [u]
            else:
                out[u] = [leaf for c in self.children[u] for leaf in out[c]]
        return out

    def paths_by_leaf(self) -> dict[int, list[int]]:
        """Input path indices owned with each leaf (riders at internal nodes included)."""
        out: dict[int, list[int]] = {leaf: [] for leaf in self.leaves}
        for u in range(self.n_nodes):
            out[int(self.attach_leaf[u])].extend(self.ends[u])
        return out


def path_skeleton(tree: TrajectoryTree) -> PathSkeleton:
    """Build the skeleton of `tree` (see module docstring)."""
    n = tree.n_nodes
    parents = tree.parents
    seg_len = np.diff(tree.node_offsets).astype(np.int64)
    ends: list[list[int]] = [[] for _ in range(n)]
    for p, node in enumerate(tree.path_nodes):
        ends[int(node)].append(p)
    relevant = np.zeros(n, bool)
    relevant[tree.path_nodes] = True
    n_rel_children = np.zeros(n, np.int64)
    for u in range(n - 1, -1, -1):  # children follow parents in pre-order
        if relevant[u] and parents[u] >= 0:
            relevant[parents[u]] = True
            n_rel_children[parents[u]] += 1
    keep = relevant & ((n_rel_children != 1) | np.array([bool(e) for e in ends]))

    sk_id = np.full(n, -1, np.int64)
    carry_len = np.zeros(n, np.int64)  # tokens of merged unary ancestors not yet placed
    carry_parent = np.full(n, -1, np.int64)
    sk_parent: list[int] = []
    sk_len: list[int] = []
    sk_ends: list[tuple[int, ...]] = []
    for u in range(n):
        if not relevant[u]:
            continue
        p = int(parents[u])
        if p < 0:
            above, parent = 0, -1
        elif keep[p]:
            above, parent = 0, int(sk_id[p])
        else:
            above, parent = int(carry_len[p]), int(carry_parent[p])
        if keep[u]:
            sk_id[u] = len(sk_parent)
            sk_parent.append(parent)
            sk_len.append(above + int(seg_len[u]))
            sk_ends.append(tuple(ends[u]))
        else:
            carry_len[u], carry_parent[u] = above + int(seg_len[u]), parent
    m = len(sk_parent)
    parent_arr = np.asarray(sk_parent, np.int64)
    length = np.asarray(sk_len, np.int64)
    depth_end = length.copy()
    children: list[list[int]] = [[] for _ in range(m)]
    for u in range(m):
        if parent_arr[u] >= 0:
            depth_end[u] += depth_end[parent_arr[u]]
            children[parent_arr[u]].append(u)
    attach = np.arange(m, dtype=np.int64)
    for u in range(m - 1, -1, -1):  # first leaf below each node
        if children[u]:
            attach[u] = attach[children[u][0]]
    return PathSkeleton(parent_arr, length, depth_end, tuple(tuple(c) for c in children),
                        tuple(sk_ends), attach)
