"""jtree.hf for Qwen3-MoE and Qwen3-Next against transformers (tiny random models, CPU, float32).

One checkpoint per architecture, written by transformers itself (experts one tensor per expert, as
on the Hub), is shared by every test of the module. `jtree compare-torch` runs once per
architecture on branching trees plus single sequences, with the router load-balancing loss on:
its report holds the logits, log-prob and per-tensor gradient differences the acceptance asks for,
and its PyTorch side is transformers run path by path (see tests/hf/test_hf_torch.py for the same
reference checked against hand-written transformers calls).
"""

import json
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jtree.hf  # noqa: E402
from jtree.config.architectures import Qwen3MoeConfig, Qwen3NextConfig
from jtree.config.runtime import RuntimeConfig
from jtree.hf.safetensors_io import INDEX_FILE, SINGLE_FILE  # noqa: E402
from jtree.models import CausalLM
from jtree.trees.jsonl import write_sequence_groups  # noqa: E402
from jtree.trees.tree import TrajectoryTree  # noqa: E402
from tests.hf_util import assert_same_params, copy_checkpoint, param_arrays  # noqa: E402
from tests.models_util import tiny_runtime  # noqa: E402
from tests.run_util import WORKTREE, default_codegen_env  # noqa: E402
from tests.strategies import one_row_forests  # noqa: E402
from tests.torch_util import TOL, VOCAB, torch_logits  # noqa: E402

COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1],
              output_router_logits=True, router_aux_loss_coef=0.1)
CONFIGS = {
    # Layers: moe, mlp, moe; untied head, attention biases, default routing (no renormalization).
    "moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON, tie_word_embeddings=False, attention_bias=True, norm_topk_prob=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # Layers: GDN + moe, full attention + mlp, GDN + moe; tied head, half-rotary RoPE.
    "next": lambda: transformers.Qwen3NextConfig(
        **COMMON, tie_word_embeddings=True, norm_topk_prob=True,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=6,
        linear_num_key_heads=2, linear_num_value_heads=4, shared_expert_intermediate_size=24,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5}),
}
CONFIG_CLASS = {"moe": Qwen3MoeConfig, "next": Qwen3NextConfig}
EXPERT = "model.layers.2.mlp.experts"


def write_moe_checkpoint(kind, path, **save_kwargs):
    """Save transformers' MoE (`kind` "moe") or Qwen3-Next ("next") model of `CONFIGS` with every
    parameter random (zero-initialized norms and the offset RMSNorm weights too), so a swapped,
    transposed or misnamed tensor cannot hide; returns the model (eval mode)."""
    model = getattr(transformers, {"moe": "Qwen3MoeForCausalLM",
                                   "next": "Qwen3NextForCausalLM"}[kind])(CONFIGS[kind]())
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if name.endswith("linear_attn.norm.weight")
                                                 else 0.0))
    model.save_pretrained(path, **save_kwargs)
    return model.eval()


def compare_trees():
    """Branching trees (several levels, siblings, paths ending inside, duplicates) and two single
    sequences long enough to cross several GDN chunks."""
    rng = np.random.default_rng(1)
    singles = [TrajectoryTree.from_sequences([rng.integers(0, VOCAB, n)]) for n in (23, 9)]
    return one_row_forests(VOCAB) + singles


@pytest.fixture(scope="module", params=["moe", "next"])
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def checkpoint(kind, tmp_path_factory):
    """(directory, transformers model, jtree config, jtree model) of one architecture."""
    path = tmp_path_factory.mktemp(f"hf_{kind}")
    ref = write_moe_checkpoint(kind, path)
    config, model = jtree.hf.load(path, tiny_runtime())
    return path, ref, config, model


@pytest.fixture(scope="module")
def report(checkpoint, tmp_path_factory):
    """`jtree compare-torch` on the checkpoint: (exit code, JSON report, printed text)."""
    path = checkpoint[0]
    work = tmp_path_factory.mktemp("compare")
    write_sequence_groups(work / "d.jsonl", compare_trees())
    out = work / "r.json"
    # Chunks of 4 tokens: the delta-rule state crosses chunk boundaries inside nodes. The command
    # runs as a user runs it, in its own process at XLA's default code generation: its default
    # tolerance (1e-4) is for that, and Qwen3-Next's largest relative gradient difference moves
    # with XLA:CPU's backend level (1.4e-5 at level 1, 6.5e-5 at the tests' level 0,
    # `tests.run_util.CODEGEN_XLA_FLAGS`, AMD EPYC Zen 5).
    proc = subprocess.run(
        [sys.executable, "-m", "jtree.cli", "compare-torch", "--hf-dir", str(path), "--data",
         str(work / "d.jsonl"), "--attention-impl", "reference", "--gdn-chunk-size", "4",
         "--json", str(out)], cwd=WORKTREE, env=default_codegen_env(), capture_output=True,
        text=True, timeout=600)
    return proc.returncode, json.loads(out.read_text()), proc.stdout + proc.stderr


