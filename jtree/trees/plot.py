"""Pictures of a tree: its shape (node size by tokens) and its overlap curve.

The overlap curve is seed 000's Figure 5 view: for each position along a trajectory, how many
sequences are active there in the per-branch baseline (paths at least that long) and how many
distinct tokens tree mode computes there. The areas under the two curves are N_flat and N_tree.

In the shape view a node that continues its parent's row (a chain of nodes: the messages of a
conversation) would merge with it into one bar, so every node start is marked (`node_boundaries`)
and consecutive nodes alternate in shade.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jtree.trees.tree import TrajectoryTree


def overlap_curve(tree: TrajectoryTree) -> tuple[np.ndarray, np.ndarray]:
    """(baseline, tree) counts per position: paths longer than x, distinct tree tokens at x."""
    length = int(tree.path_lengths.max())
    tree_counts = np.bincount(tree.token_arrays["pos"], minlength=length)
    ends = np.bincount(tree.path_lengths, minlength=length + 1)
    baseline = tree.n_paths - np.cumsum(ends)[:length]
    return baseline, tree_counts


def node_layout(tree: TrajectoryTree) -> tuple[np.ndarray, np.ndarray]:
    """(start, y) per node: start = path position of the node's first token, y = leaf order in DFS
    (a parent sits at the mean of its children's rows)."""
    start = tree.token_arrays["pos"][tree.node_offsets[:-1]].astype(np.float64)
    y = np.zeros(tree.n_nodes)
    kids: list[list[int]] = [[] for _ in range(tree.n_nodes)]
    for u, p in enumerate(tree.parents):
        if p >= 0:
            kids[p].append(u)
    row = 0
    for u in range(tree.n_nodes):  # leaves in DFS order get consecutive rows
        if not kids[u]:
            y[u] = row
            row += 1
    for u in range(tree.n_nodes - 1, -1, -1):
        if kids[u]:
            y[u] = np.mean(y[kids[u]])
    return start, y


def node_boundaries(tree: TrajectoryTree) -> np.ndarray:
    """[nodes with a parent, 2]: (position, y) where each non-root node starts, in node order (the
    ticks that separate a node from its parent, e.g. one chat message from the one before)."""
    start, y = node_layout(tree)
    child = np.flatnonzero(tree.parents >= 0)
    return np.stack([start[child], y[child]], 1)


def node_depths(tree: TrajectoryTree) -> np.ndarray:
    """Nodes from a root to each node, minus one (parents come before their children)."""
    depth = np.zeros(tree.n_nodes, np.int64)
    for u, p in enumerate(tree.parents):
        if p >= 0:
            depth[u] = depth[p] + 1
    return depth


def plot_tree_overview(
    tree: TrajectoryTree,
    out: str,
    *,
    title: str = "",
    copies: Sequence[int] | None = None,
) -> None:
    """Write a PNG: the tree, each node a bar as long as its tokens (colour = number of parts
    computing it, if `copies` is given), and its overlap curve, tree vs baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import LineCollection

    fig, (ax_tree, ax_curve) = plt.subplots(1, 2, figsize=(13, 5.5),
                                            gridspec_kw={"width_ratios": [1.3, 1]})
    start, y = node_layout(tree)
    stop = start + np.diff(tree.node_offsets)
    has_parent = tree.parents >= 0
    p = tree.parents[has_parent]
    links = np.stack([np.stack([stop[p], y[p]], 1), np.stack([start[has_parent], y[has_parent]], 1)], 1)
    ax_tree.add_collection(LineCollection(links, colors="0.6", linewidths=0.7))
    bars = np.stack([np.stack([start, y], 1), np.stack([stop, y], 1)], 1)
    if copies is None:  # alternating shades keep consecutive nodes of a chain apart
        shades = np.where(node_depths(tree) % 2 == 0, "tab:blue", "lightsteelblue")
        ax_tree.add_collection(LineCollection(bars, colors=shades, linewidths=4))
    else:
        copies = np.asarray(copies)
        cmap = plt.get_cmap("viridis", int(copies.max()))
        coll = LineCollection(bars, cmap=cmap, linewidths=4)
        coll.set_array(copies)
        coll.set_clim(0.5, copies.max() + 0.5)
        ax_tree.add_collection(coll)
        fig.colorbar(coll, ax=ax_tree, label="parts computing the node",
                     ticks=range(1, int(copies.max()) + 1))
    ticks = node_boundaries(tree)
    ax_tree.add_collection(LineCollection(
        np.stack([ticks + [0, -0.3], ticks + [0, 0.3]], 1), colors="black", linewidths=0.8,
        label="node starts"))
    ends = tree.path_nodes
    ax_tree.scatter(stop[ends], y[ends], s=14, marker="x", color="tab:red", zorder=3,
                    label="path ends")
    ax_tree.autoscale()
    ax_tree.set_xlabel("position in trajectory (tokens)")
    ax_tree.set_yticks([])
    ax_tree.set_title(f"{tree.n_nodes} nodes, {tree.n_paths} paths; bar length = tokens")
    ax_tree.legend(loc="lower right", fontsize=8)
    baseline, counts = overlap_curve(tree)
    pos = np.arange(len(baseline))
    ax_curve.plot(pos, baseline, "--", color="tab:gray",
                  label=f"baseline (area {int(baseline.sum())} flat tokens)")
    ax_curve.plot(pos, counts, "-", color="tab:blue",
                  label=f"tree (area {int(counts.sum())} tree tokens)")
    ax_curve.set_xlabel("position in trajectory (tokens)")
    ax_curve.set_ylabel("active trajectories")
    s = tree.stats()
    ax_curve.set_title(f"overlap: POR {s.por:.3f}, compression {s.compression:.2f}x")
    ax_curve.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
