"""DeepSeek-V3 against transformers (a tiny random `DeepseekV3ForCausalLM`, CPU, float32).

The checkpoint is written by transformers itself with every parameter random (norms of the query
and latent bottlenecks too; `tests.hf_path_checks`) and the router's selection bias
(`e_score_correction_bias`, a buffer the writer leaves at zero) set random on the scale of the
sigmoid scores, so it changes which experts are chosen. Its shape: 3 layers, the first dense
(`first_k_dense_replace` 1), then DeepSeekMoE with 8 routed experts in 4 groups of which 2 are
eligible, top 3, 2 shared experts; MLA with a query bottleneck, q/k heads of 16 + 8 (RoPE)
features and value heads of 12 (Dv != Dk), interleaved RoPE, YaRN with `mscale` and
`mscale_all_dim` both given and different (the cos/sin factor and the softmax correction both
act). The checks: tree log-probs and PPO gradients per path within 1e-4, save ->
`from_pretrained` bit-exact, load of save identical, the variant without the query bottleneck and
with rotate-half RoPE, and refusals. The Hub's MTP layer (decoder layer `num_hidden_layers`),
synthesized: read into jtree's MTP modules and written back, its states against transformers'
MTP drafter per path.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jtree.hf  # noqa: E402
from jtree.config.architectures import DeepseekV3Config, YarnRopeScaling  # noqa: E402
from jtree.hf.safetensors_io import SINGLE_FILE
from jtree.layout.linearize import linearize, unlinearize
from jtree.models import CausalLM
from tests.hf_path_checks import (  # noqa: E402
    assert_from_pretrained_gives_the_same_model,
    assert_ppo_gradients_equal_per_path,
    assert_tree_logprobs_equal_per_path,
    compare_trees,
    write_deepseek_checkpoint,
)
from tests.hf_util import (  # noqa: E402
    DEEPSEEK_MTP_EXTRA,
    assert_same_params,
    copy_checkpoint,
    param_arrays,
    with_deepseek_mtp_layer,
)
from tests.models_util import tiny_runtime  # noqa: E402
from tests.torch_util import VOCAB  # noqa: E402

YARN = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.7,
        "original_max_position_embeddings": 16}


def deepseek_config(**overrides):
    """The tiny transformers `DeepseekV3Config` of these tests (module docstring)."""
    return transformers.DeepseekV3Config(**dict(dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2,
        n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24,
        qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=4, topk_group=2,
        num_experts_per_tok=3, first_k_dense_replace=1, norm_topk_prob=True,
        max_position_embeddings=64, rope_parameters=YARN, tie_word_embeddings=False),
        **overrides))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, transformers model, jtree config, jtree model)."""
    path = tmp_path_factory.mktemp("hf_deepseek_v3")
    ref = write_deepseek_checkpoint(deepseek_config(), path)
    config, model = jtree.hf.load(path, tiny_runtime())
    return path, ref, config, model


def test_load_reads_the_architecture_fields(checkpoint):
    _, ref, config, model = checkpoint
    assert type(config) is DeepseekV3Config and model.config == config
    assert [(k.mixer, k.ffn) for k in config.decoder().layers] == [
        ("mla", "mlp"), ("mla", "deepseek_moe"), ("mla", "deepseek_moe")]
    assert config.rope_scaling == YarnRopeScaling(
        factor=4.0, original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=0.7)
    assert config.softmax_scale == pytest.approx(ref.model.layers[0].self_attn.scaling, rel=1e-12)
    assert config.softmax_scale != config.qk_head_dim ** -0.5
    mlp = model.model.layers[1].mlp
    np.testing.assert_array_equal(
        np.asarray(mlp.gate.e_score_correction_bias[...]),
        ref.model.layers[1].mlp.gate.e_score_correction_bias.numpy())
    assert np.abs(np.asarray(mlp.gate.e_score_correction_bias[...])).min() > 0
    assert mlp.shared_expert.gate_proj.kernel.shape == (32, 32)  # 2 shared x 16
    assert mlp.shared_expert_gate is None


