"""jtree.hf load/save without torch: round trips, sharded files, dtypes, and checkpoints that must
be refused with the offending tensor or config field named."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import jtree.hf
from jtree.config.runtime import RuntimeConfig
from jtree.hf.safetensors_io import INDEX_FILE, SINGLE_FILE
from tests.hf_util import assert_same_params, copy_checkpoint, param_arrays, random_model
from tests.models_util import tiny_runtime


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A valid untied checkpoint written by jtree.hf.save, and its model."""
    cfg, model = random_model(seed=3)
    path = tmp_path_factory.mktemp("ckpt")
    jtree.hf.save(model, cfg, path, overwrite=True)
    return path, cfg, model


@pytest.mark.parametrize("overrides", [
    dict(tie_word_embeddings=False),
    dict(tie_word_embeddings=True, attention_bias=True),
])
def test_load_of_save_is_identical(tmp_path, overrides):
    cfg, model = random_model(seed=1, **overrides)
    jtree.hf.save(model, cfg, tmp_path)
    loaded_cfg, loaded = jtree.hf.load(tmp_path, tiny_runtime())
    assert loaded_cfg == cfg
    assert_same_params(loaded, model)
    names = set(load_file(str(tmp_path / SINGLE_FILE)))
    assert ("lm_head.weight" in names) == (not cfg.tie_word_embeddings)
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == cfg.attention_bias
    # HF layout: torch Linear weight is [out, in].
    q = load_file(str(tmp_path / SINGLE_FILE))["model.layers.1.self_attn.q_proj.weight"]
    kernel = np.asarray(model.model.layers[1].self_attn.q_proj.kernel[...])
    np.testing.assert_array_equal(q, kernel.T)


def test_bfloat16_round_trip_is_identical(tmp_path):
    cfg, model = random_model(seed=2, runtime=dict(param_dtype="bfloat16", dtype="bfloat16"))
    jtree.hf.save(model, cfg, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded_cfg, loaded = jtree.hf.load(tmp_path,
                                       tiny_runtime(dtype="bfloat16", param_dtype="bfloat16"))
    assert loaded_cfg == cfg
    assert_same_params(loaded, model)


def test_dtype_casting_on_load_and_save(saved, tmp_path):
    path, cfg, model = saved
    bf_cfg, bf = jtree.hf.load(path, RuntimeConfig(param_dtype="bfloat16", dtype="float32"))
    assert (bf.runtime.param_dtype, bf.runtime.dtype) == ("bfloat16", "float32")
    for k, v in param_arrays(bf).items():
        assert v.dtype == jnp.bfloat16, k
        np.testing.assert_array_equal(v, param_arrays(model)[k].astype(jnp.bfloat16))
    jtree.hf.save(model, cfg, tmp_path, dtype="bfloat16")
    stored = load_file(str(tmp_path / SINGLE_FILE))
    assert {str(a.dtype) for a in stored.values()} == {"bfloat16"}


def test_sharded_save_writes_an_index_and_loads(saved, tmp_path):
    path, cfg, model = saved
    jtree.hf.save(model, cfg, tmp_path, max_shard_size=20_000)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and not (tmp_path / SINGLE_FILE).exists()
    assert all((tmp_path / f).exists() for f in files)
    _, loaded = jtree.hf.load(tmp_path, tiny_runtime())
    assert_same_params(loaded, model)


def test_index_listing_a_tensor_its_file_lacks_is_named(saved, tmp_path):
    path, cfg, model = saved
    jtree.hf.save(model, cfg, tmp_path, max_shard_size=20_000)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    index["weight_map"]["model.norm.weight"] = index["weight_map"]["lm_head.weight"]
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="model.norm.weight"):
        jtree.hf.load(tmp_path)


def test_missing_tensor_is_named(saved, tmp_path):
    bad = copy_checkpoint(saved[0], tmp_path,
                          edit_tensors=lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError,
                       match=r"missing tensor\(s\) 'model.layers.1.mlp.up_proj.weight'"):
        jtree.hf.load(bad)


def test_changed_shape_is_named(saved, tmp_path):
    def shrink(t):
        name = "model.layers.0.self_attn.k_proj.weight"
        t[name] = t[name][:8]

    bad = copy_checkpoint(saved[0], tmp_path, edit_tensors=shrink)
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.k_proj.weight' has shape "
                                         r"\(8, 32\), config.json implies \(16, 32\)"):
        jtree.hf.load(bad)


def test_extra_tensor_is_named(saved, tmp_path):
    def add(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)

    bad = copy_checkpoint(saved[0], tmp_path, edit_tensors=add)
    with pytest.raises(ValueError, match="unexpected tensor.*rotary_emb.inv_freq"):
        jtree.hf.load(bad)


