"""Chunk tables for the gated delta rule on DFS-laid-out trees (`jtree.kernels.gdn.delta_rule.tree_gated_delta_rule`).

Every node segment is cut into chunks of at most C tokens (a chunk never spans two nodes), numbered
per row in token (= DFS) order. A chunk enters with the state after the previous chunk of its node,
or, for a node's first chunk, after its parent's last chunk (a root starts from slot 0, the
initial state). Because a parent precedes its subtree, a scan over chunks in order always has the
entering state ready. All arrays are built with numpy, vectorized over nodes and tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jtree.layout.batch import GdnTables
from jtree.trees.tree import TrajectoryTree


def concat_ranges(sizes: np.ndarray) -> np.ndarray:
    """Concatenation of arange(n) for every n in `sizes`, without a Python loop."""
    total = int(sizes.sum())
    starts = np.repeat(np.cumsum(sizes) - sizes, sizes)
    return np.arange(total, dtype=np.int64) - starts


def tree_chunks(tree: TrajectoryTree, chunk_size: int) -> int:
    """Chunks a tree needs in a row: sum over its nodes of ceil(len / chunk_size) (each node
    starts a chunk of its own)."""
    return int(np.sum(-(-np.diff(tree.node_offsets) // chunk_size)))


def chunks_needed(trees: Sequence[TrajectoryTree], tree_row: np.ndarray, n_rows: int,
                  chunk_size: int) -> np.ndarray:
    """Number of chunks each row needs: sum over its nodes of ceil(len / chunk_size)."""
    per_tree = np.array([tree_chunks(t, chunk_size) for t in trees], np.int64)
    return np.bincount(tree_row, weights=per_tree, minlength=n_rows).astype(np.int64)


def default_chunk_count(row_len: int, chunk_size: int, needed: int) -> int:
    """The chunk capacity NC of rows of `row_len` tokens when the fullest row needs `needed`
    chunks: the smallest bucket that holds it.

    A row needs at least base = ceil(row_len / C) chunks when full, and every node adds at most one
    partly filled chunk, so needs range from base (few long nodes) up to row_len (one-token
    nodes). Buckets are base * 2^j plus multiples of a quarter of that octave (base, 1.25 base,
    1.5 base, 1.75 base, 2 base, 2.5 base, ...), capped at row_len: at most a quarter of the
    needed chunks are padding (the GDN scan and its chunk work grow with NC), and a run compiles
    for at most 4 * log2(C) + 1 chunk capacities per row length, in practice the few buckets
    around its trees' typical node count.
    """
    base = -(-row_len // chunk_size)
    need = max(int(needed), base)
    octave = base
    while 2 * octave <= need:
        octave *= 2
    step = max(1, octave // 4)
    return min(octave + -(-(need - octave) // step) * step, max(row_len, base))


def chunk_tables(
    trees: Sequence[TrajectoryTree],
    tree_row: np.ndarray,
    tree_off: np.ndarray,
    n_rows: int,
    row_len: int,
    chunk_size: int,
    n_chunks: int,
) -> GdnTables:
    """The tables `chunk_tokens` [rows, NC, C], `chunk_src` [rows, NC], `token_slot` [rows, S].

    chunk_tokens: row-local token index of each chunk slot, -1 for empty slots and unused chunks.
    chunk_src: buffer slot of the entering state (0: initial state; c + 1: after chunk c).
    token_slot: c * C + j for the token in slot j of chunk c, -1 on padding.
    """
    nodes = tree_nodes(trees, tree_row, tree_off)
    return node_chunk_tables(*nodes, np.zeros(len(nodes[0]), np.int64),
                             n_rows, row_len, chunk_size, n_chunks, n_initial=1)["tables"]


def tree_nodes(trees: Sequence[TrajectoryTree], tree_row: np.ndarray, tree_off: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The node arrays `node_chunk_tables` reads, for trees laid out at rows `tree_row` from
    `tree_off`: every node's (token count, first row-local token, row, parent), parents as
    indices into these arrays (-1 for a root)."""
    n_nodes = np.array([t.n_nodes for t in trees], np.int64)
    lengths = np.concatenate([np.diff(t.node_offsets) for t in trees]).astype(np.int64)
    node_row = np.repeat(tree_row, n_nodes)
    node_start = np.concatenate([t.node_offsets[:-1] for t in trees]) + np.repeat(tree_off, n_nodes)
    node_base = np.cumsum(n_nodes) - n_nodes
    parent = np.concatenate([np.where(t.parents >= 0, t.parents + b, -1)
                             for t, b in zip(trees, node_base)])
    return lengths, node_start, node_row, parent


def node_chunk_tables(
    lengths: np.ndarray,
    node_start: np.ndarray,
    node_row: np.ndarray,
    parent: np.ndarray,
    root_slot: np.ndarray,
    n_rows: int,
    row_len: int,
    chunk_size: int,
    n_chunks: int,
    *,
    n_initial: int,
) -> dict:
    """Chunk tables from node arrays: each node's token count, first row-local token, row, parent
    (global node index, -1 for a root) and, for roots, the initial slot (< `n_initial`) its first
    chunk enters from. Chunk c stores its final state in buffer slot `n_initial` + c.

    Returns {"tables": the `GdnTables`, "last_slot": the buffer slot holding each node's
    final state (its last chunk's)}: what a later part that continues below a node starts from.
    """
    n_ch = -(-lengths // chunk_size)

    # Chunk index of each node's first chunk within its row, counting in token order.
    order = np.lexsort((node_start, node_row))
    cum = np.cumsum(n_ch[order]) - n_ch[order]
    row_first = np.full(n_rows, 0, np.int64)
    first_of_row = np.r_[True, node_row[order][1:] != node_row[order][:-1]]
    row_first[node_row[order][first_of_row]] = cum[first_of_row]
    first_chunk = np.empty_like(cum)
    first_chunk[order] = cum - row_first[node_row[order]]
    last_chunk = first_chunk + n_ch - 1

    needed = np.bincount(node_row, weights=n_ch, minlength=n_rows)
    if needed.max() > n_chunks:
        r = int(np.argmax(needed))
        raise ValueError(f"gdn_chunks={n_chunks}: row {r} needs {int(needed[r])} chunks of "
                         f"{chunk_size} tokens (every node starts a new chunk)")

    # One entry per chunk.
    c_node = np.repeat(np.arange(len(lengths)), n_ch)
    c_j = concat_ranges(n_ch)
    c_row = node_row[c_node]
    c_idx = first_chunk[c_node] + c_j
    c_start = node_start[c_node] + c_j * chunk_size
    c_len = np.minimum(chunk_size, lengths[c_node] - c_j * chunk_size)
    par = parent[c_node]
    from_parent = np.where(par >= 0, last_chunk[np.maximum(par, 0)] + n_initial,
                           root_slot[c_node])
    c_src = np.where(c_j > 0, c_idx + n_initial - 1, from_parent)

    src = np.zeros((n_rows, n_chunks), np.int32)
    src[c_row, c_idx] = c_src
    tokens = np.full((n_rows, n_chunks, chunk_size), -1, np.int32)
    slot = np.full((n_rows, row_len), -1, np.int32)
    t_chunk = np.repeat(np.arange(len(c_idx)), c_len)
    t_j = concat_ranges(c_len)
    t_tok = c_start[t_chunk] + t_j
    tokens[c_row[t_chunk], c_idx[t_chunk], t_j] = t_tok
    slot[c_row[t_chunk], t_tok] = c_idx[t_chunk] * chunk_size + t_j
    return {"tables": GdnTables(tokens, src, slot),
            "last_slot": last_chunk + n_initial}
