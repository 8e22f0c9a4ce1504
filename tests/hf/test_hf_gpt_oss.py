"""gpt-oss against transformers (a tiny random `GptOssForCausalLM`, CPU, float32).

The checkpoint is written by transformers itself with every parameter random (norms, biases,
sinks and the router bias too; `tests.hf_path_checks`). Its layers are [sliding, full, sliding]
attention with a window of 4 positions, shorter than most paths of the compare trees, so windows
cut both inside a node and across the branch points; every layer is a MoE block of 4 experts
(top-2) whose SwiGLU limit is 1.0, so the clamps act on many gate and up values; its RoPE is
YaRN with a correction range that keeps one frequency, blends two and interpolates one; the
router loss is on. The checks: `jtree compare-torch` (logits, tree log-probs, SFT gradients and
the router loss per path), the PPO loss and gradients per path, save -> `from_pretrained`
bit-exact, load of save identical, the Hub's config form, refusals, and YaRN's frequencies
against transformers' own function.
"""

import dataclasses
import math

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jtree.hf  # noqa: E402
from jtree.config.architectures import GptOssConfig, YarnRopeScaling  # noqa: E402
from jtree.hf.safetensors_io import SINGLE_FILE  # noqa: E402
from jtree.models.layers import rope_attention_factor, rope_inverse_frequencies  # noqa: E402
from tests.hf_path_checks import (  # noqa: E402
    assert_from_pretrained_gives_the_same_model,
    assert_ppo_gradients_equal_per_path,
    assert_tree_logprobs_equal_per_path,
    compare_torch_report,
    write_random_checkpoint,
)
from tests.hf_util import assert_same_params, copy_checkpoint  # noqa: E402
from tests.models_util import tiny_lm, tiny_runtime  # noqa: E402
from tests.torch_util import GPT_OSS_YARN, VOCAB, gpt_oss_config  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, transformers model, jtree config, jtree model)."""
    path = tmp_path_factory.mktemp("hf_gpt_oss")
    ref = write_random_checkpoint(gpt_oss_config(), path)
    config, model = jtree.hf.load(path, tiny_runtime())
    return path, ref, config, model


def test_load_reads_the_architecture_fields(checkpoint):
    _, ref, config, model = checkpoint
    assert type(config) is GptOssConfig and model.config == config
    spec = config.decoder()
    assert [k.mixer for k in spec.layers] == ["sliding_attention", "attention",
                                              "sliding_attention"]
    assert {k.ffn for k in spec.layers} == {"moe"}
    assert spec.sliding_window == 4 and spec.attention_sinks and not spec.qk_norm
    assert spec.swiglu_clamp == (ref.config.swiglu_alpha, 1.0)
    assert config.rope_scaling == YarnRopeScaling(factor=4.0, original_max_position_embeddings=64,
                                                  truncate=False)
    layer = model.model.layers[0]
    assert layer.self_attn.window == 4 and model.model.layers[1].self_attn.window is None
    assert layer.self_attn.sinks.shape == (4,) and layer.self_attn.o_proj.bias is not None
    assert layer.mlp.gate.bias.shape == (4,)
    assert layer.mlp.experts.gate_up_proj.shape == (4, 32, 32)  # [E, 2I, hidden], gate first
    assert layer.mlp.experts.gate_up_proj_bias.shape == (4, 32)
    # jtree's gate rows are HF's even columns (gate and up interleaved in HF's gate_up_proj)
    hf_gate_up = ref.model.layers[0].mlp.experts.gate_up_proj.detach().numpy()
    np.testing.assert_array_equal(np.asarray(layer.mlp.experts.gate_up_proj[...])[:, :16],
                                  hf_gate_up[:, :, 0::2].transpose(0, 2, 1))


def test_yarn_frequencies_equal_transformers():
    """jtree's YaRN against transformers' `_compute_yarn_parameters`: the frequencies of the
    test model (one kept, two blended, one interpolated) and of gpt-oss's released settings,
    truncated or not, and the attention factor with and without `mscale`."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cases = [(8, GPT_OSS_YARN),
             (64, dict(GPT_OSS_YARN, rope_theta=150000.0, factor=32.0,
                       original_max_position_embeddings=4096)),
             (64, dict(GPT_OSS_YARN, rope_theta=150000.0, factor=32.0, truncate=True,
                       original_max_position_embeddings=4096)),
             (16, dict(GPT_OSS_YARN, mscale=1.0, mscale_all_dim=0.5, beta_fast=8.0))]
    for head_dim, params in cases:
        hf = gpt_oss_config(head_dim=head_dim, rope_parameters=dict(params),
                            max_position_embeddings=int(
                                params["factor"] * params["original_max_position_embeddings"]))
        expected, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
        scaling = YarnRopeScaling(**{k: v for k, v in params.items()
                                     if k not in ("rope_type", "rope_theta")})
        ours = np.asarray(rope_inverse_frequencies(head_dim, params["rope_theta"], scaling))
        # (the same float32 formula; XLA's pow and its division by a constant, which it turns
        # into a product, round an element or two one ulp away from torch's)
        np.testing.assert_allclose(ours, expected.numpy(), rtol=1e-6, atol=0)
        assert rope_attention_factor(scaling) == pytest.approx(factor, rel=1e-12)
    plain = np.asarray(rope_inverse_frequencies(8, 100.0))
    ours = np.asarray(rope_inverse_frequencies(8, 100.0, YarnRopeScaling(
        factor=4.0, original_max_position_embeddings=64, truncate=False)))
    assert ours[0] == plain[0] and ours[3] == pytest.approx(plain[3] / 4, rel=1e-6)
    assert np.all((plain[1:3] / 4 < ours[1:3]) & (ours[1:3] < plain[1:3]))
    assert rope_attention_factor(YarnRopeScaling(factor=4.0)) == 0.1 * math.log(4.0) + 1


