"""Nemotron-H (Mamba2 / MoE / attention / MLP single-block layers) in tree mode equals the
per-path baseline: PPO loss and gradients, with both tree scans of the Mamba2 state (the log-probs against
transformers per path: tests/hf/test_hf_nemotron_h.py); the layer kinds' sharding rules and FLOPs,
the memory plan, and redundancy-free parts.

Random forests branch on several levels, have single-token nodes (shorter than the conv kernel),
paths ending at internal nodes and several trees per row; 3-token chunks put chunk boundaries
inside nodes. Every parameter is perturbed (conv bias, D, dt_bias, the gated norm included).
"""

import json

import jax
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from jtree.config import load_config
from jtree.config.objective import Objective
from jtree.layout.flop_model import FlopModel
from jtree.memory.plan import activations_and_temps, depth_override, layer_block, memory_plan
from jtree.models.architectures.nemotron_h import (
    grouped_conv_channels,
    grouped_in_proj_columns,
)
from jtree.parallel.sharding import AXES, param_rules, param_specs
from tests.memory_plan_checks import assert_rule_predicts
from tests.models_util import (
    assert_loss_and_grads_match,
    off_policy_ppo_inputs,
    perturbed,
    tiny_lm,
    tiny_nemotron_h_config,
    tree_and_baseline,
)
from tests.redundancy_free_checks import SFT, check_parts
from tests.strategies import forests

CHUNK = 3
CONFIG = tiny_nemotron_h_config()
PPO = Objective(kind="ppo", clip_low=0.2, clip_high=0.28, kl_coef=0.05, entropy_coef=0.01)


def _model(scan: str):
    graphdef, params = nnx.split(tiny_lm(CONFIG, 0, gdn_scan=scan))
    return graphdef, perturbed(params, scale=0.2)


# (the parallel scan against per-path references: tests/kernels/test_gdn.py, and against
# transformers: tests/hf/test_hf_nemotron_h.py)
@pytest.mark.parametrize("scan", ["sequential", pytest.param("parallel", marks=pytest.mark.slow)])
@settings(max_examples=2, derandomize=True, deadline=None)
@given(trees=forests(n_trees=(1, 3), max_nodes=8, max_seg=5))
def test_ppo_loss_and_grads_equal_baseline(trees, scan):
    """The PPO loss and every gradient (1e-5 relative) of the tree equal those of each path
    run alone (off-policy, so the clip acts)."""
    graphdef, params = _model(scan)
    tree, base = tree_and_baseline(trees, "token_mean", gdn_chunk_size=CHUNK)
    tree_in, base_in = off_policy_ppo_inputs(params, graphdef, tree, base, seed=len(trees))
    assert_loss_and_grads_match(graphdef, params, tree_in, base_in, PPO)


def test_sharding_rules_split_mamba2_groups_over_the_model_axis():
    """Every parameter has a rule on a FSDP x model mesh; the Mamba2 weights split by group
    (in_proj column-parallel, out_proj row-parallel, the per-head and per-channel vectors with
    their groups); a model axis that does not divide n_groups is refused by name."""
    _, params = nnx.split(tiny_lm(CONFIG), nnx.Param)
    mesh = AbstractMesh((1, 2, 1, 2), AXES)
    specs = param_specs(params, param_rules(CONFIG, 2), mesh)
    flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(
        specs, is_leaf=lambda x: isinstance(x, P))}
    mixer = "['model']['layers'][0]['mixer']"
    assert flat[f"{mixer}['in_proj']['kernel'].value"] == P("fsdp", "model")
    assert flat[f"{mixer}['in_proj']['bias'].value"] == P("model")
    assert flat[f"{mixer}['conv1d']['weight'].value"] == P("model", None, "fsdp")
    assert flat[f"{mixer}['out_proj']['kernel'].value"] == P("model", "fsdp")
    assert flat[f"{mixer}['out_proj']['bias'].value"] == P()
    for vector in ("['dt_bias']", "['A_log']", "['D']", "['norm']['weight']",
                   "['conv1d']['bias']"):
        assert flat[f"{mixer}{vector}.value"] == P("model"), vector
    assert flat["['model']['layers'][3]['mlp']['up_proj']['kernel'].value"] == P("fsdp", "model")
    moe = "['model']['layers'][1]['mlp']"  # expert parallel, the router replicated
    assert flat[f"{moe}['experts']['up_proj'].value"] == P("model", "fsdp", None)
    assert flat[f"{moe}['gate']['e_score_correction_bias'].value"] == P()
    assert flat[f"{moe}['shared_expert']['down_proj']['kernel'].value"] == P("model", "fsdp")
    with pytest.raises(ValueError, match=r"mesh.model=4 .*n_groups \(2"):
        param_rules(CONFIG, 4)


