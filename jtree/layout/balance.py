"""Data-parallel balancing: give every rank about the same work (docs/design.md section 5).

Work model: the cost of a tree (or part) is its tree tokens plus `attention_weight` times its
attention pairs (each token attends to the tokens of its own path up to itself, so a tree has
sum_t (pos_t + 1) pairs). `attention_weight` is the cost of one (query, key) pair in units of one
token's dense work, e.g. about 4 * layers * heads * head_dim / (2 * params) for a dense model.

Two problems, two algorithms:

- `assign_to_ranks`: independent items (whole trees or parts) onto n ranks, minimizing the largest
  rank cost. The better of longest-processing-time first (LPT) and MULTIFIT, each followed by moves
  and swaps off the most loaded rank while they lower it. Not optimal in general (the problem is
  NP-hard; LPT alone is within 4/3 of the optimum). Measured on random workloads (log-normal,
  uniform and Pareto item costs, 2-16 ranks): with 6 or more items per rank the largest load is
  within 5% of the lower bound max(total / n, largest item) (tests/test_balance.py); with only 2-4
  items per rank that bound is often unreachable (brute force finds optima several % above it).
- `split_contiguous`: one tree's paths split across n ranks as contiguous runs in DFS order (seed
  003, Algorithm 4). Contiguous DFS runs keep most sharing (each cut duplicates at most one path's
  prefix). The result is *optimal* for the contiguous problem: the cost of a run is monotone under
  inclusion, so greedy extension decides feasibility of a bound exactly, and the search below only
  stops when the achieved bound is also a proven lower bound.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

import numpy as np

from jtree.layout.bin_packing import first_fit_decreasing
from jtree.trees.part import TreePart
from jtree.trees.tree import TrajectoryTree


def attention_pairs(tree: TrajectoryTree) -> int:
    """Visible (query, key) pairs of a tree under the tree mask: sum over tokens of pos + 1."""
    return int(tree.token_arrays["pos"].astype(np.int64).sum() + tree.n_tree_tokens)


def tree_cost(tree: TrajectoryTree, attention_weight: float = 0.0) -> float:
    """Tree tokens plus `attention_weight` times attention pairs."""
    return tree.n_tree_tokens + attention_weight * attention_pairs(tree)


@dataclasses.dataclass(frozen=True)
class RankAssignment:
    """Item indices per rank with the resulting loads."""

    ranks: tuple[tuple[int, ...], ...]
    loads: tuple[float, ...]
    lower_bound: float

    @property
    def max_load(self) -> float:
        return max(self.loads)

    @property
    def imbalance(self) -> float:
        """max load / lower bound - 1 (0 means provably optimal)."""
        return self.max_load / self.lower_bound - 1.0 if self.lower_bound > 0 else 0.0


def assign_to_ranks(costs: Sequence[float], n_ranks: int) -> RankAssignment:
    """Assign items with `costs` to `n_ranks` ranks minimizing the largest rank load."""
    _check_ranks(n_ranks)
    costs = np.asarray(costs, np.float64)
    if costs.ndim != 1 or not np.all(np.isfinite(costs)) or np.any(costs < 0):
        raise ValueError("costs: need a 1-D list of finite non-negative item costs")
    best: tuple[list[list[int]], np.ndarray] | None = None
    for members in (_longest_first(costs, n_ranks), _multifit(costs, n_ranks)):
        if members is None:
            continue
        loads = np.array([costs[m].sum() for m in members], np.float64)
        _improve(costs, members, loads)
        if best is None or loads.max() < best[1].max():
            best = (members, loads)
    members, loads = best
    lower = max(float(costs.sum()) / n_ranks, float(costs.max(initial=0.0)))
    return RankAssignment(tuple(tuple(sorted(m)) for m in members), tuple(float(x) for x in loads),
                          lower)


def _longest_first(costs: np.ndarray, n_ranks: int) -> list[list[int]]:
    """LPT: each item, largest first, to the currently least loaded rank."""
    members: list[list[int]] = [[] for _ in range(n_ranks)]
    heap = [(0.0, r) for r in range(n_ranks)]
    for i in np.argsort(-costs, kind="stable"):
        load, r = heapq.heappop(heap)
        members[r].append(int(i))
        heapq.heappush(heap, (load + costs[i], r))
    return members


def _multifit(costs: np.ndarray, n_ranks: int, rounds: int = 20) -> list[list[int]] | None:
    """MULTIFIT: binary search the smallest rank capacity at which first fit decreasing needs at
    most `n_ranks` ranks (often better than LPT when there are few items per rank)."""
    lo = max(float(costs.sum()) / n_ranks, float(costs.max(initial=0.0)))
    hi = max(2.0 * float(costs.sum()) / n_ranks, lo)
    found = None
    for _ in range(rounds):
        cap = (lo + hi) / 2
        members = first_fit_decreasing(costs, cap)
        if len(members) <= n_ranks:
            hi, found = cap, members + [[] for _ in range(n_ranks - len(members))]
        else:
            lo = cap
    return found


def _improve(costs: np.ndarray, members: list[list[int]], loads: np.ndarray) -> None:
    """Move or swap one item between the most loaded rank and another while that lowers the max."""
    for _ in range(10 * (sum(len(m) for m in members) + 1)):  # each round lowers the load profile
        hi = int(np.argmax(loads))
        best = (0.0, None)  # (reduction of the max of the two ranks, action)
        for lo in range(len(loads)):
            if lo == hi:
                continue
            gap = loads[hi] - loads[lo]
            for a in members[hi]:
                # moving a: new pair max = max(loads[hi] - c_a, loads[lo] + c_a)
                for b in [None, *members[lo]]:
                    delta = costs[a] - (costs[b] if b is not None else 0.0)
                    if 0 < delta < gap:
                        gain = loads[hi] - max(loads[hi] - delta, loads[lo] + delta)
                        if gain > best[0] + 1e-12:
                            best = (gain, (lo, a, b))
        if best[1] is None:
            return
        lo, a, b = best[1]
        delta = costs[a] - (costs[b] if b is not None else 0.0)
        members[hi].remove(a)
        members[lo].append(a)
        if b is not None:
            members[lo].remove(b)
            members[hi].append(b)
        loads[hi] -= delta
        loads[lo] += delta


@dataclasses.dataclass(frozen=True, eq=False)
class ContiguousSplit:
    """One tree's paths split into per-rank parts (DFS-contiguous runs); empty ranks get None."""

    parts: tuple[TreePart | None, ...]
    costs: tuple[float, ...]

    @property
    def max_cost(self) -> float:
        return max(self.costs)