@pytest.mark.parametrize("impl", ["reference", "xla", "auto"])
def test_tree_logprobs_equal_transformers_per_path(checkpoint, impl):
    """With v heads narrower than q/k heads in each attention implementation this host runs
    (`auto`: the one it picks here, the C++ `cpu` kernel or `xla`)."""
    path, ref, _, _ = checkpoint
    _, model = jtree.hf.load(path, tiny_runtime(attention_impl=impl))
    assert_tree_logprobs_equal_per_path(ref, model)


def test_tree_ppo_gradient_equals_transformers_per_path(checkpoint):
    """Every tensor's gradient (the selection biases' are zero on both sides: they only order
    the experts) within 1e-4 of the per-path PPO losses in torch."""
    _, ref, config, model = checkpoint
    assert_ppo_gradients_equal_per_path(ref, config, model)


def test_without_query_bottleneck_and_with_rotate_half_rope(tmp_path):
    """q_lora_rank null (one q_proj) and rope_interleave false, plain RoPE."""
    ref = write_deepseek_checkpoint(deepseek_config(
        q_lora_rank=None, rope_interleave=False, num_hidden_layers=2,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0}), tmp_path)
    config, model = jtree.hf.load(tmp_path, tiny_runtime())
    assert config.q_lora_rank is None and not config.rope_interleave
    assert model.model.layers[0].self_attn.q_a_proj is None
    assert_tree_logprobs_equal_per_path(ref, model)


def test_save_then_from_pretrained_gives_the_same_model(checkpoint, tmp_path):
    _, ref, config, model = checkpoint
    jtree.hf.save(model, config, tmp_path)
    assert_from_pretrained_gives_the_same_model(ref, tmp_path, (
        "rope_parameters", "tie_word_embeddings", "num_key_value_heads", "rms_norm_eps",
        "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group",
        "routed_scaling_factor", "first_k_dense_replace", "q_lora_rank", "kv_lora_rank",
        "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "rope_interleave",
        "norm_topk_prob"))
    again_config, again = jtree.hf.load(tmp_path, tiny_runtime())
    assert again_config == config
    assert_same_params(again, model)


def test_router_stays_float32_in_bfloat16_runs_and_saves(checkpoint, tmp_path):
    """transformers keeps DeepSeek's router weight and selection bias in float32 whatever the
    model's dtype: so does jtree, in a bfloat16 run and in a bfloat16 save (a bf16 bias would
    reorder near-tied experts)."""
    from safetensors import safe_open  # noqa: PLC0415

    path, _, _, _ = checkpoint
    config, model = jtree.hf.load(path, tiny_runtime(param_dtype="bfloat16"))
    arrays = param_arrays(model)
    for name, value in arrays.items():
        router = name.endswith(("mlp.gate.weight", "mlp.gate.e_score_correction_bias"))
        assert value.dtype == (np.float32 if router else jnp.bfloat16), name
    jtree.hf.save(model, config, tmp_path, dtype="bfloat16")
    with safe_open(str(next(tmp_path.glob("*.safetensors"))), "np") as f:
        dtypes = {k: str(f.get_slice(k).get_dtype()) for k in f.keys()}
    assert dtypes["model.layers.1.mlp.gate.e_score_correction_bias"] == "F32"
    assert dtypes["model.layers.1.mlp.gate.weight"] == "F32"
    assert dtypes["model.layers.1.mlp.experts.0.up_proj.weight"] == "BF16"


