"""Redundancy-free capacity plans: every tree token computed in exactly one part.

A part owns at most `capacity` tree tokens: whole subtrees, upper pieces of subtrees, or a piece of
one long node (a prefix longer than the capacity is cut into several parts). All of a part's own
tokens hang below one token of an earlier part, its *attach* token (or below nothing: the part
starts at roots). Its *prefix* is the chain of tokens from the root to the attach token; the part
reads their keys/values, GDN state and conv context from the parts that computed them instead of
recomputing them (`jtree.rfree.execute`). The parts form a tree (a part's parent computes its
attach token), executed depth-first with a stack of prefixes, seed 003's KV stack at the
granularity of capacity-sized parts.

The plan is built bottom-up over the tree (post-order), greedily, like the duplicating heuristic
of `jtree.partition`: every node carries the tokens of its subtree not yet given to a part, an
upper, connected piece of the subtree (its *open remainder*). At a node whose open remainders and
own segment exceed the capacity, the children's remainders are packed first-fit decreasing into
parts hanging below the node's last token, keeping the least filled one open; walking up the
node's segment, whatever still exceeds the capacity is closed into full parts made of the open
remainder plus the segment's lowest tokens. What is open at the roots is packed into parts without
a prefix. Nodes on no path are never trained and are left out.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jtree.tree import TrajectoryTree


@dataclasses.dataclass(frozen=True, eq=False)
class RfreePart:
    """One part of a redundancy-free plan of `tree`.

    `own`: tree token indices the part computes, ascending (DFS order). `attach`: the tree token
    they all hang below (-1: they start at roots). `parent`: index of the part that computes
    `attach` (-1 with it). `children`: parts hanging below this part's tokens, in DFS order.
    """

    tree: TrajectoryTree
    own: np.ndarray
    attach: int
    parent: int
    children: tuple[int, ...]

    @property
    def n_tree_tokens(self) -> int:
        """Tokens this part computes (what `PartitionResult.n_computed` adds up)."""
        return len(self.own)

    @property
    def prefix(self) -> np.ndarray:
        """Tree tokens from the root to `attach`, in path order (empty without an attach)."""
        if self.attach < 0:
            return np.zeros(0, np.int32)
        t = self.tree
        nodes, node = [], int(t.token_arrays["node"][self.attach])
        while node >= 0:
            nodes.append(node)
            node = int(t.parents[node])
        off = t.node_offsets
        chain = np.concatenate([np.arange(off[n], off[n + 1], dtype=np.int32)
                                for n in reversed(nodes)])
        return chain[: int(t.token_arrays["pos"][self.attach]) + 1]


@dataclasses.dataclass
class _Open:
    """An open remainder: its token count and token ranges [a, b)."""

    size: int
    pieces: list[tuple[int, int]]


def plan_parts(tree: TrajectoryTree, capacity: int) -> list[RfreePart]:
    """The parts of `tree` in execution order (every part after its parent), see module docstring.

    Any capacity >= 1 works: paths longer than the capacity are cut into parts too.
    """
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
        raise ValueError(f"capacity: must be a positive integer, got {capacity!r}")
    capacity = int(capacity)
    closed: list[tuple[list[tuple[int, int]], int]] = []  # (pieces, attach token)
    off = tree.node_offsets
    relevant = _relevant_nodes(tree)
    children: list[list[int]] = [[] for _ in range(tree.n_nodes)]
    roots = []
    for u in range(tree.n_nodes):
        if relevant[u]:
            p = int(tree.parents[u])
            (children[p] if p >= 0 else roots).append(u)
    open_: list[_Open | None] = [None] * tree.n_nodes
    for u in range(tree.n_nodes - 1, -1, -1):
        if not relevant[u]:
            continue
        items = [open_[c] for c in children[u] if open_[c] is not None]
        start, end = int(off[u]), int(off[u + 1])
        if sum(it.size for it in items) + end - start <= capacity:
            open_[u] = _Open(sum(it.size for it in items) + end - start,
                             [(start, end)] + [p for it in items for p in it.pieces])
            continue
        bins = sorted(_first_fit_decreasing(items, capacity), key=lambda b: b.size)
        keep = bins[0] if bins else _Open(0, [])
        closed.extend((b.pieces, end - 1) for b in bins[1:])
        hi, size, pieces = end, keep.size, keep.pieces
        while size + hi - start > capacity:
            lo = hi - (capacity - size)  # > start: the loop condition leaves segment tokens above
            closed.append((pieces + ([(lo, hi)] if lo < hi else []), lo - 1))
            hi, size, pieces = lo, 0, []
        open_[u] = _Open(size + hi - start, [(start, hi)] + pieces)
    for b in _first_fit_decreasing([open_[r] for r in roots], capacity):
        closed.append((b.pieces, -1))
    return _part_tree(tree, closed)


def _relevant_nodes(tree: TrajectoryTree) -> np.ndarray:
    """Nodes on at least one path (the only ones any part trains)."""
    relevant = np.zeros(tree.n_nodes, bool)
    relevant[tree.path_nodes] = True
    for u in range(tree.n_nodes - 1, -1, -1):  # children follow parents in pre-order
        if relevant[u] and tree.parents[u] >= 0:
            relevant[tree.parents[u]] = True
    return relevant


def _first_fit_decreasing(items: list[_Open], capacity: int) -> list[_Open]:
    bins: list[_Open] = []
    for it in sorted(items, key=lambda it: -it.size):
        for b in bins:
            if b.size + it.size <= capacity:
                b.size += it.size
                b.pieces.extend(it.pieces)
                break
        else:
            bins.append(_Open(it.size, list(it.pieces)))
    return bins


def _part_tree(tree: TrajectoryTree, closed: list[tuple[list[tuple[int, int]], int]]
               ) -> list[RfreePart]:
    """Order closed parts depth-first (parents first, siblings by their first token) and link
    each to the part computing its attach token."""
    owns = [np.sort(np.concatenate([np.arange(a, b) for a, b in pieces])).astype(np.int32)
            for pieces, _ in closed]
    owner = np.full(tree.n_tree_tokens, -1, np.int64)
    for i, own in enumerate(owns):
        owner[own] = i
    kids: list[list[int]] = [[] for _ in closed]
    tops = []
    for i, (_, attach) in enumerate(closed):
        (kids[owner[attach]] if attach >= 0 else tops).append(i)
    order: list[int] = []
    stack = sorted(tops, key=lambda i: -int(owns[i][0]))
    while stack:
        i = stack.pop()
        order.append(i)
        stack.extend(sorted(kids[i], key=lambda j: -int(owns[j][0])))
    new = {old: n for n, old in enumerate(order)}
    return [RfreePart(tree, owns[i], closed[i][1],
                      new[int(owner[closed[i][1]])] if closed[i][1] >= 0 else -1,
                      tuple(new[j] for j in sorted(kids[i], key=lambda j: int(owns[j][0]))))
            for i in order]
