"""Trajectory trees: token sequences that share prefixes, stored once.

A `TrajectoryTree` is a forest of nodes, each holding a non-empty token segment, laid out in
depth-first pre-order (a parent always precedes its children and a node's subtree is a contiguous
range of nodes, hence of tokens). A *path* is one training sequence: the tokens from a root down to
the node where that sequence ends. Paths may end at internal nodes and several paths may end at the
same node (duplicates). Per-path data (loss mask, advantage, reward, old log-probs, weight) stays
per path; `jtree.layout.coefficients` folds it into per-tree-token coefficients and `jtree.objectives.advantages` turns
rewards into advantages.

Trees are immutable after construction, so derived arrays are computed once and cached.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from jtree.trees.path_data import (
    ArrayLike,
    PathData,
    as_token_array,
    path_routing,
    validate_path_data,
)


@dataclasses.dataclass(frozen=True)
class TreeStats:
    """Sharing statistics of one tree (or a sum of trees)."""

    n_tree_tokens: int
    n_flat_tokens: int
    n_paths: int
    n_nodes: int
    max_depth: int
    max_path_len: int

    @property
    def por(self) -> float:
        """Potential overlap ratio: fraction of flat tokens that are repeats."""
        return 1.0 - self.n_tree_tokens / self.n_flat_tokens if self.n_flat_tokens else 0.0

    @property
    def compression(self) -> float:
        return self.n_flat_tokens / self.n_tree_tokens if self.n_tree_tokens else 1.0

    def as_dict(self) -> dict[str, float]:
        out = dataclasses.asdict(self)
        out.update(por=self.por, compression=self.compression)
        return out

    def __add__(self, other: TreeStats) -> TreeStats:
        return TreeStats(
            n_tree_tokens=self.n_tree_tokens + other.n_tree_tokens,
            n_flat_tokens=self.n_flat_tokens + other.n_flat_tokens,
            n_paths=self.n_paths + other.n_paths,
            n_nodes=self.n_nodes + other.n_nodes,
            max_depth=max(self.max_depth, other.max_depth),
            max_path_len=max(self.max_path_len, other.max_path_len),
        )


class _TrieNode:
    """Mutable node used only while merging sequences into a compressed trie."""

    __slots__ = ("tokens", "children", "ends")

    def __init__(self, tokens: np.ndarray, ends: list[int]):
        self.tokens = tokens
        self.children: dict[int, _TrieNode] = {}
        self.ends = ends


class TrajectoryTree:
    """A forest of token segments in DFS pre-order with paths ending at nodes.

    Build it with `from_sequences` (merge sequences into a compressed trie) or `from_nodes`
    (explicit parents and segments). Node indices are DFS pre-order positions; `path_nodes[p]` is
    the node where path `p` ends, and paths keep the order in which they were given.
    """

    def __init__(
        self,
        parents: np.ndarray,
        segments: Sequence[np.ndarray],
        path_nodes: np.ndarray,
        path_data: PathData,
    ):
        # Private: callers go through the validated constructors below.
        self.parents = parents
        self.segments = tuple(segments)
        self.path_nodes = path_nodes
        self._data = path_data
        self.node_offsets = np.concatenate([[0], np.cumsum([len(s) for s in segments])]).astype(
            np.int32
        )
        self.tokens = np.concatenate(self.segments).astype(np.int32)
        self._chain_cache: dict[int, np.ndarray] = {}

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_sequences(
        cls,
        sequences: Sequence[ArrayLike],
        *,
        loss_masks: Sequence[ArrayLike] | None = None,
        advantages: Sequence[ArrayLike] | None = None,
        old_logprobs: Sequence[ArrayLike] | None = None,
        weights: ArrayLike | None = None,
        rewards: Sequence[ArrayLike] | None = None,
        vocab_size: int | None = None,
        routed_experts: Sequence[ArrayLike] | None = None,
    ) -> TrajectoryTree:
        """Merge token sequences into a compressed trie, one node per maximal shared segment.

        `advantages` holds a scalar or a per-token array per sequence; `loss_masks` and
        `old_logprobs` hold per-token arrays; `rewards` a number or a list of per-turn numbers
        per sequence (summed); `routed_experts` an array [len, L, k] per sequence (routing
        replay: `routed_experts`). Sequences with different first tokens become separate
        roots. The first token of each sequence is never scored (it has no context).
        """
        if len(sequences) == 0:
            raise ValueError("sequences: need at least one sequence")
        arrays = [as_token_array(s, f"sequence {i}", vocab_size) for i, s in enumerate(sequences)]
        data = validate_path_data(
            [len(a) for a in arrays], loss_masks, advantages, old_logprobs, weights, "sequence",
            rewards,
        )
        data = dataclasses.replace(data, routed_experts=path_routing(
            routed_experts, [len(a) for a in arrays], "sequence"))
        roots: dict[int, _TrieNode] = {}
        for p, seq in enumerate(arrays):
            children, node, i = roots, None, 0
            while True:
                if i == len(seq):
                    node.ends.append(p)
                    break
                child = children.get(int(seq[i]))
                if child is None:
                    children[int(seq[i])] = _TrieNode(seq[i:], [p])
                    break
                seg = child.tokens
                n = min(len(seg), len(seq) - i)
                diff = np.flatnonzero(seg[:n] != seq[i : i + n])
                match = int(diff[0]) if diff.size else n
                if match < len(seg):  # split the node where the new sequence leaves it
                    lower = _TrieNode(seg[match:], child.ends)
                    lower.children = child.children
                    child.tokens, child.ends = seg[:match], []
                    child.children = {int(seg[match]): lower}
                i += match
                node, children = child, child.children
        parents, segments, path_nodes = [], [], np.zeros(len(arrays), np.int32)
        stack = [(r, -1) for r in reversed(list(roots.values()))]
        while stack:
            trie_node, parent = stack.pop()
            idx = len(segments)
            parents.append(parent)
            segments.append(trie_node.tokens)
            path_nodes[trie_node.ends] = idx
            stack.extend((c, idx) for c in reversed(list(trie_node.children.values())))
        return cls(np.asarray(parents, np.int32), segments, path_nodes, data)

    @classmethod
    def from_nodes(
        cls,
        parents: Sequence[int],
        segments: Sequence[ArrayLike],
        *,
        path_nodes: Sequence[int] | None = None,
        loss_masks: Sequence[ArrayLike] | None = None,
        advantages: Sequence[ArrayLike] | None = None,
        old_logprobs: Sequence[ArrayLike] | None = None,
        weights: ArrayLike | None = None,
        rewards: Sequence[ArrayLike] | None = None,
        vocab_size: int | None = None,
        routed_experts: Sequence[ArrayLike] | None = None,
    ) -> TrajectoryTree:
        """Build an explicit tree: `parents[i]` is node i's parent (-1 for a root).

        `path_nodes` lists the node each path ends at (default: one path per leaf, in node order).
        Per-path arrays are aligned with the path's full token sequence (root to end node). Nodes
        may be given in any order; they are stored in DFS pre-order, so node indices of the result
        can differ from the input's (`path_nodes` of the result are remapped accordingly).
        """
        n = len(segments)
        if n == 0:
            raise ValueError("segments: need at least one node")
        if len(parents) != n:
            raise ValueError(f"parents: got {len(parents)} entries for {n} segments")
        segs = [as_token_array(s, f"node {i}", vocab_size) for i, s in enumerate(segments)]
        par = np.asarray(parents)
        if par.dtype == bool or not np.issubdtype(par.dtype, np.integer):
            raise ValueError(f"parents: must be integers, got dtype {par.dtype}")
        for i, p in enumerate(par):
            if p < -1 or p >= n or p == i:
                raise ValueError(f"node {i}: parent = {int(p)} is out of range or itself (n={n})")
        children: list[list[int]] = [[] for _ in range(n)]
        for i, p in enumerate(par):
            if p >= 0:
                children[p].append(i)
        order: list[int] = []
        stack = [i for i in reversed(range(n)) if par[i] < 0]
        while stack:
            i = stack.pop()
            order.append(i)
            stack.extend(reversed(children[i]))
        if len(order) != n:
            seen = np.zeros(n, bool)
            seen[order] = True
            bad = int(np.flatnonzero(~seen)[0])
            raise ValueError(f"node {bad}: parent chain forms a cycle (not reachable from a root)")
        new_index = np.empty(n, np.int32)
        new_index[order] = np.arange(n, dtype=np.int32)
        new_parents = np.array([new_index[par[i]] if par[i] >= 0 else -1 for i in order], np.int32)
        if path_nodes is None:
            ends = np.array([i for i in range(n) if not children[i]], np.int64)
        else:
            ends = np.asarray(path_nodes)
            if ends.ndim != 1 or ends.size == 0 or not np.issubdtype(ends.dtype, np.integer):
                raise ValueError("path_nodes: must be a non-empty 1-D list of node indices")
            bad = np.flatnonzero((ends < 0) | (ends >= n))
            if bad.size:
                raise ValueError(f"path {int(bad[0])}: path_nodes = {int(ends[bad[0]])} out of range")
        seg_len = np.array([len(s) for s in segs])
        new_len = seg_len[order]
        depth_tokens = np.zeros(n, np.int64)  # tokens from root to the end of each (new) node
        for i in range(n):
            p = new_parents[i]
            depth_tokens[i] = new_len[i] + (depth_tokens[p] if p >= 0 else 0)
        new_ends = new_index[ends]
        lengths = [int(depth_tokens[e]) for e in new_ends]
        data = validate_path_data(
            lengths,
            loss_masks,
            advantages,
            old_logprobs,
            weights,
            "path",
            rewards,
        )
        data = dataclasses.replace(data, routed_experts=path_routing(routed_experts, lengths,
                                                                     "path"))
        return cls(new_parents, [segs[i] for i in order], new_ends.astype(np.int32), data)

    # ------------------------------------------------------------------ basic properties

    @property
    def n_nodes(self) -> int:
        return len(self.segments)

    @property
    def n_paths(self) -> int:
        return len(self.path_nodes)

    @property
    def n_tree_tokens(self) -> int:
        return int(self.node_offsets[-1])

    @property
    def weights(self) -> np.ndarray:
        return self._data.weights

    @property
    def loss_masks(self) -> tuple[np.ndarray, ...]:
        return self._data.loss_masks

    @property
    def advantages(self) -> tuple[np.ndarray, ...] | None:
        return self._data.advantages

    @property
    def old_logprobs(self) -> tuple[np.ndarray, ...] | None:
        return self._data.old_logprobs

    @property
    def routed_experts(self) -> tuple[np.ndarray, ...] | None:
        """Per path, the rollout engine's routed experts [len(path), L, k] int32 (-1 rows: the
        trainer routes the token itself; routing replay, docs/rl.md), or None."""
        return self._data.routed_experts

    def with_routed_experts(self, routed: Sequence[ArrayLike] | None) -> TrajectoryTree:
        """This tree with its per-path routed experts replaced (None: removed)."""
        data = dataclasses.replace(self._data, routed_experts=path_routing(
            routed, self.path_lengths.tolist(), "path"))
        return TrajectoryTree(self.parents, self.segments, self.path_nodes, data)

    @functools.cached_property
    def rewards(self) -> np.ndarray | None:
        """One float64 reward per path (its per-turn rewards summed), or None."""
        turns = self._data.rewards
        return None if turns is None else np.array([float(r.sum()) for r in turns])

    @property
    def turn_rewards(self) -> tuple[np.ndarray, ...] | None:
        """Per path, its rewards per turn as the record gives them (float64 [T]; a single
        number is one turn's), or None."""
        return self._data.rewards

    def with_advantages(self, advantages: Sequence[ArrayLike]) -> TrajectoryTree:
        """This tree with its per-path advantages replaced (a scalar or per-token array per
        path, validated like the constructors'), e.g. the ones `jtree.objectives.advantages` computes."""
        adv = validate_path_data(self.path_lengths.tolist(), None, advantages, None, None,
                                  "path").advantages
        return TrajectoryTree(self.parents, self.segments, self.path_nodes,
                              dataclasses.replace(self._data, advantages=adv))

    @functools.cached_property
    def path_lengths(self) -> np.ndarray:
        return self._node_depth_tokens[self.path_nodes].astype(np.int64)

    @functools.cached_property
    def _node_depth_tokens(self) -> np.ndarray:
        """Number of tokens from the root through the end of each node."""
        lengths = np.diff(self.node_offsets)
        out = np.zeros(self.n_nodes, np.int64)
        for i, p in enumerate(self.parents):
            out[i] = lengths[i] + (out[p] if p >= 0 else 0)
        return out

    @functools.cached_property
    def node_levels(self) -> np.ndarray:
        """Depth of each node counted in nodes (roots have level 1)."""
        out = np.zeros(self.n_nodes, np.int64)
        for i, p in enumerate(self.parents):
            out[i] = 1 + (out[p] if p >= 0 else 0)
        return out

    @functools.cached_property
    def subtree_last_node(self) -> np.ndarray:
        """Index of the last node (DFS pre-order) in each node's subtree."""
        last = np.arange(self.n_nodes, dtype=np.int32)
        for i in range(self.n_nodes - 1, -1, -1):
            p = self.parents[i]
            if p >= 0 and last[i] > last[p]:
                last[p] = last[i]
        return last

    def path_tokens(self, p: int) -> np.ndarray:
        """The token sequence of path `p` (what the per-branch baseline trains on)."""
        return self.tokens[self.path_token_index(p)]

    def path_token_index(self, p: int) -> np.ndarray:
        """Tree-token indices of path `p`, in path order."""
        return self._chain_token_index(int(self.path_nodes[p]))

    def _chain_token_index(self, node: int) -> np.ndarray:
        cached = self._chain_cache.get(node)
        if cached is not None:
            return cached
        key, chain = node, []
        while node >= 0:
            chain.append(node)
            node = int(self.parents[node])
        off = self.node_offsets
        out = np.concatenate([np.arange(off[n], off[n + 1], dtype=np.int32) for n in chain[::-1]])
        self._chain_cache[key] = out
        return out

    @functools.cached_property
    def flat_token_index(self) -> np.ndarray:
        """Concatenation over paths of `path_token_index`: tree index of every flat token."""
        return np.concatenate([self.path_token_index(p) for p in range(self.n_paths)])

    # ------------------------------------------------------------------ per-token layout

    @functools.cached_property
    def token_arrays(self) -> dict[str, np.ndarray]:
        """Tree-local per-token arrays in DFS order (see `jtree.layout.linearize` for their meaning).

        `pos`: index in the standalone path; `end`: one past the last token of the node's subtree;
        `pred`: tree-local index of the token scoring this one (-1 for a root's first token);
        `node`: node index of each token.
        """
        off = self.node_offsets
        lengths = np.diff(off)
        node = np.repeat(np.arange(self.n_nodes, dtype=np.int32), lengths)
        idx = np.arange(self.n_tree_tokens, dtype=np.int32)
        start_pos = self._node_depth_tokens - lengths  # path position of each node's first token
        pos = (idx + np.repeat(start_pos - off[:-1], lengths)).astype(np.int32)
        end = np.repeat(off[self.subtree_last_node + 1], lengths).astype(np.int32)
        pred = idx - 1
        first = off[:-1]
        pred[first] = np.where(self.parents >= 0, off[self.parents + 1] - 1, -1)
        return {"tokens": self.tokens, "pos": pos, "end": end, "pred": pred, "node": node}

    def tree_token_values(self, per_path: Sequence[np.ndarray]) -> tuple[np.ndarray, float]:
        """Fold per-path per-token values onto tree tokens.

        Returns the value of each tree token (taken from the first path through it) and the largest
        disagreement between paths that share a token, so callers can tell whether per-path values
        (such as rollout-engine log-probs) are consistent on shared prefixes.
        """
        flat = np.concatenate(per_path).astype(np.float32)
        idx = self.flat_token_index
        out = np.zeros(self.n_tree_tokens, np.float32)
        uniq, first = np.unique(idx, return_index=True)
        out[uniq] = flat[first]
        disagreement = float(np.max(np.abs(flat - out[idx]))) if flat.size else 0.0
        return out, disagreement

    def path_as_tree(self, p: int) -> TrajectoryTree:
        """Path `p` alone as a one-node tree with its own data (how the baseline trains it)."""

        def pick(items: tuple[np.ndarray, ...] | None) -> tuple[np.ndarray, ...] | None:
            return None if items is None else (items[p],)

        d = self._data
        data = PathData((d.loss_masks[p],), pick(d.advantages), pick(d.old_logprobs),
                         d.weights[p : p + 1], pick(d.rewards), pick(d.routed_experts))
        return TrajectoryTree(np.array([-1], np.int32), [self.path_tokens(p)],
                              np.zeros(1, np.int32), data)

    def stats(self) -> TreeStats:
        return TreeStats(
            n_tree_tokens=self.n_tree_tokens,
            n_flat_tokens=int(self.path_lengths.sum()),
            n_paths=self.n_paths,
            n_nodes=self.n_nodes,
            max_depth=int(self.node_levels.max()),
            max_path_len=int(self.path_lengths.max()),
        )

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"TrajectoryTree(nodes={s.n_nodes}, paths={s.n_paths}, tree_tokens={s.n_tree_tokens}, "
            f"flat_tokens={s.n_flat_tokens}, por={s.por:.3f})"
        )
