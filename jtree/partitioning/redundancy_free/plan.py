"""Redundancy-free capacity plans: every tree token computed in exactly one part.

A part owns at most `capacity` tree tokens: whole subtrees, upper pieces of subtrees, or a piece of
one long node (a prefix longer than the capacity is cut into several parts). All of a part's own
tokens hang below one token of an earlier part, its *attach* token (or below nothing: the part
starts at roots). Its *prefix* is the chain of tokens from the root to the attach token; the part
reads their keys/values, GDN state and conv context from the parts that computed them instead of
recomputing them (`jtree.partitioning.redundancy_free.executor`). The parts form a tree (a part's parent computes its
attach token), executed depth-first with a stack of prefixes, seed 003's KV stack at the
granularity of capacity-sized parts.

The plan is built bottom-up over the tree (post-order), greedily, like the duplicating heuristic
of `jtree.partitioning.partition`: every node carries the tokens of its subtree not yet given to a part, an
upper, connected piece of the subtree (its *open remainder*). At a node whose open remainders and
own segment exceed the capacity, the children's remainders are packed first-fit decreasing into
parts hanging below the node's last token, keeping the least filled one open; walking up the
node's segment, whatever still exceeds the capacity is closed into full parts made of the open
remainder plus the segment's lowest tokens. What is open at the roots is packed into parts without
a prefix. Nodes on no path are never trained and are left out.

At the root of a one-root tree nothing is open above, so the walk's only merit is using the root's
tokens to fill a part: there, if it closes no fewer parts, the root's whole segment stays in the
top part instead with the children's remainders that fit beside it (those with parts below them
first), and the others are packed into parts below its last token. The walk would otherwise
leave, e.g., a 1-token top part above a full part that has children: two parts with children
(two device calls each, `jtree.partitioning.redundancy_free.executor`) where one suffices.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jtree.layout.bin_packing import first_fit_decreasing
from jtree.trees.tree import TrajectoryTree


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
    """An open remainder: its token count, token ranges [a, b), and whether closed parts hang
    below its tokens (a part made of it has children)."""

    size: int
    pieces: list[tuple[int, int]]
    below: bool = False


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
                             [(start, end)] + [p for it in items for p in it.pieces],
                             any(it.below for it in items))
            continue
        bins = sorted(_first_fit_decreasing(items, capacity), key=lambda b: b.size)
        keep = bins[0] if bins else _Open(0, [])
        cuts = _segment_cuts(keep.size, start, end, capacity)
        if len(roots) == 1 and tree.parents[u] < 0 and end - start <= capacity:
            kept, rest = _beside_segment(items, end - start, capacity)
            if len(rest) <= len(bins) - 1 + len(cuts):
                closed.extend((b.pieces, end - 1) for b in rest)
                open_[u] = _Open(sum(it.size for it in kept) + end - start,
                                 [(start, end)] + [p for it in kept for p in it.pieces], True)
                continue
        closed.extend((b.pieces, end - 1) for b in bins[1:])
        hi, pieces = end, keep.pieces
        for lo in cuts:
            closed.append((pieces + ([(lo, hi)] if lo < hi else []), lo - 1))
            hi, pieces = lo, []
        open_[u] = _Open(hi - start + (0 if cuts else keep.size), [(start, hi)] + pieces, True)
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


def _segment_cuts(size: int, start: int, end: int, capacity: int) -> list[int]:
    """Where the walk up a node's segment [start, end) cuts it, with an open remainder of `size`
    tokens below: the token lo of each closed part [lo, previous cut) (the first one holding the
    remainder, closed below token lo - 1), bottom up, while what stays above exceeds capacity."""
    cuts, hi = [], end
    while size + hi - start > capacity:
        hi -= capacity - size  # > start: the loop condition leaves segment tokens above
        cuts.append(hi)
        size = 0
    return cuts


def _beside_segment(items: list[_Open], seg: int, capacity: int
                    ) -> tuple[list[_Open], list[_Open]]:
    """Children's remainders kept open beside a root node's whole segment of `seg` tokens, and
    the rest packed into parts (first fit decreasing) to close below its last token. Remainders
    with parts below them are kept first (closed, they would make parts with children, which take
    two device calls instead of one), then the largest that fit."""
    kept, rest, room = [], [], capacity - seg
    for it in sorted(items, key=lambda it: (not it.below, -it.size)):
        if it.size <= room:
            kept.append(it)
            room -= it.size
        else:
            rest.append(it)
    return kept, _first_fit_decreasing(rest, capacity)


def _first_fit_decreasing(items: list[_Open], capacity: int) -> list[_Open]:
    """Open remainders packed into parts of at most `capacity` tokens (`first_fit_decreasing`)."""
    return [_Open(sum(items[i].size for i in members), [p for i in members for p in items[i].pieces])
            for members in first_fit_decreasing([it.size for it in items], capacity)]


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