def test_compare_torch_logits_logprobs_and_gradients_within_tolerance(checkpoint, tmp_path):
    r = compare_torch_report(checkpoint[0], tmp_path)
    groups = r["groups"]
    assert groups["sliding_attention"]["layers"] == 2 and groups["full_attention"]["layers"] == 1
    assert groups["moe"]["layers"] == 3 and groups["moe"]["tensors"] > 0
    assert r["tree_aux_loss"] > 0  # the router loss is part of both losses
    assert r["tree_aux_loss"] == pytest.approx(r["path_aux_loss"], rel=1e-5)


def test_tree_logprobs_equal_transformers_per_path(checkpoint):
    """With the attention `auto` picks on this host (the C++ `cpu` kernel on CPU; compare-torch
    runs the reference)."""
    path, ref, _, _ = checkpoint
    _, model = jtree.hf.load(path, tiny_runtime(attention_impl="auto"))
    assert_tree_logprobs_equal_per_path(ref, model)


def test_tree_ppo_gradient_equals_transformers_per_path(checkpoint):
    """The PPO loss written in torch has no router loss: the model runs without it here
    (compare-torch checks it)."""
    _, ref, config, model = checkpoint
    config = dataclasses.replace(config, output_router_logits=False)
    model = nnx.merge(nnx.graphdef(tiny_lm(config)), nnx.state(model, nnx.Param))
    assert_ppo_gradients_equal_per_path(ref, config, model)


def test_save_then_from_pretrained_gives_the_same_model(checkpoint, tmp_path):
    path, ref, config, model = checkpoint
    jtree.hf.save(model, config, tmp_path)
    assert_from_pretrained_gives_the_same_model(ref, tmp_path, (
        "rope_parameters", "tie_word_embeddings", "attention_bias", "num_key_value_heads",
        "rms_norm_eps", "layer_types", "head_dim", "sliding_window", "num_local_experts",
        "num_experts_per_tok", "swiglu_alpha", "swiglu_limit", "output_router_logits",
        "router_aux_loss_coef"))


def test_load_of_save_is_identical(checkpoint, tmp_path):
    _, _, config, model = checkpoint
    jtree.hf.save(model, config, tmp_path)
    names = set(load_file(str(tmp_path / SINGLE_FILE)))
    assert "lm_head.weight" in names and "model.layers.0.mlp.router.bias" in names
    assert "model.layers.0.self_attn.sinks" in names
    loaded_config, loaded = jtree.hf.load(tmp_path, tiny_runtime())
    assert loaded_config == config
    assert_same_params(loaded, model)


def _hub_style(c):
    """config.json as the Hub's gpt-oss carries it (transformers 4.55): top-level `rope_theta`,
    YaRN in `rope_scaling`, `experts_per_token`, `initial_context_length`."""
    params = c.pop("rope_parameters")
    c["rope_theta"] = params.pop("rope_theta")
    c["rope_scaling"] = params
    c.update(experts_per_token=c["num_experts_per_tok"], initial_context_length=64)


def test_hub_style_config_is_read(checkpoint, tmp_path):
    path, _, config, model = checkpoint
    hub_config, loaded = jtree.hf.load(copy_checkpoint(path, tmp_path, edit_config=_hub_style),
                                       tiny_runtime())
    assert hub_config == config
    assert_same_params(loaded, model)


