import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from jtree.linearize import linearize
from jtree.models import architecture, create_model
from jtree.sharding import (
    MeshConfig, make_mesh, param_path, param_rules, param_specs,
)
from jtree.train_step import Objective, make_grad_fn, stack_microbatches
from tests.models_util import (
    rel_l2, tiny_config, tiny_lm, tiny_model, tiny_moe_config, tiny_next_config, tiny_runtime,
)
from tests.strategies import explicit_tree, random_forest


def _abstract_mesh(data, model):
    return AbstractMesh((data, model), ("data", "model"))


def test_dense_rules_split_heads_mlp_and_vocab():
    cfg = tiny_config()
    _, params = tiny_model()
    specs = param_specs(params, param_rules(cfg, 2), _abstract_mesh(4, 2))
    flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(
        specs, is_leaf=lambda x: isinstance(x, P))}
    by_suffix = lambda s: {v for k, v in flat.items() if s in k}  # noqa: E731
    assert by_suffix("'q_proj']['kernel'") == {P(None, "model")}
    assert by_suffix("'k_proj']['kernel'") == {P(None, "model")}  # 2 kv heads split 2 ways
    assert by_suffix("'o_proj']['kernel'") == {P("model", None)}
    assert by_suffix("'down_proj']['kernel'") == {P("model", None)}
    assert by_suffix("'embedding'") == {P("model", None)}
    assert by_suffix("'lm_head']['kernel'") == {P(None, "model")}
    assert by_suffix("norm']['weight'") == {P()}
    four = param_specs(params, param_rules(cfg, 4), _abstract_mesh(2, 4))
    kv = [v for k, v in jax.tree_util.tree_leaves_with_path(four, is_leaf=lambda x: isinstance(
        x, P)) if "k_proj" in jax.tree_util.keystr(k)]
    assert set(kv) == {P()}  # fewer kv heads than devices: replicated


def test_rules_reject_shapes_the_mesh_cannot_split():
    with pytest.raises(ValueError, match=r"mesh.model=3 must divide num_attention_heads \(4\)"):
        param_rules(tiny_config(), 3)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\) must divide one another"):
        param_rules(tiny_config(num_attention_heads=6, num_key_value_heads=3,
                                intermediate_size=60, vocab_size=60), 2)
    _, params = tiny_model()
    with pytest.raises(ValueError, match=r"^model/embed_tokens/embedding: no sharding rule"):
        param_specs(params, [(r"lm_head", P())], _abstract_mesh(1, 1))


def test_mesh_shape_must_match_devices():
    assert make_mesh(MeshConfig()).shape == {"data": jax.device_count(), "model": 1}
    with pytest.raises(ValueError, match=r"mesh: data=3 x model=1 does not match"):
        make_mesh(MeshConfig(data=3))


def test_remat_policies_leave_gradients_unchanged():
    rng = np.random.default_rng(0)
    trees = [explicit_tree(random_forest(rng, max_nodes=8)) for _ in range(3)]
    inputs = stack_microbatches([linearize(trees, 64)])
    grads = {}
    for remat in ("none", "full", "dots"):
        graphdef, params = nnx.split(tiny_lm(tiny_config(), 0, remat=remat))
        grads[remat] = jax.jit(make_grad_fn(graphdef, Objective()))(params, inputs)[2]
    for remat in ("full", "dots"):
        for a, b in zip(jax.tree_util.tree_leaves(grads[remat]),
                        jax.tree_util.tree_leaves(grads["none"])):
            assert rel_l2(a, b) <= 1e-6


