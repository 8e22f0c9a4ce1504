import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from jtree.linearize import linearize
from jtree.models import Qwen3
from jtree.sharding import MeshConfig, make_mesh, param_specs, qwen3_rules
from jtree.train import Objective, make_grad_fn, stack_microbatches
from tests.models_util import rel_l2, tiny_config, tiny_model
from tests.strategies import explicit_tree, random_forest


def _abstract_mesh(data, model):
    return AbstractMesh((data, model), ("data", "model"))


def test_dense_rules_split_heads_mlp_and_vocab():
    cfg = tiny_config()
    _, params = tiny_model()
    specs = param_specs(params, qwen3_rules(cfg, 2), _abstract_mesh(4, 2))
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
    four = param_specs(params, qwen3_rules(cfg, 4), _abstract_mesh(2, 4))
    kv = [v for k, v in jax.tree_util.tree_leaves_with_path(four, is_leaf=lambda x: isinstance(
        x, P)) if "k_proj" in jax.tree_util.keystr(k)]
    assert set(kv) == {P()}  # fewer kv heads than devices: replicated


def test_rules_reject_shapes_the_mesh_cannot_split():
    with pytest.raises(ValueError, match=r"mesh.model=3 must divide num_attention_heads \(4\)"):
        qwen3_rules(tiny_config(), 3)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\) must divide one another"):
        qwen3_rules(tiny_config(num_attention_heads=6, num_key_value_heads=3,
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
        graphdef, params = nnx.split(Qwen3(tiny_config(remat=remat), rngs=nnx.Rngs(0)))
        grads[remat] = jax.jit(make_grad_fn(graphdef, Objective()))(params, inputs)[2]
    for remat in ("full", "dots"):
        for a, b in zip(jax.tree_util.tree_leaves(grads[remat]),
                        jax.tree_util.tree_leaves(grads["none"])):
            assert rel_l2(a, b) <= 1e-6
