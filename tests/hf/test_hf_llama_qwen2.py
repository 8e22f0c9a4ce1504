"""Llama 3 (scaled RoPE) and Qwen2.5 against transformers (tiny random models, CPU, float32).

Each checkpoint is written by transformers itself with every parameter random (norm weights and
biases too), so a swapped, transposed or misnamed tensor cannot hide. On branching trees (several
levels, siblings, paths ending inside, duplicates) `jtree compare-torch` checks logits, tree
log-probs and SFT gradients against transformers run path by path; the PPO test does the same for
the clipped surrogate with KL and entropy, its per-path loss written in torch (the checks are
`tests.hf_path_checks`'). The Llama 3 checkpoint's RoPE scaling keeps, blends and slows down some
frequency each (`tests.models_util.TINY_LLAMA3_ROPE`), so all three branches of the formula are
exercised.
"""

import dataclasses

import pytest
from safetensors.numpy import load_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jtree.hf  # noqa: E402
from jtree.config.architectures import LlamaConfig, Qwen2Config  # noqa: E402
from jtree.hf.safetensors_io import SINGLE_FILE  # noqa: E402
from tests.hf_path_checks import (  # noqa: E402
    assert_from_pretrained_gives_the_same_model,
    assert_ppo_gradients_equal_per_path,
    assert_tree_logprobs_equal_per_path,
    compare_torch_report,
    write_random_checkpoint,
)
from tests.hf_util import assert_same_params, copy_checkpoint  # noqa: E402
from tests.models_util import TINY_LLAMA3_ROPE, tiny_runtime  # noqa: E402
from tests.torch_util import VOCAB  # noqa: E402

COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0,
               **dataclasses.asdict(TINY_LLAMA3_ROPE)}