def split_contiguous(
    tree: TrajectoryTree, n_ranks: int, *, attention_weight: float = 0.0
) -> ContiguousSplit:
    """Split `tree`'s paths into `n_ranks` DFS-contiguous runs minimizing the largest run cost.

    Paths are ordered by the DFS position of their end node (a valid DFS leaf order; duplicates and
    prefixes sit next to the paths they share with). A run's cost is that of the part it becomes:
    `tree_cost(part, attention_weight)`. With more ranks than paths, the extra ranks get no part.
    """
    _check_ranks(n_ranks)
    order = np.argsort(tree.path_nodes, kind="stable")
    first, step = _run_costs(tree, order, attention_weight)
    runs = contiguous_runs(first, step, n_ranks)
    parts = [TreePart.from_paths(tree, order[a:b]) for a, b in runs]
    costs = [tree_cost(p, attention_weight) for p in parts]
    pad = n_ranks - len(parts)
    return ContiguousSplit(tuple(parts) + (None,) * pad, tuple(costs) + (0.0,) * pad)


def _run_costs(
    tree: TrajectoryTree, order: np.ndarray, attention_weight: float
) -> tuple[np.ndarray, np.ndarray]:
    """Cost of each path alone, and what it adds after the previous path (shared prefix skipped)."""
    lengths = tree.path_lengths[order].astype(np.float64)
    lcp = np.zeros(len(order))
    last = tree.subtree_last_node
    depth = {int(tree.path_nodes[p]): int(tree.path_lengths[p]) for p in order}
    for i in range(1, len(order)):
        a, x = int(tree.path_nodes[order[i - 1]]), int(tree.path_nodes[order[i]])
        while x >= 0 and not (x <= a <= last[x]):  # climb to the lowest common ancestor
            x = int(tree.parents[x])
        lcp[i] = 0 if x < 0 else _depth_tokens(tree, x, depth)
    pairs = lengths * (lengths + 1) / 2
    first = lengths + attention_weight * pairs
    step = (lengths - lcp) + attention_weight * (pairs - lcp * (lcp + 1) / 2)
    return first, step


