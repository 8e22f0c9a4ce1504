"""The order parts of a redundancy-free program run in, and the buffers the run holds.

The executor (`jtree.rfree.execute`) runs the part tree in post-order: a part's forward, then each
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
"""

from __future__ import annotations

from typing import Any

import jax

from jtree.rfree.layout import RfreeProgram


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
