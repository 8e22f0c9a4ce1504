"""PPO's critic on trees: the (path, trained token) pairs, and per-path GAE (docs/rl.md, "PPO with a
critic"; its config is `jtree.config.objective.CriticConfig`).

The value head runs once per tree token (the hidden states are per tree token): the value of the
state in which token t is chosen is V_t = head(hidden[pred[t]]), the same on every path through t.
GAE is not: a path's advantage at t sums the path's own future TD errors, so a token shared by
several paths has one advantage and one return per path. The batch therefore carries one entry
per (path, trained token) pair (`jtree.layout.batch.CriticPairs`: a few scalars each, no model work),
path after path in token order. On the device, GAE is a reverse linear recurrence over each
path's pairs; the pairs' c[p,t] A[p,t] are added per token into the policy's P/N (split by sign,
as for given advantages: design.md section 2), and the clipped value loss is summed over the pairs.
Both equal per-path PPO exactly.

A path's actions are its trained tokens (loss mask 1, position 0 excepted) in order; prompt and
tool tokens between turns are skipped. The path's reward R_p (per-turn rewards summed) is the
reward of its last action, every other reward is 0; the value after the last action is 0.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jtree.layout.batch import CriticPairs
from jtree.layout.coefficients import path_coefficients
from jtree.layout.linearize import TreeBatch
from jtree.layout.planner import SCORE_MIN, SCORE_STEPS_PER_OCTAVE, octave_step_length
from jtree.parallel.sharding import param_path
from jtree.trees.tree import TrajectoryTree


def is_critic_param(name: str) -> bool:
    """Whether the parameter at '/'-joined path `name` is the critic's (the value head on the
    policy trunk, or anything of the separate critic model), not the policy's."""
    return name.startswith("critic/") or name.startswith("value_head/")