def test_config_that_disagrees_with_the_tensors_names_one(saved, tmp_path):
    bad = copy_checkpoint(saved[0], tmp_path, edit_config=lambda c: c.update(num_hidden_layers=1))
    with pytest.raises(ValueError, match="unexpected tensor.*model.layers.1"):
        jtree.hf.load(bad)


def test_quantized_tensor_is_refused_by_name(saved, tmp_path):
    def quantize(t):
        t["model.norm.weight"] = t["model.norm.weight"].astype(np.int8)

    bad = copy_checkpoint(saved[0], tmp_path, edit_tensors=quantize)
    with pytest.raises(ValueError, match="'model.norm.weight' has dtype I8"):
        jtree.hf.load(bad)


def test_tied_checkpoint_may_store_an_exact_copy_of_the_head(tmp_path):
    cfg, model = random_model(seed=4, tie_word_embeddings=True)
    jtree.hf.save(model, cfg, tmp_path / "a")

    def add_head(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()

    copy_checkpoint(tmp_path / "a", tmp_path / "b", edit_tensors=add_head)
    _, loaded = jtree.hf.load(tmp_path / "b", tiny_runtime())
    assert_same_params(loaded, model)

    def add_other_head(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"] + 1

    copy_checkpoint(tmp_path / "a", tmp_path / "c", edit_tensors=add_other_head)
    with pytest.raises(ValueError,
                       match="'lm_head.weight' differs from 'model.embed_tokens.weight'"):
        jtree.hf.load(tmp_path / "c")


@pytest.mark.parametrize("edit, field", [
    (dict(architectures=["LlamaForCausalLM"]), "LlamaForCausalLM"),
    (dict(model_type="llama"), "model_type"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling.rope_type"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), "rope_parameters.rope_type"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 5.0}), "conflicting rope_theta"),
    (dict(use_sliding_window=True, sliding_window=16), "use_sliding_window"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(attention_dropout=0.1), "attention_dropout"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    (dict(hidden_size=None), "hidden_size"),
])
def test_unsupported_config_is_refused_naming_the_field(saved, tmp_path, edit, field):
    bad = copy_checkpoint(saved[0], tmp_path, edit_config=lambda c: c.update(edit))
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        jtree.hf.load(bad)


def test_transformers_5_rope_parameters_and_inert_fields_are_read(saved, tmp_path):
    path, cfg, model = saved

    def v5_style(c):
        theta = c.pop("rope_theta")
        c.pop("rope_scaling")
        c.update(rope_parameters={"rope_type": "default", "rope_theta": theta},
                 layer_types=["full_attention"] * c["num_hidden_layers"], sliding_window=4096,
                 max_window_layers=28, dtype="float32", bos_token_id=1, eos_token_id=[2, 3])

    _, loaded = jtree.hf.load(copy_checkpoint(path, tmp_path, edit_config=v5_style))
    assert_same_params(loaded, model)


def test_save_refuses_to_mix_into_an_existing_checkpoint(saved, tmp_path):
    path, cfg, model = saved
    jtree.hf.save(model, cfg, tmp_path, max_shard_size=20_000)
    with pytest.raises(ValueError, match="overwrite=True"):
        jtree.hf.save(model, cfg, tmp_path)
    jtree.hf.save(model, cfg, tmp_path, overwrite=True)  # removes the old shards and index
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", SINGLE_FILE]


def test_save_carries_tokenizer_files_and_token_ids(saved, tmp_path):
    path, cfg, model = saved
    source = copy_checkpoint(path, tmp_path / "src",
                             edit_config=lambda c: c.update(bos_token_id=5, eos_token_id=[6, 7]))
    (source / "tokenizer.json").write_text('{"version": "1.0"}')
    jtree.hf.save(model, cfg, tmp_path / "out", copy_from=source)
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"version": "1.0"}'
    out_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (out_cfg["bos_token_id"], out_cfg["eos_token_id"]) == (5, [6, 7])


def test_save_checks_model_against_config(saved, tmp_path):
    _, cfg, model = saved
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.down_proj.kernel' has shape "
                                         r"\(64, 32\), config implies \(48, 32\)"):
        jtree.hf.save(model, dataclasses.replace(cfg, intermediate_size=48), tmp_path)


def test_config_json_carries_no_runtime_field(tmp_path):
    """How a model runs is not part of the checkpoint: a runtime key in config.json is refused as
    any unknown field, and save writes none."""
    cfg, model = random_model(seed=4)
    jtree.hf.save(model, cfg, tmp_path / "a")
    written = json.loads((tmp_path / "a" / "config.json").read_text())
    assert not {"attention_impl", "remat", "param_dtype"} & set(written)
    bad = copy_checkpoint(tmp_path / "a", tmp_path / "b",
                          edit_config=lambda c: c.update(attention_impl="reference"))
    with pytest.raises(ValueError, match="field 'attention_impl' is not supported"):
        jtree.hf.load(bad)
