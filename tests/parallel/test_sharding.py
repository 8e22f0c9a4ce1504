import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from jtree.config.objective import Objective, OptimConfig
from jtree.config.run import MeshConfig
from jtree.layout.linearize import linearize
from jtree.models import architecture, create_model
from jtree.parallel.sharding import (
    AXES,
    fsdp_spec,
    make_mesh,
    named,
    param_path,
    param_rules,
    param_specs,
)
from jtree.step.batches import stack_microbatches
from jtree.step.optimizer import TrainState, make_optimizer, state_shardings
from jtree.step.train_step import make_grad_fn
from tests.models_util import (
    rel_l2,
    tiny_config,
    tiny_lm,
    tiny_model,
    tiny_moe_config,
    tiny_next_config,
    tiny_runtime,
)
from tests.strategies import explicit_tree, random_forest


def _abstract_mesh(data, model, fsdp=1, context=1):
    return AbstractMesh((data, fsdp, context, model), AXES)


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
    assert make_mesh(MeshConfig()).shape == {"data": jax.device_count(), "fsdp": 1,
                                             "context": 1, "model": 1}
    with pytest.raises(ValueError, match=r"mesh.data=3: data=3 x fsdp=1 x context=1 x model=1 "
                                         r"does not match"):
        make_mesh(MeshConfig(data=3))
    devices = [jax.devices()[0]] * 8  # a mesh's shape is checked before its devices are used
    with pytest.raises(ValueError, match=r"^mesh.fsdp=3 \(x mesh.context=1 x mesh.model=1\) does "
                                         r"not divide the 8"):
        make_mesh(MeshConfig(fsdp=3), devices)
    with pytest.raises(ValueError, match=r"^mesh.context=3 \(x mesh.model=2\) does not divide the "
                                         r"8"):
        make_mesh(MeshConfig(context=3, model=2), devices)
    assert make_mesh(MeshConfig(fsdp=2, context=2, model=2), devices).shape == {
        "data": 1, "fsdp": 2, "context": 2, "model": 2}
    with pytest.raises(ValueError, match=r"^mesh.model=3 does not divide the 8 devices"):
        make_mesh(MeshConfig(model=3), devices)
    with pytest.raises(ValueError, match=r"^fsdp: 0 must be >= 1"):
        MeshConfig(fsdp=0)
    with pytest.raises(ValueError, match=r"^context: 0 must be >= 1"):
        MeshConfig(context=0)


def test_fsdp_adds_its_axis_to_one_dimension_the_rule_leaves_whole():
    assert fsdp_spec(P(None, "model"), (32, 64), 8) == P("fsdp", "model")
    assert fsdp_spec(P("model", None), (64, 32), 8) == P("model", "fsdp")
    assert fsdp_spec(P("model", None, None), (8, 48, 32), 4) == P("model", "fsdp", None)
    assert fsdp_spec(P(), (6, 32), 4) == P(None, "fsdp")  # 6 is not divisible: the next one
    assert fsdp_spec(P(), (32,), 8) == P()  # 1-D: replicated
    assert fsdp_spec(P(None, "model"), (32, 64), 1) == P(None, "model")  # no FSDP
    # A stacked layer axis (leading) is never split, and a stacked norm stays replicated.
    assert (fsdp_spec(P(None, None, "model"), (8, 32, 64), 8, leading=1)
            == P(None, "fsdp", "model"))
    assert fsdp_spec(P(), (8, 32), 8, leading=1) == P()
    with pytest.raises(ValueError, match=r"^model/w: no dimension of shape \(6, 12\) that spec "
                                         r"P\(None, 'model'\) leaves whole is "
                                         r"divisible by mesh.fsdp=4"):
        fsdp_spec(P(None, "model"), (6, 12), 4, name="model/w")


def test_fsdp_mesh_rejects_a_parameter_it_cannot_split():
    # vocab 60 x hidden 36: neither divisible by mesh.fsdp=8; the error names the parameter.
    cfg = tiny_config(vocab_size=60, hidden_size=36)
    params = nnx.split(nnx.eval_shape(lambda: create_model("qwen3", cfg, tiny_runtime())))[1]
    with pytest.raises(ValueError, match=r"^lm_head/kernel: no dimension of shape "
                                         r"\(36, 60\).*mesh.fsdp=8"):
        param_specs(params, param_rules(cfg, 1), _abstract_mesh(1, 1, fsdp=8))
    with pytest.raises(ValueError, match=r"lm_head/kernel: dimension 60 is not divisible by "
                                         r"mesh.model=8"):
        param_specs(params, [(r"lm_head", P(None, "model")), (".", P())], _abstract_mesh(1, 8))


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "qwen3_next"])
def test_fsdp_shards_parameters_and_optimizer_state(arch):
    """On a (1, 8, 1) mesh each device holds at most 1/8 of the parameters and AdamW moments
    plus the tensors FSDP leaves replicated (1-D: norms, biases, scalars), read from the
    shardings the trainer gives the TrainState."""
    cfg = {"qwen3": tiny_config, "qwen3_moe": tiny_moe_config,
           "qwen3_next": tiny_next_config}[arch]()
    params = nnx.split(nnx.eval_shape(lambda: create_model(arch, cfg, tiny_runtime())))[1]
    mesh = _abstract_mesh(1, 1, fsdp=8)
    opt = make_optimizer(OptimConfig())
    shardings = state_shardings(opt, params, named(mesh, param_specs(
        params, param_rules(cfg, 1), mesh)), mesh)
    state = jax.eval_shape(lambda p: TrainState(p, opt.init(p), jnp.zeros((), jnp.int32)), params)
    leaves = list(zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(shardings)))
    total = per_device = replicated = 0
    for x, sharding in leaves:
        nbytes = x.size * x.dtype.itemsize
        total += nbytes
        per_device += int(np.prod(sharding.shard_shape(x.shape))) * x.dtype.itemsize
        if sharding.is_fully_replicated:
            assert x.ndim <= 1, (x.shape, sharding)  # only small tensors stay whole
            replicated += nbytes
    assert per_device <= total / 8 + replicated
    assert replicated < total / 20  # and they are small


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
