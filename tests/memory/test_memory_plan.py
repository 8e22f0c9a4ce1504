"""The memory plan's depth rule (`jtree.memory.plan`): activations and temporaries fitted through
compiles at 1 and 2 unrolled layers predict an actual compile at 3 layers, and through 2 and 3
scanned layers (what a `runtime.scan_layers` config runs) one at 4; the repeated layer block of a
hybrid model; per-device bytes from shardings; the grouped CPU lowering of `ragged_dot` the plan
compiles with equals jax's own (values and gradients)."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jtree.config import load_config
from jtree.memory.grouped_matmul_lowering import grouped_matmul_lowering
from jtree.memory.plan import (
    activations_and_temps,
    group_compiles,
    group_picks,
    layer_block,
    layers_override,
    memory_plan,
    shard_bytes,
)
from jtree.parallel.layer_stack import layer_groups
from tests.memory_plan_checks import assert_predicts, assert_rule_predicts
from tests.run_util import WORKTREE, default_codegen_env

TINY = ["runtime.attention_impl=xla", "runtime.remat=full", "data.seq_len=128",
        "data.micro_batches=1", "mesh.data=1"]


@pytest.mark.slow  # the scanned rule below runs by default
def test_depth_rule_predicts_a_third_compile():
    # Unrolled at 128 tokens a tiny layer adds about 1-6% to the step's temporaries, no more than
    # XLA's buffer reuse moves them by from one depth to the next; at 256 the layers' term is the
    # larger part, as in a real config. In a process of its own at XLA's default code generation,
    # which a user's plan compiles with: at the tests' (`tests.run_util.CODEGEN_XLA_FLAGS`) the
    # 3-layer step's temporaries fall 12% below the line through 1 and 2 layers (7.05 MB against
    # 7.96 predicted), where the fused default program follows it.
    proc = subprocess.run(
        [sys.executable, "-m", "tests.memory_plan_checks", json.dumps([*TINY, "data.seq_len=256"])],
        cwd=WORKTREE, env=default_codegen_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


# configs/deepseek_v3_671b.yaml cut to test scale, with 2 leading dense layers.
TINY_DEEPSEEK = [f"model.{key}={value}" for key, value in dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_attention_heads=4, num_key_value_heads=4, num_experts=8, kv_lora_rank=16,
    q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=4,
    topk_group=2, num_experts_per_tok=2, first_k_dense_replace=2, num_hidden_layers=6).items()
] + ["mesh.fsdp=1", "mesh.model=1"]


@pytest.mark.slow
def test_leading_dense_layers_are_compiled_at_every_depth():
    """DeepSeek-V3's first dense layers: the depths compiled are 2 + 2 and 2 + 3 layers (scanned
    MoE blocks after them), and the rule predicts the whole 6-layer model's compile."""
    config = "configs/deepseek_v3_671b.yaml"
    plan = memory_plan(config, [*TINY, *TINY_DEEPSEEK])
    assert plan.leading == 2 and [c.layers for c in plan.compiled] == [4, 5]
    actual = activations_and_temps(load_config(config, [*TINY, *TINY_DEEPSEEK]), rows=1)
    assert actual.layers == 6
    assert_rule_predicts(plan, actual)


@pytest.mark.slow
def test_scanned_depth_rule_predicts_a_third_scanned_compile():
    scanned = [*TINY, "runtime.scan_layers=true", "model.num_hidden_layers=4"]
    plan = memory_plan("configs/tiny.yaml", scanned)
    assert plan.scanned and [c.layers for c in plan.compiled] == [2, 3]
    actual = activations_and_temps(load_config("configs/tiny.yaml", scanned), rows=1)
    assert actual.layers == 4
    assert_rule_predicts(plan, actual)


# A Nemotron-H layer list that repeats no single block: [Mamba2, MoE] x 3, attention, Mamba2 x 4,
# attention, MoE (scanned: two stacks and three single layers).
M, E, A = "linear_attention", "moe", "full_attention"
IRREGULAR = [M, E, M, E, M, E, A, M, M, M, M, A, E]


@pytest.mark.slow
def test_a_layer_list_without_a_block_is_planned_per_repeated_block():
    """The rule's a + sum_g b_g * repeats_g, fitted through compiles with each stack one repeat
    short of the full model's and at it, against XLA:CPU's compile of the whole irregular model (`remat: none`, so the
    layers' activations, not the intercept, are most of T)."""
    config = "configs/tiny_nemotron_h.yaml"
    overrides = [*TINY, "runtime.remat=none", "data.seq_len=256", "runtime.scan_layers=true",
                 f"model.layers_block_type={json.dumps(IRREGULAR)}"]
    plan = memory_plan(config, overrides)
    # base ([M, E] x 2, [M] x 3), then [M, E] x 3 and [M] x 4: the whole model is not compiled
    assert [c.layers for c in plan.compiled] == [10, 12, 11]
    assert [(block, n) for block, n, _ in plan.groups] == [
        ("[mamba2, relu2_moe]", 3), ("[mamba2]", 4)]
    actual = activations_and_temps(load_config(config, overrides), rows=1)
    assert actual.layers == len(IRREGULAR)
    predicted = plan.largest_temporary + plan.activations
    assert plan.activations > plan.largest_temporary
    assert_predicts(predicted, actual)


