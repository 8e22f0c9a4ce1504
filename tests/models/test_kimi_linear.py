"""Kimi-Linear (KDA / MLA-without-RoPE hybrid with DeepSeekMoE): the KDA layer's forget gate and
gated output norm against transformers' own modules, the layer kinds' sharding rules and FLOPs,
and (tree mode against the per-path baseline) the PPO loss and gradients. The log-probs and
gradients against transformers per path: tests/hf/test_hf_kimi_linear.py.

Random forests branch on several levels, have single-token nodes (shorter than the conv kernel),
paths ending at internal nodes and several trees per row; 3-token chunks put chunk boundaries
inside nodes. Every parameter is perturbed (A_log, dt_bias, the gated norm's weight included).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from jtree.config.objective import Objective
from jtree.layout.flop_model import FlopModel
from jtree.models.kda import ForgetGate, SigmoidGatedRMSNorm
from jtree.parallel.sharding import AXES, param_rules, param_specs
from tests.models_util import (
    assert_loss_and_grads_match,
    off_policy_ppo_inputs,
    perturbed,
    tiny_kimi_linear_config,
    tiny_lm,
    tiny_runtime,
    tree_and_baseline,
)
from tests.redundancy_free_checks import SFT, check_parts
from tests.strategies import forests

CHUNK = 3
CONFIG = tiny_kimi_linear_config()
PPO = Objective(kind="ppo", clip_low=0.2, clip_high=0.28, kl_coef=0.05, entropy_coef=0.01)


@pytest.mark.slow  # about 40 s of compiles on 2 cores
@settings(max_examples=2, derandomize=True, deadline=None)
@given(trees=forests(n_trees=(1, 3), max_nodes=8, max_seg=5))
def test_ppo_loss_and_grads_equal_baseline(trees):
    """The PPO loss and every gradient (1e-5 relative) of the tree equal those of each path run
    alone (off-policy, so the clip acts), with the sequential scan of the KDA state (the
    parallel one against transformers: tests/hf/test_hf_kimi_linear.py, slow)."""
    graphdef, params = nnx.split(tiny_lm(CONFIG, 0))
    params = perturbed(params, scale=0.2)
    tree, base = tree_and_baseline(trees, "token_mean", gdn_chunk_size=CHUNK)
    tree_in, base_in = off_policy_ppo_inputs(params, graphdef, tree, base, seed=len(trees))
    assert_loss_and_grads_match(graphdef, params, tree_in, base_in, PPO)


@pytest.mark.slow  # about a minute of compiles on 2 cores
def test_redundancy_free_parts_equal_the_unpartitioned_tree():
    """Parts of trees below prefixes that other parts computed: the KDA layers start the part's
    subtrees from the prefix's state at the attach token (per-channel decays included) and read
    the prefix's cached conv inputs, the MLA layer its cached keys and values. Loss, gradients
    and log-probs equal the whole tree's."""
    graphdef, params = nnx.split(tiny_lm(CONFIG, 0))
    check_parts(graphdef, perturbed(params, scale=0.2), SFT, capacities=(5,),
                modes=("recompute",), chunk=CHUNK)