def test_scanned_load_saves_back_bit_identical(checkpoint, tmp_path):
    """Into stacked layers (the dense layer alone, the two MoE layers one scanned block) and
    back: the same files as the unscanned save."""
    _, _, config, model = checkpoint
    jtree.hf.save(model, config, tmp_path / "a")
    _, scanned = jtree.hf.load(tmp_path / "a", tiny_runtime(scan_layers=True))
    assert "model.blocks.1.0.mlp.gate.e_score_correction_bias" in param_arrays(scanned)
    jtree.hf.save(scanned, config, tmp_path / "b")
    assert ({f.name: f.read_bytes() for f in (tmp_path / "b").iterdir()}
            == {f.name: f.read_bytes() for f in (tmp_path / "a").iterdir()})


# ---------------------------------------------------------------- the Hub's MTP layer
# The copies the MTP layer holds (name under its prefix -> the main tensor they equal).
MTP_COPIES = {"embed_tokens.weight": "model.embed_tokens.weight",
              "shared_head.head.weight": "lm_head.weight"}


@pytest.fixture(scope="module")
def mtp_checkpoint(checkpoint, tmp_path_factory):
    """The checkpoint with a random Hub-form MTP layer (`tests.hf_util.with_deepseek_mtp_layer`),
    and it loaded with MTP modules: (directory, its tensors, the layer's prefix, config, model)."""
    prefix = []
    path = copy_checkpoint(checkpoint[0], tmp_path_factory.mktemp("deepseek_v3_mtp"),
                           edit_tensors=lambda t: prefix.append(with_deepseek_mtp_layer(t, 32)))
    config, model = jtree.hf.load(path, tiny_runtime(), mtp_depth=1)
    return path, load_file(str(path / SINGLE_FILE)), prefix[0], config, model


def test_mtp_layer_loads_where_its_names_say(checkpoint, mtp_checkpoint, tmp_path):
    """mtp_depth=1 reads layer `num_hidden_layers` (3 here, 61 on the Hub): enorm, hnorm, eh_proj
    and shared_head.norm into the embedding's norm, the hidden state's norm, the fc and the
    output norm; its decoder tensors into `mtp.layers.0` exactly as the same tensors placed at
    main layer 2 (also MoE) load into `model.layers.2` (the main mapping, which the tests above
    hold against transformers, is the oracle); the main model as without MTP."""
    path, tensors, prefix, _, model = mtp_checkpoint
    assert prefix == "model.layers.3."
    mtp = model.mtp
    np.testing.assert_array_equal(np.asarray(mtp.fc.kernel[...]),
                                  tensors[prefix + "eh_proj.weight"].T)
    for hf, module in DEEPSEEK_MTP_EXTRA.items():
        if module != "fc":
            np.testing.assert_array_equal(np.asarray(getattr(mtp, module).weight[...]),
                                          tensors[prefix + hf], err_msg=hf)

    def as_main_layer(t):
        for name in [n for n in t if n.startswith(prefix)]:
            value, rest = t.pop(name), name[len(prefix):]
            if rest not in DEEPSEEK_MTP_EXTRA and rest not in MTP_COPIES:
                t["model.layers.2." + rest] = value

    _, main = jtree.hf.load(copy_checkpoint(path, tmp_path, edit_tensors=as_main_layer),
                            tiny_runtime())
    want, got = param_arrays(main.model.layers[2]), param_arrays(mtp.layers[0])
    assert got.keys() == want.keys() and "mlp.experts.gate_up_proj" in got
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    main_params = {k: v for k, v in param_arrays(model).items() if not k.startswith("mtp.")}
    assert main_params.keys() == param_arrays(checkpoint[3]).keys()
    for name, value in param_arrays(checkpoint[3]).items():
        np.testing.assert_array_equal(main_params[name], value, err_msg=name)


