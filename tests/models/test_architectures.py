"""The architecture registry, each record's layer choice for the shared decoder stack, and the
runtime config kept apart from the architecture config."""

import dataclasses

import numpy as np
import pytest
from flax import nnx

from jtree.config.architectures import (
    GptOssConfig,
    LayerKind,
    Qwen3_5Config,
    Qwen3_5MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)
from jtree.config.runtime import RuntimeConfig
from jtree.models import ARCHITECTURES, architecture, create_model
from jtree.models.architectures import architecture_of_config, architecture_of_hf_config


def test_layer_choice_follows_each_config():
    assert Qwen3Config(num_hidden_layers=3).decoder().layers == (LayerKind("attention", "mlp"),) * 3
    moe = Qwen3MoeConfig(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=(3,))
    assert [k.ffn for k in moe.decoder().layers] == ["mlp", "moe", "mlp", "mlp"]
    assert {k.mixer for k in moe.decoder().layers} == {"attention"}
    nxt = Qwen3NextConfig(num_hidden_layers=4, mlp_only_layers=(0,))
    assert nxt.decoder().layers == (
        LayerKind("gated_deltanet", "mlp"), LayerKind("gated_deltanet", "moe_shared"),
        LayerKind("gated_deltanet", "moe_shared"), LayerKind("gated_attention", "moe_shared"))
    assert (nxt.decoder().norm, nxt.decoder().rotary_dim) == ("offset_rms", 8)
    assert nxt.decoder().needs_gdn_tables and not moe.decoder().needs_gdn_tables
    # Qwen3.5: Next's hybrid layers, dense or all sparse, with separate GDN projections.
    dense, sparse = Qwen3_5Config(num_hidden_layers=4), Qwen3_5MoeConfig(num_hidden_layers=4)
    assert [k.mixer for k in dense.decoder().layers] == [k.mixer for k in nxt.decoder().layers]
    assert {k.ffn for k in dense.decoder().layers} == {"mlp"}
    assert {k.ffn for k in sparse.decoder().layers} == {"moe_shared"}
    assert dense.decoder().gdn_projections == sparse.decoder().gdn_projections == "qkv_z_b_a"
    assert nxt.decoder().gdn_projections == "qkvz_ba"
    with pytest.raises(ValueError, match="mlp_only_layers"):
        Qwen3_5MoeConfig(mlp_only_layers=(0,))


def test_the_stack_builds_the_chosen_modules_under_hugging_face_names():
    cfg = Qwen3NextConfig(num_hidden_layers=2, mlp_only_layers=(1,),
                          layer_types=("full_attention", "linear_attention"))
    model = nnx.eval_shape(lambda: create_model("qwen3_next", cfg))
    names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model))}
    assert "model.layers.0.self_attn.q_proj.kernel" in names
    assert "model.layers.0.mlp.shared_expert_gate.kernel" in names
    assert "model.layers.1.linear_attn.in_proj_qkvz.kernel" in names
    assert "model.layers.1.mlp.gate_proj.kernel" in names
    assert not any(n.startswith("model.layers.0.linear_attn") for n in names)
    qwen3_5 = nnx.eval_shape(lambda: create_model("qwen3_5", Qwen3_5Config(num_hidden_layers=1)))
    names_3_5 = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(qwen3_5))}
    assert {f"model.layers.0.linear_attn.in_proj_{x}.kernel" for x in ("qkv", "z", "b", "a")
            } <= names_3_5 and not any("qkvz" in n for n in names_3_5)
    gpt_oss = nnx.eval_shape(lambda: create_model("gpt_oss", GptOssConfig(num_hidden_layers=2)))
    layers = gpt_oss.model.layers
    assert [layer.self_attn.window for layer in layers] == [128, None]  # sliding, full
    assert layers[1].self_attn.sinks.shape == (GptOssConfig().num_attention_heads,)
    assert layers[0].mlp.gate.bias is not None and layers[0].mlp.experts.clamp == (1.702, 7.0)
    # The gated attention's q_proj holds [query, gate] per head.
    q = model.model.layers[0].self_attn.q_proj.kernel
    assert q.shape == (cfg.hidden_size, 2 * cfg.num_attention_heads * cfg.head_dim)


def test_registry_looks_records_up_by_name_hf_name_and_config_class():
    assert set(ARCHITECTURES) == {"qwen3", "qwen3_moe", "qwen3_next", "llama", "qwen2",
                                  "qwen3_5", "qwen3_5_moe", "gpt_oss", "deepseek_v3",
                                  "nemotron_h", "kimi_linear"}
    for name, arch in ARCHITECTURES.items():
        assert architecture(name) is arch and arch.name == name
        assert architecture_of_config(arch.config_class()) is arch
        assert architecture_of_hf_config({"architectures": [arch.hf.hf_name]}) is arch
    with pytest.raises(ValueError, match=r"architecture: 'gemma' is not one of"):
        architecture("gemma")
    with pytest.raises(ValueError, match=r"'GemmaForCausalLM' is not supported"):
        architecture_of_hf_config({"architectures": ["GemmaForCausalLM"]})
    with pytest.raises(ValueError, match=r"needs a Qwen3NextConfig, got Qwen3MoeConfig"):
        create_model("qwen3_next", Qwen3MoeConfig())


def test_runtime_fields_are_not_architecture_fields():
    runtime = {f.name for f in dataclasses.fields(RuntimeConfig)}
    for arch in ARCHITECTURES.values():
        assert not runtime & {f.name for f in dataclasses.fields(arch.config_class)}
        assert not runtime & set(arch.hf.config_to_hf(arch.config_class()))
    with pytest.raises(TypeError, match="attention_impl"):
        Qwen3Config(attention_impl="reference")
    for field, value in (("dtype", "float8"), ("remat", "some"), ("attention_impl", "flash")):
        with pytest.raises(ValueError, match=rf"^{field}: '{value}' is not one of"):
            RuntimeConfig(**{field: value})


def test_gpt_oss_refuses_a_redundancy_free_prefix_under_its_windows():
    """The prefix layout of a redundancy-free part has no path positions for its cached keys,
    which a sliding window counts in: refused by name rather than windowed wrongly."""
    from jtree.layout.batch import padding
    from jtree.models.prefix import AttentionCache
    from tests.models_util import tiny_gpt_oss_config, tiny_lm

    model = tiny_lm(tiny_gpt_oss_config())
    batch = padding(1, 8, score_len=None, prefix_len=4)
    cache = AttentionCache(np.zeros((1, 4, 2, 8), np.float32), np.zeros((1, 4, 2, 8), np.float32))
    with pytest.raises(ValueError, match="sliding-window attention layers with a redundancy-free"):
        model(batch, prefix=[cache, cache])
