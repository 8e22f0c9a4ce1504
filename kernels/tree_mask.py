"""The tree mask every attention implementation reads (docs/design.md section 3).

One int per key: query i may attend key j iff j <= i < end[j]. A part of a tree that attends to
keys computed by earlier parts (redundancy-free partitioning) adds `prefix_end` for the P cached
keys laid out before its own; then `end` and `prefix_end` are in the part's combined coordinates
(prefix key j at position j, own token i at position P + i) and queries exist only for the own
tokens, so the same rule decides visibility with query i sitting at key position P + i.

Context parallelism (docs/context_parallel.md) uses the same rule with the queries a window of the
keys: `end` holds the ends of ALL keys of the row (global positions, gathered over the `context`
mesh axis) and `query_offset` (a traced int32 scalar: the device's first position) puts query i
at key position query_offset + i. The prefix form is the special case of a window at the end of
the keys (query_offset = P), kept as its own field because its keys arrive in two pieces.

Padding keys attend only to themselves (end[j] = j + 1): no real query sees them (j <= i fails).

`real` marks the real queries (the batch's `valid`; None: all). A block-sparse kernel skips the
query blocks that hold none (`jtree.kernels.block_tables.classify_blocks`): a gap of a
context-parallel row lies inside the subtree intervals of the nodes it cuts, so its padding
queries would otherwise see those nodes' ancestors. Their outputs are then not the mask's (each
sees at least its own key, so they stay finite) and must be read by nothing, which holds for
padding: its keys are visible to itself only and it is never scored.

Sliding window (`window` W, static, and `positions`): query i additionally needs
pos[i] - pos[j] < W, where pos is a token's depth on its path (its RoPE position, the batch's
`pos`). The window counts along the path: keys of another branch stay invisible by the tree rule,
and the W - 1 path tokens before i (and i) are visible. `positions` [rows, P + S] int32 holds the
path position of every key in the layout of `key_end()`: [prefix keys | own keys] with a prefix,
the whole row's keys under a query offset. A query's position is that of the key position it sits
at (i, P + i, or query_offset + i), so queries need no array of their own. W = None: no window
(`positions` may then be None and is ignored).
"""


