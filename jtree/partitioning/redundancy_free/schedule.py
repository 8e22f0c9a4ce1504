"""The order parts of a redundancy-free program run in, and the buffers the run holds.

The executor (`jtree.partitioning.redundancy_free.executor`) runs the part tree in post-order: a part's forward, then each
child subtree completely (forward and backward), then the part's backward as soon as the last
child has handed back its prefix cotangents. While a subtree runs, only the parts on the chain from
its root part down to the running part hold buffers (residuals or outputs, their prefix, and the
cotangent accumulators), seed 003's KV stack at the granularity of parts; a finished subtree leaves
nothing behind but its sums in its parent's accumulators.

Which child goes first still matters: a part's accumulators (the cotangents of its outputs and
prefix) exist from the first child's return on, so they are live during every child but the first.
Running the child subtree with the largest need first minimizes the peak, the Sethi-Ullman order:

    need(k) = held(k) + max_i (need(c_i) + [i > 0] * acc(k))

with children c_0, c_1, ... in run order. Sizes are in token slots of the static shapes: a part
holds S + P slots (row and prefix region), its accumulators S + P too.

On a mesh (`jtree.partitioning.redundancy_free.mesh_executor`) the row shards run in lockstep, one part row per shard per step
(`lockstep`): each shard runs whole part trees (a tree's parts stay on one shard, so a child
finds its prefix where its parent left it), in the same post-order, and shards with fewer calls
idle on padding steps at the end.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jtree.layout.balance import assign_to_ranks
from jtree.partitioning.redundancy_free.layout import RfreeProgram


def part_slots(program: RfreeProgram, k: int) -> int:
    """Token slots of part k's row and prefix region (what its buffers scale with)."""
    part = program.parts[k]
    return int(part.inputs.shape[1]) + part.prefix_len


def child_order(program: RfreeProgram) -> list[tuple[int, ...]]:
    """Per part, its children in run order: largest subtree need first (module docstring); ties
    keep the plan's DFS order."""
    need = [0] * len(program.parts)
    order: list[tuple[int, ...]] = [()] * len(program.parts)
    for k in reversed(range(len(program.parts))):  # children come after their parent
        kids = program.parts[k].children
        order[k] = tuple(sorted(kids, key=lambda c: -need[c]))
        slots = part_slots(program, k)
        below = max([need[c] + (slots if i else 0) for i, c in enumerate(order[k])], default=0)
        need[k] = slots + below
    return order


class LiveBuffers:
    """The device buffers the executor holds between its calls, by (kind, part).

    `events` records every device call as (name, part, held (kind, part) keys, live bytes); bytes
    count each held array once (by identity), so they are real buffer sizes, not estimates.
    `peak_bytes` is the largest of them. Array sizes are read once, when a tree is held: the
    accounting runs at every device call and must stay cheap next to it.
    """

    def __init__(self) -> None:
        self.held: dict[tuple[str, int], Any] = {}
        self._sizes: dict[tuple[str, int], dict[int, int]] = {}  # key -> {id(array): bytes}
        self.events: list[tuple[str, int, frozenset[tuple[str, int]], int]] = []
        self.peak_bytes = 0

    def hold(self, kind: str, part: int, tree: Any) -> None:
        self.held[(kind, part)] = tree
        self._sizes[(kind, part)] = {id(x): x.nbytes for x in jax.tree_util.tree_leaves(tree)
                                     if isinstance(x, jax.Array)}

    def drop(self, kind: str, part: int) -> None:
        self.held.pop((kind, part), None)
        self._sizes.pop((kind, part), None)

    def live_bytes(self) -> int:
        arrays: dict[int, int] = {}
        for sizes in self._sizes.values():
            arrays.update(sizes)
        return sum(arrays.values())

    def call(self, name: str, part: int) -> None:
        now = self.live_bytes()
        self.peak_bytes = max(self.peak_bytes, now)
        self.events.append((name, part, frozenset(self.held), now))


@dataclasses.dataclass(frozen=True)
class Lockstep:
    """The calls of a program over `n_shards` row shards in lockstep: at step t, shard d runs
    part `part[t, d]` (-1: an idle step). A part with children is called twice, forward first
    (`backward` False: it leaves its prefix and outputs at level `depth` for its children) and
    backward after its last child (`backward` True: loss, gradients, and the cotangents of its
    parent's buffers); a leaf part once, backward. `groups[d]`: the root parts whose part
    trees shard d runs, in order; `loads[d]`: its calls. `levels`: the buffer levels a shard
    holds (the depth of the deepest part with children, plus one)."""

    part: np.ndarray  # [T, n_shards] int32
    backward: np.ndarray  # [T, n_shards] bool
    depth: np.ndarray  # [T, n_shards] int32
    groups: tuple[tuple[int, ...], ...]
    loads: tuple[int, ...]
    levels: int

    @property
    def steps(self) -> int:
        return self.part.shape[0]


def part_calls(program: RfreeProgram) -> list[int]:
    """Per part, the calls of its whole part tree in lockstep (two per part with children, one
    per leaf): a shard's time, since every call runs one row of the same shape."""
    calls = [0] * len(program.parts)
    for k in reversed(range(len(program.parts))):  # children come after their parent
        part = program.parts[k]
        calls[k] = (2 if part.children else 1) + sum(calls[c] for c in part.children)
    return calls


def lockstep(program: RfreeProgram, n_shards: int, min_steps: int = 1) -> Lockstep:
    """The lockstep schedule of `program` (module docstring): part trees balanced over the
    shards by their calls (`jtree.layout.balance.assign_to_ranks`), each run in `child_order`; at least
    `min_steps` steps (a fixed step count compiles once)."""
    if program.whole is not None:
        raise ValueError("program: has whole-tree micro-batches; build it with uniform=True "
                         "for the mesh executor")
    order = child_order(program)
    roots = [k for k, p in enumerate(program.parts) if p.parent < 0]
    assignment = assign_to_ranks([part_calls(program)[r] for r in roots], n_shards)
    depth = np.zeros(len(program.parts), np.int32)
    for k, p in enumerate(program.parts):  # parents come first
        depth[k] = depth[p.parent] + 1 if p.parent >= 0 else 0
    calls: list[list[tuple[int, bool]]] = []
    for members in assignment.ranks:
        seq: list[tuple[int, bool]] = []
        # Post-order without recursion (part trees can be deep): (part, children entered?).
        stack = [(roots[i], False) for i in reversed(members)]
        while stack:
            k, entered = stack.pop()
            kids = order[k]
            if entered or not kids:
                seq.append((k, True))
                continue
            seq.append((k, False))
            stack.append((k, True))
            stack.extend((c, False) for c in reversed(kids))
        calls.append(seq)
    steps = max([min_steps] + [len(seq) for seq in calls])
    part = np.full((steps, n_shards), -1, np.int32)
    backward = np.zeros((steps, n_shards), bool)
    for d, seq in enumerate(calls):
        for t, (k, back) in enumerate(seq):
            part[t, d], backward[t, d] = k, back
    inner = [depth[k] for k, p in enumerate(program.parts) if p.children]
    return Lockstep(part, backward, np.where(part >= 0, depth[np.maximum(part, 0)], 0),
                    tuple(tuple(roots[i] for i in members) for members in assignment.ranks),
                    tuple(len(seq) for seq in calls), max(inner, default=0) + 1)
