"""Nemotron-H against transformers (tiny random `NemotronHForCausalLM`, CPU, float32).

Layers [Mamba2, MoE, attention, MLP, Mamba2] with 4 Mamba2 heads in 2 groups, biases on the conv
and the Mamba2 projections (`use_bias`), and Mamba2 chunks of 4 tokens, so the recurrence crosses
chunk boundaries inside nodes and every node's first chunk reads its parent's. The MoE layer
(Nemotron 3's): 8 squared-ReLU experts in 4 groups of which 2 are eligible, top 3, scaled by 2.5,
a squared-ReLU shared expert, and the router's selection bias (`e_score_correction_bias`) set
random on the scale of the sigmoid scores, so it changes which experts are chosen. The checks are
`tests.hf_path_checks`': tree log-probs and PPO gradients against transformers on each path of
branching trees (several levels, siblings, paths ending inside), save -> from_pretrained
bit-exact, load of save identical.
"""

import numpy as np
import pytest
from safetensors.numpy import load_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jtree.hf
from jtree.config.architectures import LayerKind, NemotronHConfig
from jtree.hf.safetensors_io import SINGLE_FILE
from tests.hf_path_checks import (
    assert_from_pretrained_gives_the_same_model,
    assert_ppo_gradients_equal_per_path,
    assert_tree_logprobs_equal_per_path,
    write_deepseek_checkpoint,
)
from tests.hf_util import assert_same_params, copy_checkpoint
from tests.models_util import tiny_runtime
from tests.torch_util import VOCAB

CHUNK = 4
LAYERS = ["linear_attention", "moe", "full_attention", "mlp", "linear_attention"]


def hf_config(**overrides):
    kw = {"vocab_size": VOCAB, "hidden_size": 32, "layers_block_type": LAYERS,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
          "intermediate_size": 48, "ssm_state_size": 8, "mamba_num_heads": 4,
          "mamba_head_dim": 6, "n_groups": 2, "conv_kernel": 4, "use_bias": True,
          "chunk_size": 8, "time_step_min": 0.05, "tie_word_embeddings": False,
          "n_routed_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3,
          "moe_intermediate_size": 16, "moe_shared_expert_intermediate_size": 24,
          "routed_scaling_factor": 2.5, "norm_topk_prob": True}
    return transformers.NemotronHConfig(**kw, **overrides)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, transformers model, jtree config, jtree model)."""
    path = tmp_path_factory.mktemp("hf_nemotron_h")
    ref = write_deepseek_checkpoint(hf_config(), path)  # (random selection biases too)
    config, model = jtree.hf.load(path, tiny_runtime())
    return path, ref, config, model


def test_load_reads_the_architecture_fields(checkpoint):
    _, ref, config, model = checkpoint
    assert type(config) is NemotronHConfig and model.config == config
    assert config.decoder().layers == (
        LayerKind("mamba2", "none"), LayerKind("none", "relu2_moe"),
        LayerKind("attention", "none"), LayerKind("none", "relu2_mlp"),
        LayerKind("mamba2", "none"))
    mamba = model.model.layers[0].mixer
    assert mamba.in_proj.kernel.shape == (32, 24 + 24 + 2 * 2 * 8 + 4)
    assert mamba.in_proj.bias is not None and mamba.conv1d.bias.shape == (24 + 2 * 2 * 8,)
    assert config.time_step_min == 0.05 and config.layer_norm_epsilon == 1e-5
    assert not hasattr(model.model.layers[0], "post_attention_layernorm")
    moe = model.model.layers[1].mlp
    assert (config.num_experts, config.n_group, config.topk_group) == (8, 4, 2)
    assert moe.experts.up_proj.shape == (8, 16, 32) and moe.experts.gate_up_proj is None
    assert moe.shared_expert.up_proj.kernel.shape == (32, 24)
    bias = np.asarray(moe.gate.e_score_correction_bias[...])
    router = ref.model.layers[1].mixer.gate
    np.testing.assert_array_equal(bias, router.e_score_correction_bias.numpy())
    assert np.abs(bias).min() > 0


def test_tree_logprobs_equal_transformers_per_path(checkpoint):
    _, ref, _, model = checkpoint
    assert assert_tree_logprobs_equal_per_path(ref, model, gdn_chunk_size=CHUNK) > 0


@pytest.mark.parametrize("scan", ["sequential", pytest.param("parallel", marks=pytest.mark.slow)])
def test_tree_ppo_gradient_equals_transformers_per_path(checkpoint, scan):
    """Both tree scans of the Mamba2 state (the parallel one composes the chunks' affine maps
    along the parent pointers)."""
    path, ref, config, _ = checkpoint
    _, model = jtree.hf.load(path, tiny_runtime(gdn_scan=scan))
    assert_ppo_gradients_equal_per_path(ref, config, model, gdn_chunk_size=CHUNK)


def test_save_then_from_pretrained_gives_the_same_model(checkpoint, tmp_path):
    _, ref, config, model = checkpoint
    jtree.hf.save(model, config, tmp_path)
    assert_from_pretrained_gives_the_same_model(ref, tmp_path, (
        "tie_word_embeddings", "layers_block_type", "num_key_value_heads", "head_dim",
        "mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel",
        "time_step_min", "use_bias", "use_conv_bias", "layer_norm_epsilon", "chunk_size",
        "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "norm_topk_prob",
        "routed_scaling_factor", "moe_intermediate_size", "moe_shared_expert_intermediate_size"))


def test_load_of_save_is_identical(checkpoint, tmp_path):
    _, _, config, model = checkpoint
    jtree.hf.save(model, config, tmp_path)
    assert "lm_head.weight" in set(load_file(str(tmp_path / SINGLE_FILE)))
    loaded_config, loaded = jtree.hf.load(tmp_path, tiny_runtime())
    assert loaded_config == config
    assert_same_params(loaded, model)


def _legacy_pattern(c):
    """The Hub's older form: the layout as `hybrid_override_pattern` letters."""
    del c["layers_block_type"]
    c["hybrid_override_pattern"] = "ME*-M"


def _with_mtp(tensors):
    tensors["mtp.layers.0.norm.weight"] = np.ones((4,), np.float32)


def test_hybrid_override_pattern_and_mtp_tensors_are_read(checkpoint, tmp_path):
    path, _, config, model = checkpoint
    legacy_config, loaded = jtree.hf.load(
        copy_checkpoint(path, tmp_path, edit_config=_legacy_pattern, edit_tensors=_with_mtp),
        tiny_runtime())
    assert legacy_config == config
    assert_same_params(loaded, model)


REFUSED = [
    (lambda c: c.update(moe_latent_size=16), "moe_latent_size"),
    (lambda c: c.update(mlp_bias=True), "mlp_bias"),
    (lambda c: c.update(n_group=3), "n_group"),
    (lambda c: c.update(mlp_hidden_act="gelu"), "mlp_hidden_act"),
    (lambda c: c.update(mamba_hidden_act="relu"), "mamba_hidden_act"),
    (lambda c: c.update(sliding_window=16), "sliding_window"),
    (lambda c: c.update(mamba_n_groups=2), "mamba_n_groups"),
]


def test_unsupported_config_is_refused_naming_the_field(checkpoint, tmp_path):
    for i, (edit, field) in enumerate(REFUSED):
        bad = copy_checkpoint(checkpoint[0], tmp_path / str(i), edit_config=edit)
        with pytest.raises(ValueError, match=field):
            jtree.hf.load(bad)
