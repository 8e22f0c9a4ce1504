"""Qwen3.5 (dense and MoE) against transformers (tiny random models, CPU, float32).

The checks are `tests.hf_path_checks`' (compare-torch on branching trees, tree log-probs and PPO
gradients per path, save -> from_pretrained bit-exact), with Gated DeltaNet chunks of 8 tokens so
the recurrence crosses chunk boundaries inside paths. Both models have 2 value heads per key head
(so the grouping of `in_proj_qkv` is a real permutation), partial RoPE over half of each head and
layers [linear, full, linear] attention; the dense one has a tied head, attention biases and an
mrope section in `rope_parameters` (which reduces to 1-D RoPE on text); the MoE one an untied
head, the router loss in its objective and a shared expert in every layer.
"""

import dataclasses

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jtree.hf  # noqa: E402
from jtree.config.architectures import Qwen3_5Config, Qwen3_5MoeConfig  # noqa: E402
from jtree.hf.safetensors_io import SINGLE_FILE  # noqa: E402
from tests.hf_path_checks import (  # noqa: E402
    assert_from_pretrained_gives_the_same_model,
    assert_ppo_gradients_equal_per_path,
    compare_torch_report,
    write_random_checkpoint,
)
from tests.hf_util import assert_same_params, copy_checkpoint  # noqa: E402
from tests.models_util import tiny_lm, tiny_runtime  # noqa: E402
from tests.torch_util import VOCAB  # noqa: E402

CHUNK = 8
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
              layer_types=["linear_attention", "full_attention", "linear_attention"],
              linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=6,
              linear_num_key_heads=2, linear_num_value_heads=4)
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
CONFIGS = {
    "qwen3_5": lambda: transformers.Qwen3_5TextConfig(
        **COMMON, intermediate_size=48, tie_word_embeddings=True, attention_bias=True,
        rope_parameters=dict(ROPE, mrope_section=[1, 1, 0], mrope_interleaved=True)),
    "qwen3_5_moe": lambda: transformers.Qwen3_5MoeTextConfig(
        **COMMON, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=24, output_router_logits=True,
        router_aux_loss_coef=0.01, rope_parameters=ROPE),
}
CONFIG_CLASS = {"qwen3_5": Qwen3_5Config, "qwen3_5_moe": Qwen3_5MoeConfig}


@pytest.fixture(scope="module", params=list(CONFIGS))
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def checkpoint(kind, tmp_path_factory):
    """(directory, transformers model, jtree config, jtree model) of one architecture."""
    path = tmp_path_factory.mktemp(f"hf_{kind}")
    ref = write_random_checkpoint(CONFIGS[kind](), path)
    config, model = jtree.hf.load(path, tiny_runtime())
    return path, ref, config, model


def test_load_reads_the_architecture_fields(kind, checkpoint):
    _, ref, config, model = checkpoint
    assert type(config) is CONFIG_CLASS[kind] and model.config == config
    spec = config.decoder()
    assert [k.mixer for k in spec.layers] == ["gated_deltanet", "gated_attention",
                                              "gated_deltanet"]
    assert {k.ffn for k in spec.layers} == {"mlp" if kind == "qwen3_5" else "moe_shared"}
    assert spec.gdn_projections == "qkv_z_b_a" and spec.norm == "offset_rms"
    assert spec.rotary_dim == 4 and config.rope_theta == 10000.0
    gdn = model.model.layers[0].linear_attn
    assert gdn.in_proj_qkv.kernel.shape == (32, 2 * 16 + 24)
    assert (model.model.layers[1].self_attn.o_proj.bias is not None) == (kind == "qwen3_5")
    assert config.tie_word_embeddings == ref.config.tie_word_embeddings


def test_compare_torch_logits_logprobs_and_gradients_within_tolerance(kind, checkpoint,
                                                                     tmp_path):
    r = compare_torch_report(checkpoint[0], tmp_path, "--gdn-chunk-size", str(CHUNK))
    groups = r["groups"]
    assert groups["linear_attention"]["layers"] == 2 and groups["full_attention"]["layers"] == 1
    assert groups["mlp" if kind == "qwen3_5" else "moe"]["layers"] == 3
    if kind == "qwen3_5_moe":  # the router loss is part of both losses
        assert r["tree_aux_loss"] > 0
        assert r["tree_aux_loss"] == pytest.approx(r["path_aux_loss"], rel=1e-5)


