"""Kimi-Linear against transformers (a tiny random `KimiLinearForCausalLM`, CPU, float32).

The checkpoint is written by transformers itself with every parameter random (`A_log`,
`dt_bias` and the gated norm's weight too; `tests.hf_path_checks`) and the routers' selection
biases random (`write_deepseek_checkpoint`). Its shape: 3 layers, KDA + dense SwiGLU, MLA
(no RoPE, no query bottleneck, q/k heads of 16 + 8 features, value heads of 12) + DeepSeekMoE,
KDA + DeepSeekMoE; KDA with 2 heads of 8 and a conv of 4; 8 routed experts in 4 groups of which
2 are eligible, top 3, 2 shared experts. KDA chunks of 4 tokens, so the recurrence crosses chunk
boundaries inside nodes and every node's first chunk reads its parent's state. The checks: tree
log-probs and PPO gradients per path within 1e-4, save -> the very files transformers wrote
(its Hub names: `block_sparse_moe`, `q/k/v_conv1d`, per-expert `w1/w2/w3`), load of save
identical, transformers' in-memory names read too, float32 router and dt_bias in bfloat16 runs, the Hub's `linear_attn_config`, and
refusals.
"""

import numpy as np
import pytest
from safetensors.numpy import load_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jtree.hf  # noqa: E402
from jtree.config.architectures import KimiLinearConfig, LayerKind  # noqa: E402
from jtree.hf.safetensors_io import SINGLE_FILE  # noqa: E402
from tests.hf_path_checks import (  # noqa: E402
    assert_ppo_gradients_equal_per_path,
    assert_tree_logprobs_equal_per_path,
    write_deepseek_checkpoint,
)
from tests.hf_util import assert_same_params, copy_checkpoint, param_arrays  # noqa: E402
from tests.models_util import tiny_runtime  # noqa: E402
from tests.torch_util import VOCAB  # noqa: E402

CHUNK = 4
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention"]
MLP_LAYER_TYPES = ["dense", "sparse", "sparse"]


