"""The (path, trained token) pairs of a batch (`jtree.layout.batch.PathPairs`): built on the host
from a linearized batch, summed on the device into tree tokens and along paths.

Some terms of the loss differ between the paths through one tree token, yet are not linear in
what differs, so no per-token coefficient summed on the host carries them: PPO's critic (a
shared token's GAE advantage sums each path's own future, `jtree.objectives.critic`) and the
off-policy weights (each path's behavior log-prob of a shared token is its own, and the weight
needs the trainer's old log-prob, known only on the device; `jtree.objectives.off_policy`). The
batch then carries one entry per (path, trained token), path after path: a few scalars each,
never model work. The device forms each pair's term and adds the pairs into the tree tokens
(`pair_token_sums`) or along their path (`pair_path_sums`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jtree.layout.batch import PathPairs
from jtree.layout.coefficients import path_coefficients
from jtree.layout.linearize import TreeBatch
from jtree.layout.planner import SCORE_MIN, SCORE_STEPS_PER_OCTAVE, octave_step_length
from jtree.trees.tree import TrajectoryTree


def pair_count(tree: TrajectoryTree) -> int:
    """How many (path, trained token) pairs `tree` contributes (paths of positive weight)."""
    live = tree.weights > 0
    return int(sum(np.count_nonzero(m[1:]) for m, w in zip(tree.loss_masks, live) if w))


def pair_width(need: int) -> int:
    """The `PathPairs` width Q for rows of at most `need` pairs: rounded up on the score
    width's octave ladder, so steps compile at a few widths."""
    return octave_step_length(max(int(need), 1), SCORE_STEPS_PER_OCTAVE, min_step=SCORE_MIN)


def padding_pairs(rows: int, width: int, *, critic: bool = True, off_policy: bool = False
                  ) -> PathPairs:
    """All-padding pairs [rows, width] (no token, no coefficient, each its own path end) with
    the fields of `path_pairs(..., critic=critic, off_policy=off_policy)`."""
    def zeros() -> np.ndarray:
        return np.zeros((rows, width), np.float32)

    return PathPairs(
        np.full((rows, width), -1, np.int32), zeros(), np.ones((rows, width), bool),
        reward=zeros() if critic else None, advantage=zeros() if off_policy else None,
        behavior=zeros() if off_policy else None,
        end=np.full((rows, width), -1, np.int32) if off_policy else None)


def path_pairs(batch: TreeBatch, width: int | None = None, *, critic: bool = True,
               off_policy: bool = False) -> PathPairs:
    """The `PathPairs` [rows, Q] of a linearized batch: every path of positive weight, its pairs
    at its tokens with a non-zero c[p,t] (the batch's normalization). `critic`: with each path's
    reward at its last pair (every tree needs rewards); `off_policy`: with A[p,t], the path's
    behavior log-probs mu_p(t) (every tree needs old log-probs) and its last token's position.
    `width` fixes Q (default: the largest row's count)."""
    rows, _ = batch.shape
    per_row: list[list[dict[str, np.ndarray]]] = [[] for _ in range(rows)]
    layout = batch.layout
    for k, (tree, row) in enumerate(zip(layout.trees, layout.rows)):
        if critic and tree.rewards is None:
            raise ValueError(f"tree {k}: no reward (objective.critic computes GAE from one "
                             "reward per path)")
        if off_policy and (tree.old_logprobs is None or tree.advantages is None):
            field = "old_logprobs" if tree.old_logprobs is None else "advantage"
            raise ValueError(f"tree {k}: no {field} (objective.off_policy weighs each path's "
                             "c A by a ratio of the trainer's old log-prob to the behavior "
                             "log-prob)")
        coefs = path_coefficients(tree, batch.normalization, batch.normalizer)
        positions = layout.token_positions(k)
        for p, c in enumerate(coefs):
            at = np.flatnonzero(c)
            if at.size == 0:
                continue
            tokens = tree.path_token_index(p)
            entry = {"index": positions[tokens[at]], "coef": c[at],
                     "last": np.arange(at.size) == at.size - 1}
            if critic:
                entry["reward"] = np.where(entry["last"], tree.rewards[p], 0.0)
            if off_policy:
                entry["advantage"] = tree.advantages[p][at]
                entry["behavior"] = np.asarray(tree.old_logprobs[p])[at]
                entry["end"] = np.full(at.size, positions[tokens[-1]])
            per_row[int(row)].append(entry)
    counts = [sum(len(e["index"]) for e in entries) for entries in per_row]
    q = max(counts, default=0) if width is None else width
    if max(counts, default=0) > q:
        raise ValueError(f"width={width}: a row has {max(counts)} pairs")
    out = padding_pairs(rows, q, critic=critic, off_policy=off_policy)
    for r, entries in enumerate(per_row):
        for name in entries[0] if entries else ():
            dst = getattr(out, name)
            dst[r, :counts[r]] = np.concatenate([e[name] for e in entries])
    return out


def with_pairs(batch: TreeBatch, width: int | None = None, *, critic: bool = True,
               off_policy: bool = False) -> TreeBatch:
    """`batch` with its `pairs` (`path_pairs`)."""
    pairs = path_pairs(batch, width, critic=critic, off_policy=off_policy)
    return dataclasses.replace(batch, inputs=dataclasses.replace(batch.inputs, pairs=pairs))


def pair_token_sums(values: jax.Array, pairs: PathPairs, seq_len: int,
                    at: jax.Array | None = None) -> jax.Array:
    """[..., Q] per-pair values -> [..., S] their sum at each pair's token (or at the row
    positions `at` [..., Q], -1 for none)."""
    at = pairs.index if at is None else at
    lead = values.shape[:-1]
    flat_v = values.reshape(-1, values.shape[-1])
    flat_i = at.reshape(flat_v.shape)
    flat_i = jnp.where(flat_i >= 0, flat_i, seq_len)  # padding goes past the end and is dropped
    out = jax.vmap(lambda v, i: jnp.zeros(seq_len, v.dtype).at[i].add(v, mode="drop"))(
        flat_v, flat_i)
    return out.reshape(*lead, seq_len)


def pair_path_sums(values: jax.Array, pairs: PathPairs) -> jax.Array:
    """[..., Q] per-pair values -> [..., Q] the sum over each pair's path (its run of pairs up
    to and including the next `last`), on every pair of the path."""
    last = pairs.last.astype(jnp.int32)
    path = jnp.cumsum(last, axis=-1) - last  # paths ended before each pair: its path's number
    q = values.shape[-1]
    flat_v, flat_p = values.reshape(-1, q), path.reshape(-1, q)
    sums = jax.vmap(lambda v, p: jax.ops.segment_sum(v, p, num_segments=q)[p])(flat_v, flat_p)
    return sums.reshape(values.shape)
