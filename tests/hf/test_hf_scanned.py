"""A Hugging Face checkpoint loads into a scanned model (`runtime.scan_layers`, stacked layers)
and saves back bit-identical: the same files, byte for byte, as the unscanned model writes."""

import jax
import numpy as np
import pytest
from flax import nnx

import jtree.hf
from jtree.config.run import MeshConfig
from jtree.parallel.layer_stack import convert_state, layer_groups
from jtree.parallel.sharding import make_mesh
from tests.hf_util import param_arrays, random_model
from tests.models_util import (
    four_expert_config,
    perturbed,
    tiny_gpt_oss_config,
    tiny_lm,
    tiny_runtime,
)

NEXT_LAYERS = ("linear_attention",) * 3 + ("full_attention",)


def _model(kind: str):
    """(config, unscanned model) with random weights: 3 dense layers, MoE with a dense first
    layer (an unscanned group, then a scanned one), Qwen3-Next's 3 x GDN + 1 x attention block
    twice and a one-layer tail, Qwen3.5-MoE's the same (its in_proj_qkv permuted layer by
    layer), and gpt-oss's [sliding, full] block twice (its expert tensors permuted layer by
    layer)."""
    if kind == "dense":
        return random_model(seed=1, num_hidden_layers=3)
    if kind == "moe":
        cfg = four_expert_config("moe", num_hidden_layers=3, mlp_only_layers=(0,))
    elif kind == "gpt_oss":
        cfg = tiny_gpt_oss_config(num_hidden_layers=4)
    else:
        cfg = four_expert_config(kind, num_hidden_layers=9, mlp_only_layers=(),
                                 layer_types=NEXT_LAYERS * 2 + ("linear_attention",))
    graphdef, params = nnx.split(tiny_lm(cfg, 0))
    return cfg, nnx.merge(graphdef, perturbed(params, 0.2))


def _files(path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir())}


@pytest.mark.parametrize("kind", [
    "dense", "moe", "next",
    pytest.param("qwen3_5_moe", marks=pytest.mark.slow),  # (the default suite's time budget)
    "gpt_oss"])
def test_load_into_scanned_and_save_back_is_bit_identical(kind, tmp_path):
    cfg, model = _model(kind)
    jtree.hf.save(model, cfg, tmp_path / "a")
    _, scanned = jtree.hf.load(tmp_path / "a", tiny_runtime(scan_layers=True))
    assert "model.blocks.0.0.input_layernorm.weight" in param_arrays(scanned)
    want = convert_state(nnx.state(model, nnx.Param), layer_groups(cfg.decoder().layers),
                         scanned=True)
    got = nnx.state(scanned, nnx.Param)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    jtree.hf.save(scanned, cfg, tmp_path / "b")
    assert _files(tmp_path / "b") == _files(tmp_path / "a")


def test_scanned_load_on_a_mesh_places_the_layer_axis_unsplit(tmp_path):
    cfg, model = _model("dense")
    jtree.hf.save(model, cfg, tmp_path)
    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    _, scanned = jtree.hf.load(tmp_path, tiny_runtime(scan_layers=True), mesh=mesh)
    kernel = scanned.model.blocks[0][0].self_attn.q_proj.kernel.get_value()
    assert kernel.shape[0] == 3
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, None, "model")
    np.testing.assert_array_equal(np.asarray(kernel)[2],
                                  np.asarray(model.model.layers[2].self_attn.q_proj.kernel[...]))


def test_scanned_gpt_oss_gives_the_unscanned_log_probs():
    """A scanned gpt-oss runs each block position's window (sliding, then full) in its scan: the
    same log-probs as the unscanned layers on branching trees."""
    from jtree.layout.linearize import linearize
    from tests.models_util import logprob_fn
    from tests.strategies import one_row_forests

    cfg = tiny_gpt_oss_config(num_hidden_layers=4)
    graphdef, params = nnx.split(tiny_lm(cfg, 0, attention_impl="xla"), nnx.Param)
    params = perturbed(params, 0.2)
    scanned, _ = nnx.split(tiny_lm(cfg, 0, attention_impl="xla", scan_layers=True), nnx.Param)
    stacked = convert_state(params, layer_groups(cfg.decoder().layers), scanned=True)
    batch = linearize(one_row_forests(cfg.vocab_size), 160)
    np.testing.assert_array_equal(np.asarray(logprob_fn(scanned)(stacked, batch.inputs)),
                                  np.asarray(logprob_fn(graphdef)(params, batch.inputs)))