def _specs_by_path(arch, cfg, model_size):
    params = nnx.split(nnx.eval_shape(lambda: create_model(arch, cfg, tiny_runtime())))[1]
    specs = param_specs(params, param_rules(cfg, model_size),
                        _abstract_mesh(8 // model_size, model_size))
    return {param_path(k): v for k, v in jax.tree_util.tree_leaves_with_path(
        specs, is_leaf=lambda x: isinstance(x, P))}


def test_moe_and_next_rules_split_experts_and_gdn_heads():
    moe = _specs_by_path("qwen3_moe", tiny_moe_config(), 4)
    assert moe["model/layers/0/mlp/experts/gate_up_proj"] == P("model", None, None)
    assert moe["model/layers/0/mlp/experts/down_proj"] == P("model", None, None)
    assert moe["model/layers/0/mlp/gate/weight"] == P()  # router replicated
    assert moe["model/layers/1/mlp/gate_proj/kernel"] == P(None, "model")  # dense layer
    assert moe["model/layers/0/self_attn/k_proj/kernel"] == P()  # 2 kv heads, 4 devices
    nxt = _specs_by_path("qwen3_next", tiny_next_config(), 4)
    layer0 = "model/layers/0/"
    assert nxt[layer0 + "mlp/shared_expert/up_proj/kernel"] == P(None, "model")
    assert nxt[layer0 + "mlp/shared_expert/down_proj/kernel"] == P("model", None)
    assert nxt[layer0 + "mlp/shared_expert_gate/kernel"] == P()
    assert nxt[layer0 + "linear_attn/in_proj_qkvz/kernel"] == P(None, "model")
    assert nxt[layer0 + "linear_attn/in_proj_ba/kernel"] == P(None, "model")
    assert nxt[layer0 + "linear_attn/A_log"] == nxt[layer0 + "linear_attn/dt_bias"] == P("model")
    assert nxt[layer0 + "linear_attn/conv1d/weight"] == P()
    assert nxt[layer0 + "linear_attn/out_proj/kernel"] == P("model", None)
    assert nxt[layer0 + "linear_attn/norm/weight"] == P()
    assert nxt["model/layers/1/self_attn/q_proj/kernel"] == P(None, "model")  # [q, gate] per head


def test_moe_and_next_rules_reject_splits_that_cut_experts_or_heads():
    with pytest.raises(ValueError, match=r"mesh.model=4 must divide num_experts \(6\)"):
        param_rules(tiny_moe_config(num_experts=6), 4)
    with pytest.raises(ValueError, match=r"must divide linear_num_key_heads \(2\)"):
        param_rules(tiny_next_config(linear_num_key_heads=2, linear_num_value_heads=4), 4)
    with pytest.raises(ValueError, match=r"must divide shared_expert_intermediate_size \(30\)"):
        param_rules(tiny_next_config(shared_expert_intermediate_size=30), 4)
    # intermediate_size only matters where a layer has a dense MLP.
    all_moe = tiny_moe_config(mlp_only_layers=(), intermediate_size=30)
    assert param_rules(all_moe, 4)
    with pytest.raises(ValueError, match=r"must divide intermediate_size \(30\)"):
        param_rules(tiny_moe_config(intermediate_size=30), 4)
    with pytest.raises(ValueError, match=r"'mamba' is not one of"):
        architecture("mamba")


@pytest.mark.slow  # two Qwen3-Next compiles; the dense remat test above is the default one
def test_remat_leaves_next_gradients_unchanged():
    """Remat of a hybrid MoE decoder layer (GDN routing in, router statistics out through
    `call_layer`); one layer (GDN + MoE with shared expert) keeps the two compiles small."""
    rng = np.random.default_rng(1)
    trees = [explicit_tree(random_forest(rng, max_nodes=8)) for _ in range(3)]
    inputs = stack_microbatches([linearize(trees, 64, gdn_chunk_size=4)])
    grads = {}
    for remat in ("none", "full"):
        cfg = tiny_next_config(num_hidden_layers=1, mlp_only_layers=(),
                               layer_types=("linear_attention",))
        graphdef, params = nnx.split(create_model("qwen3_next", cfg, tiny_runtime(remat=remat)))
        grads[remat] = jax.jit(make_grad_fn(graphdef, Objective()))(params, inputs)[2]
    for a, b in zip(jax.tree_util.tree_leaves(grads["full"]),
                    jax.tree_util.tree_leaves(grads["none"])):
        assert rel_l2(a, b) <= 1e-6
