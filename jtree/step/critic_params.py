"""Where PPO's critic lives in the model's parameter state and where it starts from
(docs/rl.md, "PPO with a critic").

The critic is part of the model's state (`jtree.models.decoder.CausalLM`): a value head on the
policy trunk under `value_head/`, or a model of its own under `critic/` (its trunk under
`critic/model/`, its value head under `critic/value_head/`). So it has its own parameters and
optimizer moments, is sharded, checkpointed and restored with the policy, and a step
differentiates both at once. What is not the policy's is named by `jtree.objectives.critic.is_critic_param`.

Starting weights: a Hugging Face checkpoint holds a policy (no value head); every parameter a
loaded checkpoint supplies comes from it, the rest (the value heads, a `random` critic, the policy
without `model.init_from`) from the run's seeded init, so a run's value heads start the same
whether or not its trunks were loaded. A separate critic with `init_from: policy` starts as a
copy of the policy's starting trunk.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx

from jtree.objectives.critic import is_critic_param
from jtree.parallel.sharding import param_path

TRUNK = "model/"  # the decoder's parameters (embedding, layers, final norm), policy or critic
CRITIC = "critic/"
MTP = "mtp/"  # the multi-token-prediction modules (jtree.models.mtp)


def flat_params(params: Any) -> dict[str, jax.Array]:
    """{'/'-joined parameter path: array} of a model's parameter state."""
    return {param_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def with_named(params: Any, values: Mapping[str, Any]) -> Any:
    """`params` (arrays or abstract shapes) with every leaf whose path `values` names replaced
    by that value; the structure is kept exactly (it is the train state's)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: values.get(param_path(p), x), params)


def as_critic_trunk(params: Mapping[str, Any]) -> dict[str, Any]:
    """The trunk of flat `params` (the policy's, or a loaded Hugging Face model's), named as the
    separate critic's trunk (`critic/model/...`); an LM head, which the critic does not have, is
    left out."""
    return {CRITIC + name: x for name, x in params.items() if name.startswith(TRUNK)}


def policy_params(params: Any) -> Any:
    """The policy's parameters of a model state: without the value head, the separate critic or
    the multi-token-prediction modules (what a reference model runs on: the main head's
    log-probs)."""
    def kept(path: tuple, _: Any) -> bool:
        name = "/".join(str(k) for k in path)
        return not is_critic_param(name) and not name.startswith(MTP)

    return nnx.filter_state(params, kept)
