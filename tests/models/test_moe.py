"""MoE block, router aux loss weighting, Qwen3-MoE / Qwen3-Next configs and parameter names."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jtree.config.architectures import Qwen3MoeConfig, Qwen3NextConfig
from jtree.layout.linearize import linearize
from jtree.models import ARCHITECTURES
from jtree.models.moe import RouterStats, SparseMoeBlock, load_balancing_loss, router_load
from jtree.trees.tree import TrajectoryTree
from tests.models_util import tiny_lm


def _block(shared=None, norm=True, matmul="auto"):
    return SparseMoeBlock(16, num_experts=5, top_k=2, moe_intermediate=8, norm_topk_prob=norm,
                          shared_intermediate=shared, init_std=0.5, dtype=jnp.float32,
                          param_dtype=jnp.float32, rngs=nnx.Rngs(0), expert_matmul=matmul)


@pytest.mark.parametrize("shared,norm,matmul", [
    (None, False, "ragged_dot"), (None, True, "ragged_dot"), (12, False, "ragged_dot"),
    (12, True, "ragged_dot"), (None, True, "tiled"), (12, False, "tiled")])
def test_dropless_experts_equal_a_dense_loop(shared, norm, matmul):
    block = _block(shared, norm, matmul)
    x = jax.random.normal(jax.random.key(1), (3, 7, 16))
    out, stats = block(x)
    flat = x.reshape(-1, 16)
    probs = jax.nn.softmax(flat @ block.gate.weight[...].T, axis=-1)
    want = jnp.zeros_like(flat)
    for n in range(flat.shape[0]):
        top = np.argsort(-np.asarray(probs[n]))[:2]
        w = probs[n, top] / (probs[n, top].sum() if norm else 1.0)
        for e, we in zip(top, w):
            gate, up = jnp.split(block.experts.gate_up_proj[...][e] @ flat[n], 2)
            want = want.at[n].add(we * (block.experts.down_proj[...][e] @ (jax.nn.silu(gate) * up)))
    if shared is not None:
        want = want + jax.nn.sigmoid(block.shared_expert_gate(flat)) * block.shared_expert(flat)
    np.testing.assert_allclose(out.reshape(-1, 16), want, atol=1e-5)
    np.testing.assert_allclose(stats.probs, probs, atol=1e-6)


def test_aux_loss_weights_equal_repeating_tokens():
    """Weighting a token by its multiplicity m gives exactly the loss of a batch holding m copies
    (what the per-path baseline holds for a shared tree token), value and gradient."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, 6, 5)), jnp.float32)  # 2 layers, 6 tokens, 5 experts
    mult = np.array([3, 1, 0, 2, 1, 4])

    def loss(lg, weight, index):
        stats = [RouterStats(jax.nn.softmax(lg[i][index], -1),
                             jax.lax.top_k(jax.nn.softmax(lg[i][index], -1), 2)[1]) for i in range(2)]
        return load_balancing_loss(stats, weight, 5)

    repeat = np.repeat(np.arange(6), mult)
    tree, g_tree = jax.value_and_grad(loss)(logits, jnp.asarray(mult), np.arange(6))
    flat, g_flat = jax.value_and_grad(loss)(logits, jnp.ones(len(repeat)), repeat)
    assert float(tree) == pytest.approx(float(flat), rel=1e-6)
    np.testing.assert_allclose(g_tree, g_flat, atol=1e-7)
    assert float(jnp.linalg.norm(g_tree)) > 0