def test_load_gives_the_architecture_model_and_config(kind, checkpoint):
    _, ref, config, model = checkpoint
    assert type(model) is CausalLM and type(model.config) is CONFIG_CLASS[kind]
    hf = ref.config
    assert (config.num_experts, config.num_experts_per_tok) == (4, 2)
    assert config.mlp_only_layers == (1,) and config.output_router_logits
    assert config.router_aux_loss_coef == hf.router_aux_loss_coef
    assert config.tie_word_embeddings == hf.tie_word_embeddings
    if kind == "next":
        assert config.layer_types == tuple(hf.layer_types)
        assert config.partial_rotary_factor == 0.5 and config.rotary_dim == 4


def test_compare_torch_logits_logprobs_and_gradients_within_tolerance(kind, report):
    code, r, text = report
    assert code == 0, text
    assert r["failures"] == []
    assert r["paths"] == sum(t.n_paths for t in compare_trees())
    assert 0 < r["max_abs_logits"] <= TOL  # every position of every path, single sequences too
    assert r["max_abs_logprobs"] <= TOL  # tree log-probs vs each path run alone in transformers
    assert r["max_rel_grad"] <= TOL  # per tensor, tree loss vs per-path loss (+ aux loss)
    assert r["tree_loss"] == pytest.approx(r["path_loss"], rel=1e-5)


def test_router_aux_loss_of_the_tree_equals_hf_on_the_batch_of_paths(report):
    """Tree tokens weighted by their path count give HF's load-balancing loss over all paths."""
    _, r, text = report
    assert r["tree_aux_loss"] > 0.01
    assert r["tree_aux_loss"] == pytest.approx(r["path_aux_loss"], rel=1e-5)
    assert "router aux loss" in text


def test_compare_torch_reports_every_block_type(kind, report):
    _, r, text = report
    groups = r["groups"]
    expected = ({"full_attention": 3, "moe": 2, "mlp": 1} if kind == "moe" else
                {"linear_attention": 2, "full_attention": 1, "moe": 2, "mlp": 1})
    assert {g: groups[g]["layers"] for g in expected} == expected
    for name in expected:
        assert groups[name]["tensors"] > 0, name
        assert groups[name]["max_abs_output"] <= TOL and groups[name]["max_rel_grad"] <= TOL
        assert name in text
    assert groups["moe"]["worst_tensor"].startswith("model.layers.")
    assert "overall" in text


def test_save_then_from_pretrained_gives_the_same_model(kind, checkpoint, tmp_path):
    path, ref, config, model = checkpoint
    jtree.hf.save(model, config, tmp_path)
    names = set(load_file(str(tmp_path / SINGLE_FILE)))
    assert f"{EXPERT}.3.up_proj.weight" in names and f"{EXPERT}.gate_up_proj" not in names
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(back) is type(ref)
    for key in ("num_experts", "layer_types", "mlp_only_layers", "rope_parameters",
                "output_router_logits", "tie_word_embeddings", "norm_topk_prob"):
        assert getattr(back.config, key, None) == getattr(ref.config, key, None), key
    expected = ref.state_dict()
    for name, value in back.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), expected[name].numpy(), err_msg=name)
    for seq in (np.arange(1, 30) % VOCAB, np.array([5, 3, 60, 2])):
        np.testing.assert_allclose(torch_logits(back, seq), torch_logits(ref, seq), atol=1e-6,
                                   rtol=0)