def critic_update_scale(critic_learning_rate: float, learning_rate: float
                        ) -> optax.GradientTransformation:
    """The critic's parameters (`is_critic_param`) at their own peak learning rate: their AdamW
    updates (the policy's schedule times the update direction) scaled by
    critic_learning_rate / learning_rate. The schedule (warmup from 0, cosine to a fixed ratio
    of the peak) is proportional to its peak, so this is AdamW at the critic's peak rate on the
    same schedule, with no second optimizer state."""
    if learning_rate <= 0:
        raise ValueError(f"objective.critic.learning_rate: needs optim.learning_rate > 0, not "
                         f"{learning_rate} (the critic's rate scales the policy's schedule)")
    ratio = critic_learning_rate / learning_rate

    def update_fn(updates: Any, state: Any, params: Any = None):
        del params
        return jax.tree_util.tree_map_with_path(
            lambda path, u: u * jnp.asarray(ratio, u.dtype) if is_critic_param(param_path(path))
            else u, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def pair_count(tree: TrajectoryTree) -> int:
    """How many (path, trained token) pairs `tree` contributes (paths of positive weight)."""
    live = tree.weights > 0
    return int(sum(np.count_nonzero(m[1:]) for m, w in zip(tree.loss_masks, live) if w))


def pair_width(need: int) -> int:
    """The `CriticPairs` width Q for rows of at most `need` pairs: rounded up on the score
    width's octave ladder, so steps compile at a few widths."""
    return octave_step_length(max(int(need), 1), SCORE_STEPS_PER_OCTAVE, min_step=SCORE_MIN)


def padding_pairs(rows: int, width: int) -> CriticPairs:
    """All-padding pairs [rows, width] (no token, no coefficient, each its own path end)."""
    return CriticPairs(np.full((rows, width), -1, np.int32), np.zeros((rows, width), np.float32),
                       np.zeros((rows, width), np.float32), np.ones((rows, width), bool))


def critic_pairs(batch: TreeBatch, width: int | None = None) -> CriticPairs:
    """The `CriticPairs` [rows, Q] of a linearized batch (every path of positive weight, its
    pairs at its tokens with a non-zero c[p,t], with the batch's normalization). `width` fixes
    Q (default: the largest row's count). Every tree needs rewards."""
    rows, _ = batch.shape
    per_row: list[list[tuple[np.ndarray, ...]]] = [[] for _ in range(rows)]
    layout = batch.layout
    for k, (tree, row) in enumerate(zip(layout.trees, layout.rows)):
        if tree.rewards is None:
            raise ValueError(f"tree {k}: no reward (objective.critic computes GAE from one "
                             "reward per path)")
        coefs = path_coefficients(tree, batch.normalization, batch.normalizer)
        positions = layout.token_positions(k)
        for p, c in enumerate(coefs):
            at = np.flatnonzero(c)
            if at.size == 0:
                continue
            reward = np.zeros(at.size, np.float32)
            reward[-1] = tree.rewards[p]
            last = np.zeros(at.size, bool)
            last[-1] = True
            per_row[int(row)].append(
                (positions[tree.path_token_index(p)[at]], c[at], reward, last))
    counts = [sum(len(e[0]) for e in entries) for entries in per_row]
    q = max(counts, default=0) if width is None else width
    if max(counts, default=0) > q:
        raise ValueError(f"width={width}: a row has {max(counts)} critic pairs")
    out = padding_pairs(rows, q)
    for r, entries in enumerate(per_row):
        if entries:
            for dst, parts in zip((out.index, out.coef, out.reward, out.last), zip(*entries)):
                dst[r, :counts[r]] = np.concatenate(parts)
    return out


def with_critic_pairs(batch: TreeBatch, width: int | None = None) -> TreeBatch:
    """`batch` with its `critic` pairs (`critic_pairs`)."""
    inputs = dataclasses.replace(batch.inputs, critic=critic_pairs(batch, width))
    return dataclasses.replace(batch, inputs=inputs)


def pair_values(token_values: jax.Array, pred: jax.Array, pairs: CriticPairs) -> jax.Array:
    """[..., S] values of the state after each token -> [..., Q] value of each pair's state
    (the state its token is chosen in: after token pred[t]); 0 on padding."""
    at = jnp.take_along_axis(pred, jnp.maximum(pairs.index, 0), axis=-1)
    v = jnp.take_along_axis(token_values, jnp.maximum(at, 0), axis=-1)
    return jnp.where((pairs.index >= 0) & (at >= 0), v, 0.0)


def gae(values: jax.Array, pairs: CriticPairs, gamma: float, lam: float
        ) -> tuple[jax.Array, jax.Array]:
    """Per-path GAE over the pairs [..., Q]: (advantages, returns). With V_k the value of pair
    k and V_{k+1} that of the next pair of the same path (0 after its last),
    delta_k = r_k + gamma V_{k+1} - V_k and A_k = delta_k + gamma lam A_{k+1}; R_k = A_k + V_k.
    The recurrence runs as one reverse associative scan (O(Q log Q) work, log depth)."""
    cont = 1.0 - pairs.last.astype(values.dtype)
    nxt = jnp.concatenate([values[..., 1:], jnp.zeros_like(values[..., :1])], axis=-1)
    delta = pairs.reward + gamma * cont * nxt - values
    decay = gamma * lam * cont

    def compose(later: tuple[jax.Array, jax.Array], earlier: tuple[jax.Array, jax.Array]):
        # A = b_e + a_e * (b_l + a_l * x): the earlier pair's map after the later one's.
        (a_l, b_l), (a_e, b_e) = later, earlier
        return a_e * a_l, b_e + a_e * b_l

    _, adv = jax.lax.associative_scan(compose, (decay, delta), reverse=True,
                                       axis=values.ndim - 1)
    return adv, adv + values


def pair_token_sums(values: jax.Array, pairs: CriticPairs, seq_len: int) -> jax.Array:
    """[..., Q] per-pair values -> [..., S] their sum at each pair's token."""
    lead = values.shape[:-1]
    flat_v = values.reshape(-1, values.shape[-1])
    flat_i = pairs.index.reshape(flat_v.shape)
    at = jnp.where(flat_i >= 0, flat_i, seq_len)  # padding goes past the end and is dropped
    out = jax.vmap(lambda v, i: jnp.zeros(seq_len, v.dtype).at[i].add(v, mode="drop"))(
        flat_v, at)
    return out.reshape(*lead, seq_len)