def test_forget_gate_and_gated_norm_equal_transformers_modules():
    """g = -exp(A_log[head]) softplus(f_b(f_a(x)) + dt_bias) per key channel, and
    RMSNorm(o) * weight * sigmoid(gate) per head, against `KimiLinearForgetGate` and
    `KimiLinearRMSNormGated` with the same random weights (inputs large enough that some
    softplus arguments pass transformers' threshold of 20)."""
    torch = pytest.importorskip("torch")
    modeling = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.KimiLinearConfig(
        hidden_size=32, linear_head_dim=8, linear_num_heads=2, pad_token_id=None)
    torch.manual_seed(0)
    theirs = modeling.KimiLinearForgetGate(hf_config)
    hf_norm = modeling.KimiLinearRMSNormGated(8, eps=1e-5)
    with torch.no_grad():
        for p in (*theirs.parameters(), *hf_norm.parameters()):
            p.copy_(torch.randn_like(p))
    ours = ForgetGate(CONFIG, tiny_runtime(), rngs=nnx.Rngs(0))
    ours.f_a_proj.kernel[...] = jnp.asarray(theirs.f_a_proj.weight.detach().numpy().T)
    ours.f_b_proj.kernel[...] = jnp.asarray(theirs.f_b_proj.weight.detach().numpy().T)
    ours.dt_bias[...] = jnp.asarray(theirs.dt_bias.detach().numpy())
    ours.A_log[...] = jnp.asarray(theirs.A_log.detach().numpy().reshape(-1))
    x = np.random.default_rng(0).normal(0, 3, (5, 32)).astype(np.float32)
    expected = theirs(torch.as_tensor(x)[None]).detach().numpy()[0]
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(x))), expected, rtol=1e-5, atol=1e-5)
    assert expected.shape == (5, 2, 8) and np.ptp(expected[:, 0], axis=-1).min() > 0

    norm = SigmoidGatedRMSNorm(8, eps=1e-5, param_dtype=jnp.float32)
    norm.weight[...] = jnp.asarray(hf_norm.weight.detach().numpy())
    o, gate = np.random.default_rng(1).normal(0, 1, (2, 5, 2, 8)).astype(np.float32)
    expected = hf_norm(torch.as_tensor(o), torch.as_tensor(gate)).detach().numpy()
    np.testing.assert_allclose(np.asarray(norm(jnp.asarray(o), jnp.asarray(gate))), expected,
                               rtol=1e-5, atol=1e-6)


def test_sharding_rules_split_heads_and_cover_every_parameter():
    _, params = nnx.split(tiny_lm(CONFIG), nnx.Param)
    mesh = AbstractMesh((1, 1, 1, 2), AXES)
    specs = param_specs(params, param_rules(CONFIG, 2), mesh)
    flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(
        specs, is_leaf=lambda x: isinstance(x, P))}

    def spec(path: str) -> P:
        return flat["['model']['layers']" + path + ".value"]

    assert spec("[0]['self_attn']['k_proj']['kernel']") == P(None, "model")
    assert spec("[0]['self_attn']['forget_gate']['f_b_proj']['kernel']") == P(None, "model")
    assert spec("[0]['self_attn']['forget_gate']['f_a_proj']['kernel']") == P()
    assert spec("[0]['self_attn']['forget_gate']['A_log']") == P("model")
    assert spec("[0]['self_attn']['o_proj']['kernel']") == P("model", None)
    assert spec("[0]['self_attn']['conv1d']['weight']") == P()
    assert spec("[1]['self_attn']['kv_b_proj']['kernel']") == P(None, "model")
    with pytest.raises(ValueError, match="linear_num_heads"):
        param_rules(CONFIG, 4)


def test_flops_count_the_kda_layers():
    """Replacing the two KDA layers by MLA changes the per-token FLOPs by their difference, each
    written out here; the one MLA layer's attention pairs are all the pairs."""
    d, h, dk = 32, 2, 8
    kda = 3 * d * h * dk + d * h + (d * dk + dk * h * dk) + (d * dk + dk * h * dk) + h * dk * d
    kda += 4 * h * dk * dk  # the state update and read-out
    mla = d * 4 * 24 + d * (16 + 8) + 16 * 4 * (16 + 12) + 4 * 12 * d
    ours = FlopModel.for_config(CONFIG)
    mla_only = FlopModel.for_config(tiny_kimi_linear_config(layer_types=("full_attention",) * 3))
    assert mla_only.per_token - ours.per_token == pytest.approx(3.0 * 2.0 * 2 * (mla - kda))
    assert ours.per_pair == mla_only.per_pair / 3 == 3.5 * 2.0 * 4 * (24 + 12)
