"""PPO's critic on trees: per-path GAE over the (path, trained token) pairs (docs/rl.md, "PPO with a
critic"; its config is `jtree.config.objective.CriticConfig`).

The value head runs once per tree token (the hidden states are per tree token): the value of the
state in which token t is chosen is V_t = head(hidden[pred[t]]), the same on every path through t.
GAE is not: a path's advantage at t sums the path's own future TD errors, so a token shared by
several paths has one advantage and one return per path. The batch therefore carries one entry
per (path, trained token) pair (`jtree.objectives.pairs`: a few scalars each, no model work),
path after path in token order. On the device, GAE is a reverse linear recurrence over each
path's pairs; the pairs' c[p,t] A[p,t] are added per token into the policy's P/N (split by sign,
as for given advantages: design.md section 2), and the clipped value loss is summed over the pairs.
Both equal per-path PPO exactly.

A path's actions are its trained tokens (loss mask 1, position 0 excepted) in order; prompt and
tool tokens between turns are skipped. The path's reward R_p (per-turn rewards summed) is the
reward of its last action, every other reward is 0; the value after the last action is 0.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jtree.layout.batch import PathPairs
from jtree.parallel.sharding import param_path


def is_critic_param(name: str) -> bool:
    """Whether the parameter at '/'-joined path `name` is the critic's (the value head on the
    policy trunk, or anything of the separate critic model), not the policy's."""
    return name.startswith("critic/") or name.startswith("value_head/")


def critic_update_scale(critic_learning_rate: float, learning_rate: float
                        ) -> optax.GradientTransformation:
    """The critic's parameters (`is_critic_param`) at their own peak learning rate: their AdamW
    updates (the policy's schedule times the update direction) scaled by
    critic_learning_rate / learning_rate. The schedule (linear warmup, cosine to a fixed ratio
    of the peak) is proportional to its peak, so this is AdamW at the critic's peak rate on the
    same schedule, with no second optimizer state. `learning_rate` > 0 is `OptimConfig`'s
    domain."""
    ratio = critic_learning_rate / learning_rate

    def update_fn(updates: Any, state: Any, params: Any = None):
        del params
        return jax.tree_util.tree_map_with_path(
            lambda path, u: u * jnp.asarray(ratio, u.dtype) if is_critic_param(param_path(path))
            else u, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def pair_values(token_values: jax.Array, pred: jax.Array, pairs: PathPairs) -> jax.Array:
    """[..., S] values of the state after each token -> [..., Q] value of each pair's state
    (the state its token is chosen in: after token pred[t]); 0 on padding."""
    at = jnp.take_along_axis(pred, jnp.maximum(pairs.index, 0), axis=-1)
    v = jnp.take_along_axis(token_values, jnp.maximum(at, 0), axis=-1)
    return jnp.where((pairs.index >= 0) & (at >= 0), v, 0.0)


def gae(values: jax.Array, pairs: PathPairs, gamma: float, lam: float
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