def test_mtp_layer_saves_back_bit_exact(mtp_checkpoint, tmp_path):
    """load -> save writes every tensor of the checkpoint, the MTP layer's copies of the
    embedding and head included, bit for bit, and config.json counts one MTP layer; a scanned
    model (the shipped 671B config scans) loads and saves the same files."""
    path, tensors, _, config, model = mtp_checkpoint
    jtree.hf.save(model, config, tmp_path / "a")
    saved = load_file(str(tmp_path / "a" / SINGLE_FILE))
    assert saved.keys() == tensors.keys()
    for name, value in tensors.items():
        np.testing.assert_array_equal(saved[name], value, err_msg=name)
    assert json.loads((tmp_path / "a" / "config.json").read_text())["num_mtp_layers"] == 1
    assert jtree.hf.mtp_depth_in(tmp_path / "a") == 1
    _, scanned = jtree.hf.load(path, tiny_runtime(scan_layers=True), mtp_depth=1)
    jtree.hf.save(scanned, config, tmp_path / "b")
    assert ({f.name: f.read_bytes() for f in (tmp_path / "b").iterdir()}
            == {f.name: f.read_bytes() for f in (tmp_path / "a").iterdir()})


def test_mtp_layer_skipped_without_mtp_modules(checkpoint, mtp_checkpoint, tmp_path):
    """Without MTP modules the layer at the config's index is not read, as in transformers; a
    layer at the Hub's index 61 is no MTP layer of a 3-layer model, and is refused."""
    path, _, _, config, _ = mtp_checkpoint
    _, loaded = jtree.hf.load(path, tiny_runtime())
    assert loaded.mtp is None
    assert_same_params(loaded, checkpoint[3])
    assert jtree.hf.carries_mtp(config)
    assert (jtree.hf.mtp_depth_in(path), jtree.hf.mtp_depth_in(checkpoint[0])) == (1, 0)
    stray = copy_checkpoint(checkpoint[0], tmp_path, edit_tensors=lambda t: t.update(
        {"model.layers.61.enorm.weight": np.ones(32, np.float32)}))
    with pytest.raises(ValueError, match="unexpected tensor.*'model.layers.61.enorm.weight'"):
        jtree.hf.load(stray, tiny_runtime())


def test_mtp_layer_of_a_tied_model_round_trips(mtp_checkpoint, tmp_path):
    """With `tie_word_embeddings` the head is the embedding, and so is the MTP layer's copy of
    the head: it is checked against, and saved from, the embedding (no `lm_head.weight`)."""
    path, _, prefix, _, _ = mtp_checkpoint

    def tie(t):
        del t["lm_head.weight"]
        t[prefix + "shared_head.head.weight"] = t["model.embed_tokens.weight"].copy()

    tied = copy_checkpoint(path, tmp_path / "tied", edit_tensors=tie,
                           edit_config=lambda c: c.update(tie_word_embeddings=True))
    tensors = load_file(str(tied / SINGLE_FILE))
    config, model = jtree.hf.load(tied, tiny_runtime(), mtp_depth=1)
    jtree.hf.save(model, config, tmp_path / "saved")
    saved = load_file(str(tmp_path / "saved" / SINGLE_FILE))
    assert saved.keys() == tensors.keys()
    for name, value in tensors.items():
        np.testing.assert_array_equal(saved[name], value, err_msg=name)


@pytest.mark.parametrize("copy", sorted(MTP_COPIES))
def test_mtp_layer_copy_that_differs_is_refused(mtp_checkpoint, tmp_path, copy):
    """The MTP layer's embedding and head must be the main ones (jtree's MTP modules use the
    main model's); without MTP modules the layer is not read at all."""
    path, _, prefix, _, _ = mtp_checkpoint

    def change(t):
        t[prefix + copy] = t[prefix + copy] + 1.0

    bad = copy_checkpoint(path, tmp_path, edit_tensors=change)
    with pytest.raises(ValueError, match=rf"'{prefix + copy}' differs from '{MTP_COPIES[copy]}'"):
        jtree.hf.load(bad, tiny_runtime(), mtp_depth=1)
    assert jtree.hf.load(bad, tiny_runtime())[1].mtp is None