CONFIGS = {
    # Llama 3: untied head, biases on attention and MLP, GQA, head_dim 8 = hidden / heads.
    "llama3": lambda: transformers.LlamaConfig(
        **COMMON, head_dim=8, tie_word_embeddings=False, attention_bias=True, mlp_bias=True,
        rope_parameters=LLAMA3_ROPE),
    # Llama with a tied head, no biases, head_dim 16 != hidden / heads, plain RoPE.
    "llama_tied": lambda: transformers.LlamaConfig(
        **COMMON, head_dim=16, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    # Qwen2.5 (as its small models): tied head, q/k/v biases, sliding window off.
    "qwen2": lambda: transformers.Qwen2Config(
        **COMMON, tie_word_embeddings=True, use_sliding_window=False, sliding_window=64,
        max_window_layers=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
}
CONFIG_CLASS = {"llama3": LlamaConfig, "llama_tied": LlamaConfig, "qwen2": Qwen2Config}


def write_checkpoint(kind, path):
    """transformers' model of `CONFIGS[kind]`, every parameter random, saved to `path`."""
    return write_random_checkpoint(CONFIGS[kind](), path)


@pytest.fixture(scope="module", params=list(CONFIGS))
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def checkpoint(kind, tmp_path_factory):
    """(directory, transformers model, jtree config, jtree model) of one architecture."""
    path = tmp_path_factory.mktemp(f"hf_{kind}")
    ref = write_checkpoint(kind, path)
    config, model = jtree.hf.load(path, tiny_runtime())
    return path, ref, config, model


def test_load_reads_the_architecture_fields(kind, checkpoint):
    _, ref, config, model = checkpoint
    assert type(config) is CONFIG_CLASS[kind] and model.config == config
    hf = ref.config
    assert config.head_dim == getattr(hf, "head_dim", hf.hidden_size // hf.num_attention_heads)
    assert config.tie_word_embeddings == hf.tie_word_embeddings
    attn = model.model.layers[0].self_attn
    assert attn.q_norm is None and attn.k_norm is None  # no q/k norm in either architecture
    assert (attn.q_proj.bias is not None) == (kind != "llama_tied")
    assert (attn.o_proj.bias is not None) == (kind == "llama3")
    assert (model.model.layers[0].mlp.up_proj.bias is not None) == (kind == "llama3")
    assert config.rope_theta == hf.rope_parameters["rope_theta"]
    if kind == "llama3":
        assert config.rope_scaling == TINY_LLAMA3_ROPE


def test_compare_torch_logits_logprobs_and_gradients_within_tolerance(checkpoint,
                                                                     tmp_path):
    r = compare_torch_report(checkpoint[0], tmp_path)
    assert r["groups"]["full_attention"]["layers"] == 3 and r["groups"]["mlp"]["tensors"] > 0


def test_tree_logprobs_equal_transformers_per_path(checkpoint):
    _, ref, _, model = checkpoint
    assert_tree_logprobs_equal_per_path(ref, model)


def test_tree_ppo_gradient_equals_transformers_per_path(checkpoint):
    _, ref, config, model = checkpoint
    assert_ppo_gradients_equal_per_path(ref, config, model)


def test_save_then_from_pretrained_gives_the_same_model(checkpoint, tmp_path):
    path, ref, config, model = checkpoint
    jtree.hf.save(model, config, tmp_path)
    assert_from_pretrained_gives_the_same_model(ref, tmp_path, (
        "rope_parameters", "tie_word_embeddings", "attention_bias", "mlp_bias",
        "num_key_value_heads", "rms_norm_eps", "layer_types"))
    # (jtree writes Qwen2's head_dim, which transformers' Qwen2 reads when present)
    back = transformers.AutoConfig.from_pretrained(tmp_path)
    assert getattr(back, "head_dim", None) in (None, config.head_dim)


def test_load_of_save_is_identical(checkpoint, tmp_path):
    _, _, config, model = checkpoint
    jtree.hf.save(model, config, tmp_path)
    names = set(load_file(str(tmp_path / SINGLE_FILE)))
    assert ("lm_head.weight" in names) == (not config.tie_word_embeddings)
    assert not any("q_norm" in n or "k_norm" in n for n in names)
    loaded_config, loaded = jtree.hf.load(tmp_path, tiny_runtime())
    assert loaded_config == config
    assert_same_params(loaded, model)


def _hub_style(c):
    """config.json as the Hub's Llama 3.1 and Qwen2.5 (transformers 4) write it: top-level
    `rope_theta`, Llama 3's scaling in `rope_scaling`."""
    params = c.pop("rope_parameters")
    c["rope_theta"] = params.pop("rope_theta")
    c["rope_scaling"] = None if params["rope_type"] == "default" else params
    c.pop("layer_types", None)


def test_hub_style_config_is_read(checkpoint, tmp_path):
    path, _, config, model = checkpoint
    hub_config, loaded = jtree.hf.load(copy_checkpoint(path, tmp_path, edit_config=_hub_style),
                                       tiny_runtime())
    assert hub_config == config
    assert_same_params(loaded, model)


REFUSED = {
    "llama3": [
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
         r"rope_parameters\.rope_type = 'yarn'"),
        (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
         r"rope_scaling\.rope_type = 'dynamic'"),
        (dict(rope_scaling=dict(LLAMA3_ROPE, factor=4.0)), "conflicting factor"),
        (dict(rope_parameters={k: v for k, v in LLAMA3_ROPE.items() if k != "low_freq_factor"}),
         r"rope_scaling\.low_freq_factor is missing"),
        (dict(pretraining_tp=2), "pretraining_tp"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    ],
    "llama_tied": [(dict(hidden_act="gelu"), "hidden_act")],
    "qwen2": [
        (dict(use_sliding_window=True), "use_sliding_window"),
        (dict(layer_types=["full_attention", "sliding_attention", "full_attention"]),
         "layer_types"),
        (dict(rope_parameters={"rope_type": "llama3", **LLAMA3_ROPE}),
         r"rope_parameters\.rope_type = 'llama3'"),
        (dict(attention_bias=False), "attention_bias"),
    ],
}


def test_unsupported_config_is_refused_naming_the_field(kind, checkpoint, tmp_path):
    for i, (edit, field) in enumerate(REFUSED[kind]):
        bad = copy_checkpoint(checkpoint[0], tmp_path / str(i),
                              edit_config=lambda c, edit=edit: c.update(edit))
        with pytest.raises(ValueError, match=field):
            jtree.hf.load(bad)