def kimi_config(**overrides):
    """The tiny transformers `KimiLinearConfig` of these tests (module docstring)."""
    return transformers.KimiLinearConfig(**dict(dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2,
        num_local_experts=8, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=4, topk_group=2,
        num_experts_per_tok=3, linear_head_dim=8, linear_num_heads=2, linear_conv_kernel_dim=4,
        layer_types=LAYER_TYPES, mlp_layer_types=MLP_LAYER_TYPES, tie_word_embeddings=False,
        pad_token_id=None, bos_token_id=1, eos_token_id=2), **overrides))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, transformers model, jtree config, jtree model)."""
    path = tmp_path_factory.mktemp("hf_kimi_linear")
    ref = write_deepseek_checkpoint(kimi_config(), path)
    config, model = jtree.hf.load(path, tiny_runtime())
    return path, ref, config, model


def test_load_reads_the_architecture_fields(checkpoint):
    _, ref, config, model = checkpoint
    assert type(config) is KimiLinearConfig and model.config == config
    assert config.decoder().layers == (LayerKind("kda", "mlp"), LayerKind("mla", "deepseek_moe"),
                                       LayerKind("kda", "deepseek_moe"))
    assert (config.n_group, config.topk_group, config.num_experts) == (4, 2, 8)
    assert config.softmax_scale == pytest.approx(ref.model.layers[1].self_attn.scaling,
                                                 rel=1e-12)
    kda = model.model.layers[0].self_attn
    np.testing.assert_array_equal(
        np.asarray(kda.forget_gate.A_log[...]),
        ref.model.layers[0].self_attn.forget_gate.A_log.detach().numpy().reshape(-1))
    assert kda.conv1d.weight.shape == (3 * 16, 1, 4)
    mlp = model.model.layers[1].mlp
    np.testing.assert_array_equal(
        np.asarray(mlp.gate.e_score_correction_bias[...]),
        ref.model.layers[1].mlp.gate.e_score_correction_bias.numpy())


def test_tree_logprobs_equal_transformers_per_path(checkpoint):
    _, ref, _, model = checkpoint
    assert assert_tree_logprobs_equal_per_path(ref, model, gdn_chunk_size=CHUNK) > 0


@pytest.mark.parametrize("scan", ["sequential", pytest.param("parallel", marks=pytest.mark.slow)])
def test_tree_ppo_gradient_equals_transformers_per_path(checkpoint, scan):
    """Every tensor's gradient (the selection biases' are zero on both sides) with both tree
    scans of the KDA state (the parallel one composes the chunks' affine maps along the parent
    pointers)."""
    path, ref, config, _ = checkpoint
    _, model = jtree.hf.load(path, tiny_runtime(gdn_scan=scan))
    assert_ppo_gradients_equal_per_path(ref, config, model, gdn_chunk_size=CHUNK)


def test_save_writes_the_files_transformers_wrote(checkpoint, tmp_path):
    """A bit-exact round trip: the saved tensors are transformers' own, by name (its Hub form)
    and by value, and transformers loads them as the same model."""
    path, ref, config, model = checkpoint
    jtree.hf.save(model, config, tmp_path)
    ours, theirs = load_file(str(tmp_path / SINGLE_FILE)), load_file(str(path / SINGLE_FILE))
    assert ours.keys() == theirs.keys()
    assert "model.layers.0.self_attn.q_conv1d.weight" in ours
    for name, value in theirs.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)
    # (jtree writes no token ids; transformers' default pad id is past the tiny vocabulary)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                             pad_token_id=None)
    for key in ("layer_types", "mlp_layer_types", "n_group", "topk_group", "num_local_experts",
                "num_experts_per_tok", "n_shared_experts", "norm_topk_prob", "q_lora_rank",
                "linear_head_dim", "linear_num_heads", "rms_norm_eps", "routed_scaling_factor"):
        assert getattr(back.config, key) == getattr(ref.config, key), key
    again_config, again = jtree.hf.load(tmp_path, tiny_runtime())
    assert again_config == config
    assert_same_params(again, model)


def test_transformers_in_memory_names_load_too(checkpoint, tmp_path):
    """A checkpoint holding transformers' in-memory tensors (`mlp.*`, fused experts, one
    `conv1d`, `forget_gate.*`, A_log [1, 1, H, 1]) loads as the same model."""
    path, ref, _, model = checkpoint

    def in_memory(tensors):
        tensors.clear()
        tensors.update({n: t.detach().numpy() for n, t in ref.state_dict().items()})

    assert "model.layers.0.self_attn.forget_gate.A_log" in ref.state_dict()
    _, loaded = jtree.hf.load(copy_checkpoint(path, tmp_path, edit_tensors=in_memory),
                              tiny_runtime())
    assert_same_params(loaded, model)


def test_router_and_dt_bias_stay_float32_in_bfloat16_runs_and_saves(checkpoint, tmp_path):
    path, _, _, _ = checkpoint
    config, model = jtree.hf.load(path, tiny_runtime(param_dtype="bfloat16"))
    fp32 = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "forget_gate.dt_bias")
    for name, value in param_arrays(model).items():
        assert (value.dtype == np.float32) == name.endswith(fp32), name
    jtree.hf.save(model, config, tmp_path, dtype="bfloat16")
    saved = load_file(str(tmp_path / SINGLE_FILE))
    assert saved["model.layers.0.self_attn.dt_bias"].dtype == np.float32
    assert saved["model.layers.1.block_sparse_moe.gate.weight"].dtype == np.float32
    assert saved["model.layers.0.self_attn.q_proj.weight"].dtype != np.float32


def _hub_form(c):
    """The Hub's config.json: layer kinds and KDA shapes in `linear_attn_config`, the MLP kinds
    by `first_k_dense_replace`."""
    for key in ("layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads",
                "linear_conv_kernel_dim"):
        del c[key]
    c.update(linear_attn_config={"full_attn_layers": [2], "kda_layers": [1, 3], "num_heads": 2,
                                 "head_dim": 8, "short_conv_kernel_size": 4},
             first_k_dense_replace=1)


def test_hub_linear_attn_config_is_read(checkpoint, tmp_path):
    path, _, config, _ = checkpoint
    hub_config, _ = jtree.hf.load(copy_checkpoint(path, tmp_path, edit_config=_hub_form),
                                  tiny_runtime())
    assert hub_config == config


@pytest.mark.parametrize("edit, match", [
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(num_expert_group=3), "n_group"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(mla_use_nope=True), "mla_use_nope"),
    (dict(first_k_dense_replace=2), "first_k_dense_replace"),
    (dict(linear_attn_config={"full_attn_layers": [1], "kda_layers": [2, 3]}),
     "linear_attn_config"),
    (dict(mlp_layer_types=["dense", "moe", "sparse"]), "mlp_layer_types"),
])
def test_refuses_what_it_does_not_implement(checkpoint, tmp_path, edit, match):
    path = copy_checkpoint(checkpoint[0], tmp_path, edit_config=lambda c: c.update(edit))
    with pytest.raises(ValueError, match=match):
        jtree.hf.load(path, tiny_runtime())