def test_the_compiled_layer_lists_keep_the_full_models_stacks():
    """Nemotron 3 Nano's pattern: each compile copies every stack's first repeat and keeps the
    single layers, and is cut into the same stacks (`layer_groups`); at 2 repeats its [M, E]
    stack would merge with the layers after it into another [M, E, M, E, M, *, E], so the
    default depths are refused and 3 and 4 compile."""
    config = "configs/nemotron3_nano_30b_a3b.yaml"
    cfg = load_config(config).model.config
    groups = layer_groups(cfg.decoder().layers)
    assert [(len(g.block), g.repeats) for g in groups] == [(7, 5), (2, 3), (1, 1), (1, 1),
                                                           (2, 4), (1, 1)]
    assert group_picks(groups, [2, 3, 1, 1, 2, 1]) == [
        *range(7), *range(7), 35, 36, 35, 36, 35, 36, 41, 42, 43, 44, 43, 44, 51]
    _, base, configs = group_compiles(config, [], (3, 4), scanned=True)
    assert base == [4, 3, 1, 1, 3, 1]
    assert [c.model.config.num_hidden_layers for c in configs] == [43, 50, 45, 45]
    with pytest.raises(ValueError, match=r"depth_blocks: \(2, 3\) regroups"):
        group_compiles(config, [], (2, 3), scanned=True)
    kimi = load_config("configs/kimi_linear_48b.yaml").model.config
    cut = load_config("configs/kimi_linear_48b.yaml", layers_override(kimi, [0, 4, 4])).model.config
    assert cut.num_hidden_layers == 3 and cut.layer_types == ("linear_attention",
                                                              "full_attention", "full_attention")
    assert cut.mlp_layer_types == ("dense", "sparse", "sparse")


def test_a_scanned_plan_refuses_a_depth_that_would_not_scan():
    with pytest.raises(ValueError, match="depth_blocks.*>= 2 with runtime.scan_layers"):
        memory_plan("configs/tiny.yaml", [*TINY, "runtime.scan_layers=true",
                                          "model.num_hidden_layers=4"], depth_blocks=(1, 2))


def test_layer_block():
    assert layer_block(None) == 1
    assert layer_block(("full_attention",) * 6) == 1
    hybrid = ("linear_attention",) * 3 + ("full_attention",)
    assert layer_block(hybrid * 12) == 4
    assert layer_block(hybrid + ("linear_attention",)) == 5


def test_shard_bytes_counts_one_shard():
    mesh = jax.make_mesh((1,), ("x",))
    x = jax.ShapeDtypeStruct((8, 6), np.float32, sharding=NamedSharding(mesh, P("x")))
    assert shard_bytes({"a": x, "b": [x]}) == 2 * 8 * 6 * 4


def test_grouped_lowering_equals_ragged_dot():
    k = jax.random.split(jax.random.key(0), 3)
    lhs, rhs = jax.random.normal(k[0], (10, 6)), jax.random.normal(k[1], (3, 6, 5))
    dy = jax.random.normal(k[2], (10, 5))
    sizes = jnp.array([4, 0, 5], jnp.int32)  # an empty group; the last row in none

    def values_and_grads():
        def f(a, b):
            return jnp.sum(jax.lax.ragged_dot(a, b, sizes) * dy)
        return jax.jit(lambda a, b: (jax.lax.ragged_dot(a, b, sizes), jax.grad(f, (0, 1))(a, b))
                       )(lhs, rhs)

    reference = values_and_grads()
    with grouped_matmul_lowering():
        grouped = values_and_grads()
    for want, got in zip(jax.tree.leaves(reference), jax.tree.leaves(grouped)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_device_count_defaults_to_the_configs_mesh(tmp_path):
    """`--devices` left out: the plan forces as many host devices as the config's mesh names
    (qwen3_30b_a3b's fsdp 8 x model 8 no longer needs `--devices 64`); `data: -1` counts once."""
    from jtree.launch.memory_plan import mesh_devices

    assert mesh_devices(load_config("configs/qwen3_30b_a3b.yaml").mesh) == 64
    assert mesh_devices(load_config("configs/tiny.yaml").mesh) == 1
    assert mesh_devices(load_config("configs/tiny.yaml", ["mesh.data=2", "mesh.model=2"]).mesh) == 4
    out = tmp_path / "plan.json"
    proc = subprocess.run(  # its own process: the forced device count is read at jax's start
        [sys.executable, "-m", "jtree.launch.memory_plan", "--config", "configs/tiny.yaml",
         "--json", str(out), *TINY, "mesh.fsdp=2"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(out.read_text())
    assert "fsdp 2" in plan["mesh"] or "fsdp=2" in plan["mesh"], plan["mesh"]
    assert plan["total"] == sum(plan[k] for k in ("params", "grads", "opt_state", "inputs",
                                                  "activations", "largest_temporary"))
