"""DeepSeek-V3 (MLA + DeepSeekMoE) in jtree, without transformers (tests/hf/test_hf_deepseek_v3.py
holds it to transformers per path): tree == per-path baseline under PPO, redundancy-free parts
over cached MLA prefixes (keys and values of different widths) == the unpartitioned tree, the
group-limited router against a numpy formula written here (routing replay too), and the optimizer
leaving the expert-selection bias alone.

The tiny model is `tests.models_util.tiny_deepseek_v3_config`'s (a dense layer, two DeepSeekMoE
layers, MLA with value heads narrower than q/k heads, YaRN); its parameters are perturbed and
its selection biases random, so the bias changes the routing.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jtree.config.objective import OptimConfig
from jtree.models.moe import GroupLimitedRouter
from jtree.step.optimizer import make_optimizer
from tests.models_util import (
    assert_equal_baseline_under_ppo,
    perturbed,
    tiny_deepseek_v3_config,
    tiny_lm,
)
from tests.redundancy_free_checks import SFT, check_parts
from tests.strategies import one_row_forests

CONFIG = tiny_deepseek_v3_config()


def _model(**runtime):
    """(graphdef, params) of the tiny model (module docstring)."""
    graphdef, params = nnx.split(tiny_lm(CONFIG, seed=4, **runtime))
    return graphdef, perturbed(params, scale=0.2)


MODEL = _model()


@pytest.mark.slow
def test_equals_baseline_under_ppo():
    """On `one_row_forests` (several levels, siblings, internal path ends, duplicate paths)."""
    assert_equal_baseline_under_ppo(*MODEL, one_row_forests(CONFIG.vocab_size))


@pytest.mark.slow
def test_redundancy_free_parts_equal_unpartitioned_tree():
    """Parts of at most 5 tokens over cached prefixes (MLA's k [.., 24] and v [.., 12])."""
    check_parts(*MODEL, SFT, capacities=(5,), modes=("residuals",))


def _router_reference(x, w, bias, n_group, topk_group, k, scaling):
    """DeepSeek-V3's routing in numpy, token by token: (weights, chosen experts as a set)."""
    out = []
    for row in x.astype(np.float64):
        s = 1 / (1 + np.exp(-(w.astype(np.float64) @ row)))
        choice = s + bias
        groups = choice.reshape(n_group, -1)
        group_score = np.sort(groups, axis=1)[:, -2:].sum(1)
        keep = np.argsort(-group_score)[:topk_group]
        eligible = [e for e in range(len(s)) if e // groups.shape[1] in keep]
        chosen = sorted(eligible, key=lambda e: -choice[e])[:k]
        weights = s[chosen] / s[chosen].sum() * scaling
        out.append(dict(zip(chosen, weights)))
    return out


def test_group_limited_router_equals_numpy_formula_and_replays():
    rng = np.random.default_rng(0)
    router = GroupLimitedRouter(16, 8, 3, True, n_group=4, topk_group=2, scaling=2.5,
                                init_std=0.5, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    router.e_score_correction_bias[...] = jnp.asarray(rng.normal(0, 0.3, 8), jnp.float32)
    x = rng.normal(0, 1, (20, 16)).astype(np.float32)
    w, e, _ = router(jnp.asarray(x))
    want = _router_reference(x, np.asarray(router.weight[...]),
                             np.asarray(router.e_score_correction_bias[...]), 4, 2, 3, 2.5)
    for n, ref in enumerate(want):
        got = dict(zip(np.asarray(e[n]).tolist(), np.asarray(w[n]).tolist()))
        assert got.keys() == ref.keys(), n
        np.testing.assert_allclose([got[i] for i in ref], list(ref.values()), rtol=1e-5)
    # Replayed experts (even outside the eligible groups) are weighed by the same rule.
    replay = np.tile(np.array([[0, 1, 7]], np.int32), (20, 1))
    replay[::2] = -1  # every other token keeps its own routing
    w_r, e_r, _ = router(jnp.asarray(x), jnp.asarray(replay))
    s = 1 / (1 + np.exp(-(x.astype(np.float64) @ np.asarray(router.weight[...]).T.astype(
        np.float64))))
    np.testing.assert_array_equal(np.asarray(e_r)[1::2], replay[1::2])
    np.testing.assert_allclose(np.asarray(w_r)[1::2],
                               s[1::2][:, [0, 1, 7]] / s[1::2][:, [0, 1, 7]].sum(1, keepdims=True)
                               * 2.5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(e_r)[::2], np.asarray(e)[::2])


def test_weight_decay_leaves_the_selection_bias_alone():
    """AdamW with weight decay: the selection bias (no gradient) keeps its value, a router weight
    under a zero gradient still decays."""
    params = {"gate": {"weight": jnp.ones((2, 3)), "e_score_correction_bias": jnp.ones(2)}}
    optimizer = make_optimizer(OptimConfig(learning_rate=0.1, weight_decay=0.5, warmup_steps=0))
    grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    new = optax.apply_updates(params, updates)["gate"]
    np.testing.assert_array_equal(np.asarray(new["e_score_correction_bias"]), np.ones(2))
    assert np.all(np.asarray(new["weight"]) < 1)