from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class TreeMask:
    """`end` [..., S] int32 of the own keys; `prefix_end` [..., P] int32 of cached prefix keys
    (None: no prefix); `query_offset` int32 scalar: the queries are keys query_offset + i of the
    row `end` describes (None: the queries are the keys themselves); `real` [..., queries] bool
    the real queries (None: every query; see the module docstring); `positions` [..., P + S]
    int32 the path position of every key, laid out as `key_end()` (needed when `window` is set);
    `window` (static) the sliding window W along the path (None: full attention). Host (numpy) arrays stay
    numpy, so kernels can build their block tables on the host and `check` can validate them."""

    end: Any
    prefix_end: Any = None
    query_offset: Any = None
    real: Any = None
    positions: Any = None
    window: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    def __post_init__(self) -> None:
        if self.window is not None and (not isinstance(self.window, (int, np.integer))
                                        or isinstance(self.window, bool) or self.window < 1):
            raise ValueError(f"TreeMask: window={self.window!r} must be an int >= 1 or None")
        if self.prefix_end is not None and self.query_offset is not None:
            raise ValueError("TreeMask: a prefix and a query offset cannot be combined (a "
                             "redundancy-free part does not run under context parallelism)")

    @property
    def prefix_len(self) -> int:
        """P, the cached keys before the own ones (0 without a prefix)."""
        return 0 if self.prefix_end is None else self.prefix_end.shape[-1]

    @property
    def is_host(self) -> bool:
        return isinstance(self.end, np.ndarray) and (
            self.prefix_end is None or isinstance(self.prefix_end, np.ndarray))

    def key_end(self) -> Any:
        """`end` of every key, [prefix keys | own keys]: [rows, P + S]."""
        if self.prefix_end is None:
            return self.end
        if self.is_host:
            return np.concatenate([self.prefix_end, self.end], axis=-1)
        return jnp.concatenate([jnp.asarray(self.prefix_end, jnp.int32),
                                jnp.asarray(self.end, jnp.int32)], axis=-1)

    def padded(self, sq: int, skv: int, queries: int | None = None) -> tuple[Any, Any]:
        """(end [rows, skv], q_pos [rows, sq] or None) for a kernel that runs sq queries over
        skv >= P + S keys: padding keys see only themselves, padding queries sit on the last key
        position (their outputs are dropped). `queries` is the number of real queries: S (the
        default) unless the mask has a `query_offset`. `q_pos` (each query's key position) is
        None for a square call, whose queries are the keys (sq == skv)."""
        rows, s = self.end.shape[0], self.end.shape[-1]
        p = self.prefix_len
        nq = s if queries is None else queries
        if sq < nq or skv < p + s:
            raise ValueError(f"padded: ({sq}, {skv}) is shorter than the mask's ({nq}, {p + s})")
        end = self.key_end()
        if skv > p + s:
            tail = np.arange(p + s, skv, dtype=np.int32) + 1
            end = (np.concatenate([end, np.broadcast_to(tail, (rows, len(tail)))], axis=1)
                   if isinstance(end, np.ndarray) else
                   jnp.concatenate([jnp.asarray(end, jnp.int32),
                                    jnp.broadcast_to(jnp.asarray(tail), (rows, len(tail)))], 1))
        if self.query_offset is not None:
            own = jnp.asarray(self.query_offset, jnp.int32) + jnp.arange(nq, dtype=jnp.int32)
            q_pos = jnp.concatenate([own, jnp.full(sq - nq, skv - 1, jnp.int32)])
            return jnp.asarray(end, jnp.int32), jnp.broadcast_to(q_pos, (rows, sq))
        if self.prefix_end is None:
            if sq != skv:
                raise ValueError(f"padded: a mask without a prefix is square; got ({sq}, {skv})")
            return end, None
        q_pos = np.concatenate([np.arange(p, p + s, dtype=np.int32),
                                np.full(sq - s, skv - 1, np.int32)])
        q_pos = np.broadcast_to(q_pos, (rows, sq))
        return end, (q_pos if isinstance(end, np.ndarray) else jnp.asarray(q_pos))

    def padded_positions(self, skv: int) -> Any:
        """Path positions [rows, skv] of the keys of a kernel that runs skv >= P + S keys
        (padding keys at position 0: they see only themselves, and a query at a padding key
        position reads the same 0), or None without a window."""
        if self.window is None:
            return None
        pos = self.positions
        if pos is None:
            raise ValueError("TreeMask: a window needs `positions` (the path position of every key)")
        n = self.end.shape[-1] + self.prefix_len
        if tuple(pos.shape) != (self.end.shape[0], n):
            raise ValueError(f"positions: shape {tuple(pos.shape)}, expected [rows, P + S] = "
                             f"{(self.end.shape[0], n)} (the layout of key_end())")
        if skv < n:
            raise ValueError(f"padded_positions: {skv} keys are fewer than the mask's {n}")
        width = ((0, 0), (0, skv - n))
        if isinstance(pos, np.ndarray):
            return np.pad(pos.astype(np.int32), width)
        return jnp.pad(jnp.asarray(pos, jnp.int32), width)

    def padded_real(self, sq: int) -> Any:
        """`real` [rows, sq] for a kernel that runs sq queries (padding queries are not real),
        or None when every query is real."""
        if self.real is None:
            return None
        real = self.real
        if real.shape[-1] > sq:
            raise ValueError(f"padded_real: {sq} queries are fewer than the mask's "
                             f"{real.shape[-1]}")
        width = ((0, 0), (0, sq - real.shape[-1]))
        if isinstance(real, np.ndarray):
            return np.pad(real.astype(bool), width)
        return jnp.pad(jnp.asarray(real, bool), width)

    def check(self) -> None:
        """On host arrays: every key sees itself and no key's subtree reaches past the row
        (end[j] in (j, P + S]); prefix keys have no query, so they only need end[j] > j. Traced
        masks cannot be checked and pass."""
        if not self.is_host:
            return
        end = self.key_end()
        if not np.issubdtype(end.dtype, np.integer):
            raise ValueError(f"end: dtype {end.dtype} is not an integer type")
        j = np.arange(end.shape[1])
        bad = (end <= j) | (end > end.shape[1])
        if bad.any():
            r, i = map(int, np.argwhere(bad)[0])
            where = f"token {i}" if i >= self.prefix_len else f"prefix key {i}"
            raise ValueError(f"end: row {r}, {where} has end={int(end[r, i])}; need "
                             f"{i} < end <= S={end.shape[1]} (every token sees itself)")
