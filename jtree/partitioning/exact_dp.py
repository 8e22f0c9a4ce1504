"""Exact dynamic programs for capacity partitioning (seed 000 Appendix A), used as ground truth.

Both work on a `PathSkeleton` and return groups of skeleton leaves, one group per part. The cost of
a part is the number of tokens of the union of its paths (what jtree computes for it, shared
prefixes once); the total cost is N_computed. A virtual super-root of zero tokens joins the roots of
a forest, so one part may hold several roots.

`dp_single` (Appendix A.1): every part is "one shared node u and everything below it", or a single
leaf. The recurrence is the seed's (either select u, if its part fits, or delegate to the children),
but a selected part is measured as jtree builds it, a tree that keeps sharing below u (the seed
counts the residuals below u unshared, L(u) + R(u), which is never smaller). Linear time.

`dp_multi` (Appendix A.2): the true optimum over all ways to group leaves into parts that fit. The
state at node u is the sorted vector of loads (tokens inside u's subtree) of the parts that reach u;
its cost is the sum of the loads. Parent states come from lifting child loads and grouping them into
parts, at most one item per child per part: a part meets each child subtree at most once, so a part
that takes two items of the same child would count that child's tokens twice. (The seed's bin-packing
step allows that; it only ever costs more, so excluding it loses nothing.) A state is dropped when
another state at the same node has no more parts and, matched largest to largest, no larger loads:
every completion of the dropped state works for the other one at no higher cost. The number of
groupings grows like the Bell numbers of the leaf count, so `dp_multi` first bounds its work and
refuses trees above `max_work` instead of running for hours.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from jtree.partitioning.path_skeleton import PathSkeleton

DEFAULT_MAX_WORK = 1_000_000


class TooLargeForExactDP(ValueError):
    """`dp_multi` refused a tree whose work bound exceeds `max_work`."""


def dp_single(sk: PathSkeleton, capacity: int) -> list[list[int]]:
    """Optimal single-shared-node partition: groups of skeleton leaves (see module docstring)."""
    tokens = sk.subtree_tokens()
    # best[u] = (cost, parts, selected): lexicographic, so ties prefer fewer parts.
    best: list[tuple[int, int, bool]] = [(0, 0, False)] * sk.n_nodes
    for u in range(sk.n_nodes - 1, -1, -1):
        select = (sk.depth_above(u) + int(tokens[u]), 1, True)
        if not sk.children[u]:
            best[u] = select
            continue
        cost = sum(best[c][0] for c in sk.children[u])
        parts = sum(best[c][1] for c in sk.children[u])
        split = (cost, parts, False)
        best[u] = min(select, split) if select[0] <= capacity else split
    roots = sk.roots
    leaves = sk.leaves_below()
    whole = int(sum(tokens[r] for r in roots))
    split = (sum(best[r][0] for r in roots), sum(best[r][1] for r in roots))
    if whole <= capacity and (whole, 1) <= split:
        return [[leaf for r in roots for leaf in leaves[r]]]
    groups: list[list[int]] = []
    stack = list(reversed(roots))
    while stack:
        u = stack.pop()
        if best[u][2]:
            groups.append(leaves[u])
        else:
            stack.extend(reversed(sk.children[u]))
    return groups


def set_partitions_bounded(k: int, max_block: int) -> int:
    """Number of set partitions of k labelled items into blocks of at most `max_block` items."""
    counts = [1]
    for n in range(1, k + 1):
        counts.append(sum(math.comb(n - 1, i - 1) * counts[n - i]
                          for i in range(1, min(max_block, n) + 1)))
    return counts[k]


def dp_multi_work_bound(sk: PathSkeleton, capacity: int, limit: int) -> int:
    """Upper bound on the partial groupings `dp_multi` enumerates (stops counting above `limit`).

    At a node with k leaves below, each enumerated grouping is a distinct partition of those leaves
    (child states are partitions of the children's leaves, merged), so the count is at most the
    number of set partitions of k with blocks no larger than the most leaves one part can hold
    (prefix through u plus the shortest leaf segments, which are disjoint), times k for the partial
    assignments on the way.
    """
    leaves = sk.leaves_below()
    leaf_len = sk.length
    nodes = [u for u in range(sk.n_nodes) if sk.children[u]]
    groups = [(0, [leaf for r in sk.roots for leaf in leaves[r]])] if len(sk.roots) > 1 else []
    groups += [(int(sk.depth_end[u]), leaves[u]) for u in nodes]
    total = 0
    for prefix, below in groups:
        lens = sorted(int(leaf_len[x]) for x in below)
        block, used = 0, prefix
        for n in lens:
            if used + n > capacity:
                break
            used += n
            block += 1
        k = len(below)
        if block >= 2 and k > 64:  # far beyond any budget: at least the involutions of k
            return limit + 1
        total += k * set_partitions_bounded(k, max(block, 1))
        if total > limit:
            return total
    return total


def dp_multi(sk: PathSkeleton, capacity: int, max_work: int = DEFAULT_MAX_WORK) -> list[list[int]]:
    """Optimal partition (minimum N_computed, then fewest parts): groups of skeleton leaves."""
    bound = dp_multi_work_bound(sk, capacity, max_work)
    if bound > max_work:
        raise TooLargeForExactDP(
            f"tree: too large for method='dp_multi' (up to {bound:.3g} groupings of "
            f"{len(sk.leaves)} path ends to enumerate, above max_work={max_work}); use "
            "method='heuristic' or 'dp_single', or raise max_work"
        )
    # states[u]: {sorted load tuple: (child state keys, members per load)}, members = [(child, item)]
    states: list[dict] = [{} for _ in range(sk.n_nodes)]
    for u in range(sk.n_nodes - 1, -1, -1):
        if not sk.children[u]:
            states[u] = {(int(sk.length[u]),): None}
            continue
        room = capacity - sk.depth_above(u)
        states[u] = _combine(int(sk.length[u]), room, [states[c] for c in sk.children[u]])
    roots = sk.roots
    top = _combine(0, capacity, [states[r] for r in roots], prune=False)
    key = min(top, key=lambda k: (sum(k), len(k)))
    child_keys, members = top[key]
    cache: dict = {}
    return [sorted(leaf for j, i in bin_ for leaf in _rebuild(states, sk, roots[j], child_keys[j],
                                                                cache)[i])
            for bin_ in members]


def _rebuild(states: list[dict], sk: PathSkeleton, u: int, key: tuple, cache: dict) -> list:
    """Leaves of every part in state `key` of node u, aligned with the loads in `key`."""
    if (u, key) in cache:
        return cache[(u, key)]
    back = states[u][key]
    if back is None:
        out = [[u]]
    else:
        child_keys, members = back
        kids = sk.children[u]
        out = [[leaf for j, i in bin_ for leaf in _rebuild(states, sk, kids[j], child_keys[j],
                                                             cache)[i]]
               for bin_ in members]
    cache[(u, key)] = out
    return out


def _combine(own: int, room: int, child_states: list[dict], prune: bool = True) -> dict:
    """All non-dominated ways to group the children's parts into parts through this node."""
    out: dict = {}
    limit = room - own  # most tokens the children may add to one part
    for combo in itertools.product(*[list(s) for s in child_states]):
        items = sorted(((load, j, i) for j, key in enumerate(combo) for i, load in enumerate(key)),
                       reverse=True)
        loads: list[int] = []
        members: list[list[tuple[int, int]]] = []

        def place(n: int) -> None:
            if n == len(items):
                order = sorted(range(len(loads)), key=lambda b: loads[b])
                key = tuple(own + loads[b] for b in order)
                if key not in out:
                    out[key] = (combo, [list(members[b]) for b in order])
                return
            load, j, i = items[n]
            for b in range(len(loads)):
                if loads[b] + load <= limit and all(jj != j for jj, _ in members[b]):
                    loads[b] += load
                    members[b].append((j, i))
                    place(n + 1)
                    members[b].pop()
                    loads[b] -= load
            loads.append(load)
            members.append([(j, i)])
            place(n + 1)
            members.pop()
            loads.pop()

        place(0)
    return _undominated(out) if prune else out


def _undominated(states: dict) -> dict:
    """Drop states another state beats (no more parts, loads matched large to large no larger).

    A dominating state sorts first by (parts, total load), so one pass in that order against the
    states kept so far suffices; the comparison is vectorized per part count.
    """
    keys = sorted(states, key=lambda k: (len(k), sum(k)))
    by_len: dict[int, list[tuple]] = {}
    for k in keys:
        by_len.setdefault(len(k), []).append(k)
    kept_by_len: dict[int, np.ndarray] = {}
    out = {}
    for length, group in by_len.items():
        buf = np.empty((len(group), length), np.int64)
        n_kept = 0
        shorter = [(n, a) for n, a in kept_by_len.items() if len(a)]
        for k in group:
            arr = np.asarray(k, np.int64)
            if any(np.all(a <= arr[length - n:], axis=1).any() for n, a in shorter):
                continue
            if n_kept and np.all(buf[:n_kept] <= arr, axis=1).any():
                continue
            buf[n_kept] = arr
            n_kept += 1
            out[k] = states[k]
        kept_by_len[length] = buf[:n_kept]
    return out