def test_rope_defaults_follow_transformers(tmp_path):
    """Without rope keys transformers' gpt-oss runs the released models' YaRN, and so does the
    jtree config read from it; plain RoPE (`rope_type: default`) survives save -> transformers."""
    no_rope = copy_checkpoint(_small_checkpoint(tmp_path / "src"), tmp_path / "no_rope",
                              edit_config=lambda c: c.pop("rope_parameters"))
    config, _ = jtree.hf.load(no_rope)
    assert config.rope_scaling == GptOssConfig().rope_scaling == YarnRopeScaling(
        factor=32.0, original_max_position_embeddings=4096, truncate=False)
    assert transformers.AutoConfig.from_pretrained(no_rope).rope_parameters["rope_type"] == "yarn"
    plain = copy_checkpoint(tmp_path / "src", tmp_path / "plain", edit_config=lambda c: c.update(
        rope_parameters={"rope_type": "default", "rope_theta": 100.0}))
    config, model = jtree.hf.load(plain)
    assert config.rope_scaling is None
    jtree.hf.save(model, config, tmp_path / "saved")
    back = transformers.AutoConfig.from_pretrained(tmp_path / "saved").rope_parameters
    assert back == {"rope_type": "default", "rope_theta": 100.0}
    assert jtree.hf.load(tmp_path / "saved")[0] == config


def _small_checkpoint(path):
    write_random_checkpoint(gpt_oss_config(num_hidden_layers=2, layer_types=None), path)
    return path


def _rope(**kw):
    return lambda c: c["rope_parameters"].update(kw)


REFUSED = [
    (_rope(rope_type="llama3"), r"rope_parameters\.rope_type = 'llama3'"),
    (_rope(low_freq_factor=1.0), r"rope_parameters\.low_freq_factor"),
    (lambda c: c["rope_parameters"].pop("factor"), r"rope_scaling\.factor is missing"),
    (lambda c: c.update(rope_scaling=dict(c["rope_parameters"], factor=8.0)),
     "conflicting factor"),
    (lambda c: c.update(experts_per_token=3), "experts_per_token"),
    (lambda c: c.update(attention_dropout=0.1), "attention_dropout"),
    (lambda c: c.update(layer_types=["sliding_attention", "chunked_attention",
                                     "full_attention"]), r"layer_types\[1\]"),
    (lambda c: c.update(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (lambda c: c.update(quantization_config={"quant_method": "bitsandbytes"}),
     "quantization_config"),
    (lambda c: c.update(use_sliding_window=True), "use_sliding_window"),
]


def test_unsupported_config_is_refused_naming_the_field(checkpoint, tmp_path):
    for i, (edit, field) in enumerate(REFUSED):
        bad = copy_checkpoint(checkpoint[0], tmp_path / str(i), edit_config=edit)
        with pytest.raises(ValueError, match=field):
            jtree.hf.load(bad)


def test_norm_scales_in_float32_as_transformers_in_bfloat16():
    """gpt-oss's RMSNorm multiplies its (float32) weight before casting back: in bfloat16 jtree's
    norm gives transformers' bits, where Qwen3's form (cast, then scale) would round twice."""
    import jax.numpy as jnp

    from jtree.models.layers import NORMS
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

    rng = np.random.default_rng(0)
    x = rng.normal(0, 3, (64, 32)).astype(np.float32)
    w = rng.normal(1, 0.3, 32).astype(np.float32)
    ref = GptOssRMSNorm(32, eps=1e-5)
    with torch.no_grad():
        ref.weight.copy_(torch.as_tensor(w))
        x_bf16 = torch.as_tensor(x).to(torch.bfloat16)
        expected = ref(x_bf16).float().numpy()
    ours = NORMS["rms_f32_scale"](32, eps=1e-5, param_dtype=jnp.float32)
    ours.weight.value = jnp.asarray(w)
    got = np.asarray(ours(jnp.asarray(x_bf16.float().numpy(), jnp.bfloat16)).astype(jnp.float32))
    np.testing.assert_array_equal(got, expected)
    qwen = NORMS["rms"](32, eps=1e-5, param_dtype=jnp.float32)
    qwen.weight.value = jnp.asarray(w)
    other = np.asarray(qwen(jnp.asarray(x_bf16.float().numpy(), jnp.bfloat16)).astype(jnp.float32))
    assert not np.array_equal(other, expected)