def test_grouped_layout_gives_each_shard_whole_groups_of_every_component():
    """Written from HF's row order ([z | x | B | C | dt], heads and groups in order): the HF
    rows behind each contiguous half of jtree's in_proj columns (and of its conv channels) are
    exactly group i's: its heads' z, x and dt rows and its B and C rows, each component in HF
    order."""
    cfg = tiny_nemotron_h_config(mamba_num_heads=8, n_groups=4)
    h, p, n, g = 8, cfg.mamba_head_dim, cfg.ssm_state_size, 4
    inner, per = h * p, h // g
    for model in (2, 4):
        columns = np.split(grouped_in_proj_columns(cfg), model)
        channels = np.split(grouped_conv_channels(cfg), model)
        for i in range(model):
            groups = range(i * g // model, (i + 1) * g // model)
            heads = [head for q in groups for head in range(q * per, (q + 1) * per)]
            x = [inner + head * p + j for head in heads for j in range(p)]
            b = [2 * inner + q * n + j for q in groups for j in range(n)]
            c = [2 * inner + g * n + q * n + j for q in groups for j in range(n)]
            dt = [2 * inner + 2 * g * n + head for head in heads]
            z = [head * p + j for head in heads for j in range(p)]
            assert sorted(columns[i]) == sorted(z + x + b + c + dt)
            assert sorted(channels[i]) == sorted(v - inner for v in x + b + c)
            for component in (z, x, b, c, dt):  # each component in HF's order within the shard
                assert [v for v in columns[i] if v in set(component)] == component


@pytest.mark.slow  # about 40 s of compiles on 2 cores
def test_redundancy_free_parts_equal_the_unpartitioned_tree():
    """Parts of trees below prefixes that other parts computed: the Mamba2 layer starts the
    part's subtrees from the prefix's state at the attach token and reads the prefix's cached
    conv inputs; the MLP-only layer caches nothing. Loss, gradients and log-probs equal the whole
    tree's."""
    check_parts(*_model("sequential"), SFT, capacities=(5,), modes=("recompute",), chunk=CHUNK)


def test_flops_count_each_single_block_layer_once():
    d, inner, gn, h = 32, 24, 16, 4
    mamba = d * (2 * inner + 2 * gn + h) + inner * d + 2 * h * 8 * 6
    attention = d * 32 + 2 * d * 16 + 32 * d
    mlp = 2 * d * 48
    moe = d * 4 + 2 * d * (2 * 16 + 24)  # router, 2 of 4 experts and the shared expert, no gates
    flops = FlopModel.for_config(CONFIG)
    assert flops.per_token == 3.0 * 2.0 * (mamba + attention + mlp + moe)
    assert flops.per_pair == 3.5 * 4.0 * 32  # the one attention layer


BLOCK = ["linear_attention", "moe", "full_attention", "mlp"]
MEMORY = ["runtime.attention_impl=xla", "runtime.remat=full", "data.seq_len=256",
          "data.micro_batches=1", "data.gdn_chunk_size=32", "mesh.data=1",
          f"model.layers_block_type={json.dumps(BLOCK * 3)}"]


def test_memory_plan_cuts_the_layer_list_by_whole_blocks():
    cfg = load_config("configs/tiny_nemotron_h.yaml", MEMORY).model.config
    assert layer_block(cfg.layer_types) == 4
    cut = load_config("configs/tiny_nemotron_h.yaml", [*MEMORY, depth_override(cfg, 8)])
    assert cut.model.config.layers_block_type == tuple(BLOCK * 2)
    irregular = load_config("configs/tiny_nemotron_h.yaml", [
        *MEMORY, 'model.layers_block_type=["linear_attention", "moe", "linear_attention", '
        '"full_attention", "moe"]']).model.config
    # no block repeats: the plan takes it per repeated group (tests/memory/test_memory_plan.py)
    assert layer_block(irregular.layer_types) == 5


@pytest.mark.slow
def test_memory_plan_rule_predicts_a_third_compile():
    """The memory plan of a Nemotron-H config (compiles at 1 and 2 blocks of [Mamba2, MoE,
    attention, MLP]) predicts the compile at 3 blocks: the Mamba2 and MoE layers' activations
    grow with depth like the others'."""
    plan = memory_plan("configs/tiny_nemotron_h.yaml", MEMORY, depth_blocks=(1, 2))
    assert (plan.block, plan.layers) == (4, 12)
    actual = activations_and_temps(load_config("configs/tiny_nemotron_h.yaml", MEMORY), rows=1)
    assert actual.layers == 12
    assert_rule_predicts(plan, actual)