def test_pooled_aux_loss_shares_add_up_to_the_whole_batch():
    """Pieces of a batch given the whole batch's router load (the parts of a tree split
    redundancy-free) have losses and gradients summing to the whole batch's."""
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(2, 9, 5)), jnp.float32)
    weight = jnp.asarray(rng.integers(0, 4, size=9), jnp.float32)
    pieces = [np.arange(0, 4), np.arange(4, 5), np.arange(5, 9)]

    def stats_of(lg, index):
        probs = [jax.nn.softmax(lg[i][index], -1) for i in range(2)]
        return [RouterStats(p, jax.lax.top_k(p, 2)[1]) for p in probs]

    def whole(lg):
        return load_balancing_loss(stats_of(lg, np.arange(9)), weight, 5)

    pooled = router_load(stats_of(logits, np.arange(9)), weight, 5)

    def shared(lg):
        return sum(load_balancing_loss(stats_of(lg, ix), weight[ix], 5, pooled=pooled)
                   for ix in pieces)

    separate = sum(load_balancing_loss(stats_of(logits, ix), weight[ix], 5) for ix in pieces)
    value, grad = jax.value_and_grad(whole)(logits)
    value_shared, grad_shared = jax.value_and_grad(shared)(logits)
    assert float(value_shared) == pytest.approx(float(value), rel=1e-6)
    assert abs(float(separate) - float(value)) > 1e-3  # per-piece losses would not add up
    np.testing.assert_allclose(grad_shared, grad, atol=1e-7)


def test_model_aux_loss_needs_path_count_and_config_flag():
    cfg = dict(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    batch = linearize([TrajectoryTree.from_sequences([[1, 2, 3], [1, 2, 4, 5]])], 8,
                      gdn_chunk_size=4).inputs

    def aux_loss(model, inputs):  # jitted: eager MoE / GDN layers are slow to dispatch
        graphdef, params = nnx.split(model)
        return float(jax.jit(lambda p, x: nnx.merge(graphdef, p)(x).aux_loss)(params, inputs))

    off = tiny_lm(Qwen3MoeConfig(**cfg), 0)
    assert aux_loss(off, batch) == 0.0  # HF adds it only with output_router_logits
    on = tiny_lm(Qwen3MoeConfig(**cfg, output_router_logits=True), 0)
    assert aux_loss(on, batch) > 0.0
    with pytest.raises(ValueError, match="path_count"):
        aux_loss(on, dataclasses.replace(batch, path_count=None))
    nxt = nnx.eval_shape(lambda: tiny_lm(Qwen3NextConfig(**cfg, layer_types=("linear_attention",))))
    with pytest.raises(ValueError, match="'gdn' missing"):
        nnx.eval_shape(lambda m: m(dataclasses.replace(batch, gdn=None)), nxt)


def test_parameter_names_follow_hugging_face():
    def names(model):
        return {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model))}

    moe_cfg = Qwen3MoeConfig(num_hidden_layers=2, mlp_only_layers=(1,))
    moe = names(nnx.eval_shape(lambda: tiny_lm(moe_cfg, 0)))
    assert {"model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.gate_up_proj",
            "model.layers.0.mlp.experts.down_proj", "model.layers.1.mlp.gate_proj.kernel",
            "model.layers.0.self_attn.q_norm.weight"} <= moe
    nxt = names(nnx.eval_shape(lambda: tiny_lm(Qwen3NextConfig(num_hidden_layers=4))))
    for n in ("linear_attn.in_proj_qkvz.kernel", "linear_attn.in_proj_ba.kernel",
              "linear_attn.conv1d.weight", "linear_attn.dt_bias", "linear_attn.A_log",
              "linear_attn.norm.weight", "linear_attn.out_proj.kernel",
              "mlp.shared_expert.up_proj.kernel", "mlp.shared_expert_gate.kernel"):
        assert f"model.layers.0.{n}" in nxt
    assert "model.layers.3.self_attn.q_proj.kernel" in nxt  # every 4th layer is full attention
    assert "model.layers.3.linear_attn.A_log" not in nxt
    assert set(ARCHITECTURES) >= {"qwen3", "qwen3_moe", "qwen3_next"}


def test_configs_validate():
    assert Qwen3NextConfig(num_hidden_layers=8).layer_types[3::4] == ("full_attention",) * 2
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        Qwen3MoeConfig(num_experts=2, num_experts_per_tok=3)
    with pytest.raises(ValueError, match=r"layer_types\[1\]"):
        Qwen3NextConfig(num_hidden_layers=2, layer_types=("linear_attention", "mamba"))
    with pytest.raises(ValueError, match="layer_types: 1 entries"):
        Qwen3NextConfig(num_hidden_layers=2, layer_types=("linear_attention",))
    with pytest.raises(ValueError, match="linear_num_key_heads"):
        Qwen3NextConfig(linear_num_key_heads=3, linear_num_value_heads=4)
