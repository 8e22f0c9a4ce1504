"""A part of a tree: a tree holding a subset of another tree's paths, with the map back to the
nodes and paths it came from (what capacity partitioning and data-parallel balancing hand on)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jtree.trees.tree import TrajectoryTree


class TreePart(TrajectoryTree):
    """A tree holding a subset of another tree's paths (with their data) and nothing else.

    `owned_paths[i]` is the input path index of this part's path i; `source_nodes[j]` is the input
    node index of this part's node j (nodes keep their DFS order).
    """

    owned_paths: np.ndarray
    source_nodes: np.ndarray

    @classmethod
    def from_paths(cls, tree: TrajectoryTree, paths: Sequence[int]) -> TreePart:
        """The union of the root-to-end chains of `paths`, owning exactly those paths."""
        paths = np.asarray(paths, np.int64)
        if paths.ndim != 1 or paths.size == 0:
            raise ValueError("paths: need a non-empty 1-D list of path indices")
        if paths.min() < 0 or paths.max() >= tree.n_paths:
            raise ValueError(f"paths: indices must lie in [0, {tree.n_paths})")
        marked = np.zeros(tree.n_nodes, bool)
        for node in tree.path_nodes[paths]:
            node = int(node)
            while node >= 0 and not marked[node]:
                marked[node] = True
                node = int(tree.parents[node])
        nodes = np.flatnonzero(marked)
        new_index = np.full(tree.n_nodes, -1, np.int64)
        new_index[nodes] = np.arange(len(nodes))
        parents = np.where(tree.parents[nodes] >= 0, new_index[tree.parents[nodes]], -1)

        def pick(items: tuple[np.ndarray, ...] | None) -> list[np.ndarray] | None:
            return None if items is None else [items[p] for p in paths]

        part = cls.from_nodes(
            parents.tolist(), [tree.segments[n] for n in nodes],
            path_nodes=new_index[tree.path_nodes[paths]].tolist(),
            loss_masks=pick(tree.loss_masks), advantages=pick(tree.advantages),
            old_logprobs=pick(tree.old_logprobs), weights=tree.weights[paths],
            rewards=pick(tree.turn_rewards), routed_experts=pick(tree.routed_experts),
        )
        part.owned_paths = paths
        part.source_nodes = nodes
        return part