def test_mtp_layer_computes_what_transformers_mtp_computes(tmp_path):
    """transformers 5's MTP drafter (`MtpModel`: [enorm(emb); hnorm(h)] -> eh_proj -> decoder
    layer -> post_norm, which it reads from DeepSeek's `shared_head.norm`) with a random layer,
    written into the checkpoint under DeepSeek's names: jtree's depth-1 MTP state at each tree
    token j (from j's embedding and the main state at j's parent) equals transformers' at
    position pos(j) - 1 of every path through j, within 1e-4, on branching trees. Every layer
    is MoE (`first_k_dense_replace` 0): transformers builds its MTP layer as decoder layer 0,
    dense otherwise, where DeepSeek's layer 61 is MoE."""
    from transformers.modeling_layers import MtpModel

    ref = write_deepseek_checkpoint(deepseek_config(first_k_dense_replace=0,
                                                    num_hidden_layers=2), tmp_path)
    drafter = MtpModel(ref, 1).eval()
    layer = drafter.layers[0]
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if name.endswith("norm.weight") else 0.0))
        bias = layer.mtp_block.mlp.gate.e_score_correction_bias
        bias.copy_(torch.randn_like(bias) * 0.3)
    tensors = load_file(str(tmp_path / SINGLE_FILE))
    for name, value in layer.state_dict().items():  # experts fused, as transformers 5 holds them
        hf = name.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
        tensors["model.layers.2." + hf] = value.numpy()
    save_file(tensors, str(tmp_path / SINGLE_FILE), metadata={"format": "pt"})

    _, model = jtree.hf.load(tmp_path, tiny_runtime(), mtp_depth=1)
    trees = compare_trees()
    batch = linearize(trees, 160)
    graphdef, params = nnx.split(model, nnx.Param)
    states = jax.jit(lambda p: nnx.merge(graphdef, p)(batch.inputs).mtp[0])(params)
    for tree, ours in zip(trees, unlinearize(batch, np.asarray(states))):
        for p in range(tree.n_paths):
            ids = torch.as_tensor(np.asarray(tree.path_tokens(p), np.int64))[None]
            with torch.no_grad():
                hidden = ref.model(input_ids=ids).last_hidden_state
                want = drafter.forward_layer(0, hidden[:, :-1], torch.arange(ids.shape[1] - 1)[None],
                                             None, input_ids=ids[:, 1:])[0].numpy()
            np.testing.assert_allclose(ours[p][1:], want, atol=1e-4, rtol=0)


def test_mtp_depth_two_is_refused(mtp_checkpoint, tmp_path):
    """DeepSeek's depths each have their own eh_proj and norms; jtree's share one: depth 2 is
    neither read nor written."""
    path, _, _, config, _ = mtp_checkpoint
    with pytest.raises(ValueError, match="mtp_depth: 2 > 1.*own fc"):
        jtree.hf.load(path, tiny_runtime(), mtp_depth=2)
    deeper = nnx.eval_shape(lambda: CausalLM(config, tiny_runtime(), rngs=nnx.Rngs(0),
                                              mtp_depth=2))  # refused before any weight is read
    with pytest.raises(ValueError, match="mtp_depth: 2 > 1"):
        jtree.hf.save(deeper, config, tmp_path)


@pytest.mark.parametrize("edit, match", [
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(n_group=3), "n_group"),
    (dict(topk_method="greedy"), "topk_method"),
    (dict(head_dim=16), "head_dim"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_type"),
])
def test_refuses_what_it_does_not_implement(checkpoint, tmp_path, edit, match):
    path = copy_checkpoint(checkpoint[0], tmp_path, edit_config=lambda c: c.update(edit))
    with pytest.raises(ValueError, match=match):
        jtree.hf.load(path, tiny_runtime())


def test_config_refuses_bad_routing_shapes():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        DeepseekV3Config(num_experts=8, n_group=4, topk_group=1, num_experts_per_tok=3)
    with pytest.raises(ValueError, match="topk_group"):
        DeepseekV3Config(topk_group=5)
    with pytest.raises(ValueError, match="n_group"):
        DeepseekV3Config(num_experts=8, n_group=8)