def test_load_of_save_is_identical(checkpoint, tmp_path):
    _, _, config, model = checkpoint
    jtree.hf.save(model, config, tmp_path, max_shard_size=30_000)  # several shards + index
    assert len(set(json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"].values())) >= 2
    loaded_config, loaded = jtree.hf.load(tmp_path, tiny_runtime())
    assert loaded_config == config
    assert_same_params(loaded, model)


def test_transformers_sharded_checkpoint_loads(kind, checkpoint, tmp_path):
    write_moe_checkpoint(kind, tmp_path, max_shard_size="30KB")
    assert len(list(tmp_path.glob("*.safetensors"))) >= 2 and (tmp_path / INDEX_FILE).exists()
    _, sharded = jtree.hf.load(tmp_path, tiny_runtime())
    assert_same_params(sharded, checkpoint[3])


def test_fused_expert_layout_loads_the_same_model(checkpoint, tmp_path):
    """transformers 5 holds experts fused (`experts.gate_up_proj` [E, 2I, H]); a checkpoint of
    its state dict loads into the same jtree model as the per-expert Hub layout."""
    path, ref, _, model = checkpoint
    state = {k: v.detach().numpy().copy() for k, v in ref.state_dict().items()}
    assert f"{EXPERT}.gate_up_proj" in state and f"{EXPERT}.0.up_proj.weight" not in state
    if ref.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    copy_checkpoint(path, tmp_path, edit_tensors=lambda t: (t.clear(), t.update(state)))
    _, fused = jtree.hf.load(tmp_path, tiny_runtime())
    assert_same_params(fused, model)
    # The expert rows really are (gate; up) of each expert, in order.
    hub = load_file(str(path / SINGLE_FILE))
    gate_up = param_arrays(model)[f"{EXPERT}.gate_up_proj"]
    np.testing.assert_array_equal(gate_up[3, 16:], hub[f"{EXPERT}.3.up_proj.weight"])
    np.testing.assert_array_equal(param_arrays(model)[f"{EXPERT}.down_proj"][1],
                                  hub[f"{EXPERT}.1.down_proj.weight"])


def test_to_hf_tensors_gives_either_layout(checkpoint):
    _, ref, config, model = checkpoint
    hub = jtree.hf.to_hf_tensors(model, config)
    fused = jtree.hf.to_hf_tensors(model, config, names=frozenset(ref.state_dict()))
    assert f"{EXPERT}.0.gate_proj.weight" in hub and f"{EXPERT}.gate_up_proj" in fused
    np.testing.assert_array_equal(fused[f"{EXPERT}.gate_up_proj"][0, :16],
                                  hub[f"{EXPERT}.0.gate_proj.weight"])
    with pytest.raises(ValueError, match="no layout of parameter"):
        jtree.hf.to_hf_tensors(model, config, names=frozenset({"model.norm.weight"}))


@pytest.mark.parametrize("name, edit, message", [
    (f"{EXPERT}.2.up_proj.weight", lambda t, n: t.pop(n), r"missing tensor\(s\) '{name}'"),
    (f"{EXPERT}.1.down_proj.weight", lambda t, n: t.update({n: t[n][:, :8]}),
     r"'{name}' has shape \(32, 8\), config.json implies \(32, 16\)"),
    ("model.layers.2.mlp.gate.weight", lambda t, n: t.pop(n), r"missing tensor\(s\) '{name}'"),
    # Both layouts at once: the fused copy is not used, and named.
    (f"{EXPERT}.down_proj",
     lambda t, n: t.update({n: np.stack([t[f"{EXPERT}.{e}.down_proj.weight"] for e in range(4)])}),
     r"unexpected tensor\(s\) '{name}'"),
])
def test_bad_expert_tensors_are_named(checkpoint, tmp_path, name, edit, message):
    bad = copy_checkpoint(checkpoint[0], tmp_path, edit_tensors=lambda t: edit(t, name))
    with pytest.raises(ValueError, match=message.format(name=name.replace(".", r"\."))):
        jtree.hf.load(bad)


def test_bad_fused_expert_tensor_is_named(checkpoint, tmp_path):
    path, ref, _, _ = checkpoint
    state = {k: v.detach().numpy().copy() for k, v in ref.state_dict().items()}
    state[f"{EXPERT}.gate_up_proj"] = state[f"{EXPERT}.gate_up_proj"][:3]
    bad = copy_checkpoint(path, tmp_path, edit_tensors=lambda t: (t.clear(), t.update(state)))
    with pytest.raises(ValueError, match=rf"'{EXPERT}\.gate_up_proj' has shape \(3, 32, 32\)"):
        jtree.hf.load(bad)


def test_next_tensors_and_the_mtp_head(tmp_path_factory):
    """Gated DeltaNet tensors are checked like any other; Hub Qwen3-Next checkpoints carry the
    multi-token-prediction head `mtp.*`, which the causal LM skips (as transformers does)."""
    path = tmp_path_factory.mktemp("next_only")
    write_moe_checkpoint("next", path)
    _, model = jtree.hf.load(path, tiny_runtime())

    def add_mtp(t):
        t["mtp.fc.weight"] = np.ones((32, 64), np.float32)
        t["mtp.layers.0.input_layernorm.weight"] = np.ones(32, np.float32)

    _, with_mtp = jtree.hf.load(copy_checkpoint(path, path.parent / "mtp", edit_tensors=add_mtp),
                                tiny_runtime())
    assert_same_params(with_mtp, model)
    name = "model.layers.0.linear_attn.A_log"
    bad = copy_checkpoint(path, path.parent / "no_alog", edit_tensors=lambda t: t.pop(name))
    with pytest.raises(ValueError, match=rf"missing tensor\(s\) '{name}'"):
        jtree.hf.load(bad)
    name = "model.layers.2.linear_attn.in_proj_qkvz.weight"
    bad = copy_checkpoint(path, path.parent / "qkvz",
                          edit_tensors=lambda t: t.update({name: t[name][:-2]}))
    with pytest.raises(ValueError, match=rf"'{name}' has shape \(78, 32\)"):
        jtree.hf.load(bad)


def _hub_style(c):
    """config.json as the Hub's Qwen3-MoE / Qwen3-Next checkpoints (transformers 4) write it."""
    params = c.pop("rope_parameters")
    c["rope_theta"] = params["rope_theta"]
    c["rope_scaling"] = None
    if "partial_rotary_factor" in params:
        c["partial_rotary_factor"] = params["partial_rotary_factor"]
    if "num_local_experts" in c:
        c["num_experts"] = c.pop("num_local_experts")
    if "layer_types" in c:
        c.pop("layer_types")
        c["full_attention_interval"] = 2  # 0: linear, 1: full, 2: linear, as layer_types said
    c.update(use_sliding_window=False, max_window_layers=3, sliding_window=None)


def test_hub_style_config_is_read(checkpoint, tmp_path):
    path, _, config, model = checkpoint
    hub = copy_checkpoint(path, tmp_path, edit_config=_hub_style)
    hub_config, loaded = jtree.hf.load(hub, tiny_runtime())
    assert_same_params(loaded, model)
    assert (hub_config.rope_theta, hub_config.num_experts) == (config.rope_theta, 4)
    if config.__class__.__name__ == "Qwen3NextConfig":
        assert hub_config.layer_types == config.layer_types
        assert hub_config.partial_rotary_factor == 0.5


@pytest.mark.parametrize("edit, field", [
    (dict(attn_output_gate=True), "attn_output_gate"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_parameters.rope_type"),
    (dict(rope_scaling={"rope_type": "default", "rope_theta": 5.0}), "conflicting rope_theta"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
])
def test_unsupported_config_is_refused_naming_the_field(checkpoint, tmp_path, edit, field):
    bad = copy_checkpoint(checkpoint[0], tmp_path, edit_config=lambda c: c.update(edit))
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        jtree.hf.load(bad)


REFUSED = {
    "moe": [
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
        (dict(num_experts=8), "num_local_experts = 4 conflicts with num_experts = 8"),
        (dict(use_sliding_window=True, sliding_window=16), "use_sliding_window"),
    ],
    "next": [
        (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention"]),
         r"layer_types\[1\]"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                               "partial_rotary_factor": 0.5}, partial_rotary_factor=0.25),
         "conflicting partial_rotary_factor"),
    ],
}


def test_architecture_specific_config_is_refused(kind, checkpoint, tmp_path):
    for i, (edit, field) in enumerate(REFUSED[kind]):
        bad = copy_checkpoint(checkpoint[0], tmp_path / str(i),
                              edit_config=lambda c, edit=edit: c.update(edit))
        with pytest.raises(ValueError, match=field):
            jtree.hf.load(bad)


def test_save_of_a_jtree_made_model_loads_in_transformers(kind, checkpoint, tmp_path):
    """A model initialized in jtree (not loaded) saves as a transformers checkpoint with the same
    parameters, in bfloat16."""
    config = checkpoint[2]
    model = CausalLM(config, RuntimeConfig(), rngs=nnx.Rngs(3))
    jtree.hf.save(model, config, tmp_path / "out", dtype="bfloat16")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert back.dtype == torch.bfloat16
    params = dict(back.named_parameters())  # tied parameters once, as to_hf_tensors gives them
    ours = jtree.hf.to_hf_tensors(model, config, "bfloat16", names=frozenset(params))
    assert ours.keys() == params.keys()
    for name, value in params.items():
        np.testing.assert_array_equal(value.detach().float().numpy(),
                                      ours[name].astype(np.float32), err_msg=name)