@pytest.mark.slow  # the default suite's checks against transformers per path are compare-torch's
def test_tree_ppo_gradient_equals_transformers_per_path(checkpoint):
    """The tree's PPO loss and gradients against transformers per path (the tree log-probs are
    compare-torch's). The PPO loss written in torch has no router loss: the MoE model is run
    without it here (compare-torch checks it)."""
    _, ref, config, model = checkpoint
    if config.decoder().kinds() & {"moe_shared"}:
        config = dataclasses.replace(config, output_router_logits=False)
        model = nnx.merge(nnx.graphdef(tiny_lm(config)), nnx.state(model, nnx.Param))
    assert_ppo_gradients_equal_per_path(ref, config, model, gdn_chunk_size=CHUNK)


def test_save_then_from_pretrained_gives_the_same_model(checkpoint, tmp_path):
    path, ref, config, model = checkpoint
    jtree.hf.save(model, config, tmp_path)
    assert_from_pretrained_gives_the_same_model(ref, tmp_path, (
        "tie_word_embeddings", "attention_bias", "num_key_value_heads", "rms_norm_eps",
        "layer_types", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
        "num_experts", "shared_expert_intermediate_size", "output_router_logits"))


def test_load_of_save_is_identical(checkpoint, tmp_path):
    _, _, config, model = checkpoint
    jtree.hf.save(model, config, tmp_path)
    names = set(load_file(str(tmp_path / SINGLE_FILE)))
    assert ("lm_head.weight" in names) == (not config.tie_word_embeddings)
    loaded_config, loaded = jtree.hf.load(tmp_path, tiny_runtime())
    assert loaded_config == config
    assert_same_params(loaded, model)


def _hub_style(c):
    """config.json as released Qwen3.5 text configs carry it: the mtp keys, the output gate,
    the SSM dtype, `full_attention_interval` beside `layer_types`, top-level
    `partial_rotary_factor`, an empty `mlp_only_layers` and the mrope keys."""
    c.update(attn_output_gate=True, mamba_ssm_dtype="float32", mtp_num_hidden_layers=1,
             mtp_use_dedicated_embeddings=False, full_attention_interval=4, mlp_only_layers=[],
             partial_rotary_factor=0.5)
    c["rope_parameters"].update(mrope_section=[1, 1, 0], mrope_interleaved=True)


def _with_mtp(tensors):
    tensors["mtp.fc.weight"] = np.ones((4, 4), np.float32)


def test_hub_style_config_and_mtp_tensors_are_read(checkpoint, tmp_path):
    path, _, config, model = checkpoint
    hub_config, loaded = jtree.hf.load(
        copy_checkpoint(path, tmp_path, edit_config=_hub_style, edit_tensors=_with_mtp),
        tiny_runtime())
    assert hub_config == config
    assert_same_params(loaded, model)


def _edit_rope(**kw):
    return lambda c: c["rope_parameters"].update(kw)


REFUSED = [
    (_edit_rope(mrope_section=[2, 1, 0]), r"rope_parameters\.mrope_section = \[2, 1, 0\]"),
    (_edit_rope(mrope_section=[1, 1]), r"rope_parameters\.mrope_section"),
    (_edit_rope(rope_type="yarn", factor=4.0), r"rope_parameters\.rope_type = 'yarn'"),
    (lambda c: c.update(attn_output_gate=False), "attn_output_gate"),
    (lambda c: c.update(mamba_ssm_dtype="bfloat16"), "mamba_ssm_dtype"),
    (lambda c: c.update(mlp_only_layers=[1]), "mlp_only_layers"),
    (lambda c: c.update(decoder_sparse_step=2), "decoder_sparse_step"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
]


def test_unsupported_config_is_refused_naming_the_field(checkpoint, tmp_path):
    for i, (edit, field) in enumerate(REFUSED):
        bad = copy_checkpoint(checkpoint[0], tmp_path / str(i), edit_config=edit)
        with pytest.raises(ValueError, match=field):
            jtree.hf.load(bad)