def _depth_tokens(tree: TrajectoryTree, node: int, cache: dict[int, int]) -> int:
    """Tokens from the root through the end of `node`."""
    if node not in cache:
        chain, x = [], node
        while x >= 0 and x not in cache:
            chain.append(x)
            x = int(tree.parents[x])
        total = cache[x] if x >= 0 else 0
        for y in reversed(chain):
            total += int(tree.node_offsets[y + 1] - tree.node_offsets[y])
            cache[y] = total
    return cache[node]


def contiguous_runs(first: np.ndarray, step: np.ndarray, n_runs: int) -> list[tuple[int, int]]:
    """Optimal split of a sequence into at most `n_runs` contiguous runs, minimizing the max cost.

    The cost of run [a, b) is first[a] + step[a+1] + ... + step[b-1] and must be monotone under
    inclusion (step >= 0 and first[a] + step[a+1] >= first[a+1]). Search: `hi` is the max cost of a
    feasible greedy split; `lo` is a proven lower bound (greedy at threshold t fails, and it keeps
    failing until t reaches the smallest cost at which one of its runs could take one more item, so
    the optimum is at least that). Each probe halves [lo, hi]; the loop ends when lo >= hi, so the
    returned split is optimal. Runs with several items are then split while fewer than `n_runs`.
    """
    n = len(first)
    if n == 0:
        return []
    lo = float(np.max(first))
    runs, hi, _ = _greedy(first, step, float("inf"))
    while lo < hi:
        probe = lo + (hi - lo) / 2
        if probe >= hi:  # lo and hi are adjacent floats
            probe = lo
        probe_runs, probe_max, grow = _greedy(first, step, probe)
        if len(probe_runs) <= n_runs:
            runs, hi = probe_runs, probe_max
        else:
            lo = grow
    prefix = np.concatenate([[0.0], np.cumsum(step)])
    while len(runs) < min(n_runs, n):  # spare ranks: split the costliest run (never raises max)
        costs = [_cost(first, prefix, a, b) if b - a > 1 else -1.0 for a, b in runs]
        k = int(np.argmax(costs))
        a, b = runs[k]
        cut = min(range(a + 1, b), key=lambda c: max(_cost(first, prefix, a, c),
                                                     _cost(first, prefix, c, b)))
        runs[k : k + 1] = [(a, cut), (cut, b)]
    return runs


def _cost(first: np.ndarray, prefix: np.ndarray, a: int, b: int) -> float:
    """Cost of run [a, b) from prefix sums of `step` (for choosing cuts only)."""
    return float(first[a] + prefix[b] - prefix[a + 1])


def _greedy(
    first: np.ndarray, step: np.ndarray, limit: float
) -> tuple[list[tuple[int, int]], float, float]:
    """Greedy runs of cost <= limit: (runs, their max cost, smallest limit that would change them)."""
    runs: list[tuple[int, int]] = []
    start, cost, worst, grow = 0, float(first[0]), float(first[0]), float("inf")
    for i in range(1, len(first)):
        extended = cost + float(step[i])
        if extended <= limit:
            cost = extended
        else:
            grow = min(grow, extended)
            runs.append((start, i))
            start, cost = i, float(first[i])
        worst = max(worst, cost)
    runs.append((start, len(first)))
    return runs, worst, grow


def _check_ranks(n_ranks: int) -> None:
    if isinstance(n_ranks, bool) or not isinstance(n_ranks, (int, np.integer)) or n_ranks < 1:
        raise ValueError(f"n_ranks: must be a positive integer, got {n_ranks!r}")
