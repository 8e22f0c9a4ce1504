"""Llama 3 (scaled RoPE) and Qwen2.5 against transformers (tiny random models, CPU, float32).

Each checkpoint is written by transformers itself with every parameter random (norm weights and
biases too), so a swapped, transposed or misnamed tensor cannot hide. On branching trees (several
levels, siblings, paths ending inside, duplicates) `jtree compare-torch` checks logits, tree
log-probs and SFT gradients against transformers run path by path; the PPO test does the same for
the clipped surrogate with KL and entropy, its per-path loss written here in torch. The Llama 3
checkpoint's RoPE scaling keeps, blends and slows down some frequency each
(`tests.models_util.TINY_LLAMA3_ROPE`), so all three branches of the formula are exercised.
"""

import contextlib
import dataclasses
import io
import json

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jtree.hf  # noqa: E402
from jtree.cli import main  # noqa: E402
from jtree.config.architectures import LlamaConfig, Qwen2Config  # noqa: E402
from jtree.config.objective import Objective  # noqa: E402
from jtree.hf.safetensors_io import SINGLE_FILE  # noqa: E402
from jtree.layout.coefficients import batch_normalizer, path_coefficients  # noqa: E402
from jtree.layout.linearize import linearize, unlinearize  # noqa: E402
from jtree.objectives.logprobs import token_logprobs  # noqa: E402
from jtree.objectives.objective import objective_loss  # noqa: E402
from jtree.trees.jsonl import write_sequence_groups  # noqa: E402
from jtree.trees.tree import TrajectoryTree  # noqa: E402
from tests.hf_util import assert_same_params, copy_checkpoint  # noqa: E402
from tests.models_util import TINY_LLAMA3_ROPE, rel_l2, tiny_runtime  # noqa: E402
from tests.strategies import one_row_forests  # noqa: E402
from tests.torch_util import TOL, VOCAB, torch_logits  # noqa: E402

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
    config = CONFIGS[kind]()
    model = transformers.AutoModelForCausalLM.from_config(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if name.endswith("norm.weight") else 0.0))
    model.save_pretrained(path)
    return model.eval()


def compare_trees():
    """Branching trees and a single sequence longer than the others (up to position 40)."""
    rng = np.random.default_rng(2)
    return one_row_forests(VOCAB) + [TrajectoryTree.from_sequences([rng.integers(0, VOCAB, 41)])]


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
    path = checkpoint[0]
    write_sequence_groups(tmp_path / "d.jsonl", compare_trees())
    out, text = tmp_path / "r.json", io.StringIO()
    with contextlib.redirect_stdout(text):
        code = main(["compare-torch", "--hf-dir", str(path), "--data", str(tmp_path / "d.jsonl"),
                     "--attention-impl", "reference", "--json", str(out)])
    r = json.loads(out.read_text())
    assert code == 0, text.getvalue()
    assert r["failures"] == []
    assert r["paths"] == sum(t.n_paths for t in compare_trees())
    assert 0 < r["max_abs_logits"] <= TOL  # every position of every path
    assert r["max_abs_logprobs"] <= TOL  # tree log-probs vs each path run alone in transformers
    assert r["max_rel_grad"] <= TOL  # per tensor, tree SFT loss vs per-path loss
    assert r["tree_loss"] == pytest.approx(r["path_loss"], rel=1e-5)
    assert r["groups"]["full_attention"]["layers"] == 3 and r["groups"]["mlp"]["tensors"] > 0


def test_tree_logprobs_equal_transformers_per_path(checkpoint):
    _, ref, _, model = checkpoint
    trees = compare_trees()
    batch = linearize(trees, 160)
    ours = unlinearize(batch, np.asarray(token_logprobs(model, batch.inputs)))
    for tree, tree_logp in zip(trees, ours):
        for p in range(tree.n_paths):
            tokens = tree.path_tokens(p)
            logits = torch.as_tensor(torch_logits(ref, tokens))
            expected = torch.log_softmax(logits[:-1], -1).gather(
                1, torch.as_tensor(tokens[1:, None], dtype=torch.int64))[:, 0].numpy()
            np.testing.assert_allclose(tree_logp[p][1:], expected, atol=TOL, rtol=0)


PPO = Objective(kind="ppo", normalization="seq_mean_token_mean", clip_low=0.2, clip_high=0.28,
                kl_coef=0.05, entropy_coef=0.01)


def torch_ppo_path_loss(ref, tokens, c, adv, old, ref_logp):
    """One path's PPO loss in torch: -sum_t c_t [A min(r_t, clip r_t) (A >= 0; max for A < 0)]
    + kl_coef sum_t c_t k3(ref_t - logp_t) - entropy_coef sum_t c_t H_t, over tokens 1..L-1."""
    ids = torch.as_tensor(tokens.astype(np.int64))[None]
    logits = ref(input_ids=ids).logits[0, :-1]
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(1, ids[0, 1:, None])[:, 0]
    c, old, ref_logp = (torch.as_tensor(x[1:]) for x in (c, old, ref_logp))
    ratio = torch.exp(logp - old)
    clipped = ratio.clamp(1 - PPO.clip_low, 1 + PPO.clip_high)
    pick = torch.minimum if adv >= 0 else torch.maximum
    surrogate = -(c * adv * pick(ratio, clipped)).sum()
    d = ref_logp - logp
    kl = (c * (torch.exp(d) - d - 1)).sum()
    entropy = (c * -(logp_all.exp() * logp_all).sum(-1)).sum()
    return surrogate + PPO.kl_coef * kl - PPO.entropy_coef * entropy


def test_tree_ppo_gradient_equals_transformers_per_path(checkpoint):
    """Advantages of both signs on paths that share tokens, old and reference log-probs off the
    current policy (so the clip acts): the tree loss and every gradient equal the sum of the
    per-path losses in transformers."""
    _, ref, config, model = checkpoint
    rng = np.random.default_rng(3)
    trees = [t.with_advantages(list(rng.normal(0, 1, t.n_paths))) for t in compare_trees()]
    batch = linearize(trees, 160, normalization=PPO.normalization)
    cur = np.asarray(token_logprobs(model, batch.inputs))
    old = (cur + rng.normal(0, 0.3, cur.shape)).astype(np.float32)
    ref_lp = (cur + rng.normal(0, 0.3, cur.shape)).astype(np.float32)
    inputs = batch.inputs.with_coefficients(old_logprobs=old, ref_logprobs=ref_lp)
    graphdef, params = nnx.split(model, nnx.Param)
    tree_loss, grads = jax.value_and_grad(
        lambda p: objective_loss(nnx.merge(graphdef, p), inputs, PPO)[0])(params)
    ours = jtree.hf.to_hf_tensors(grads, config)

    ref.zero_grad(set_to_none=True)
    normalizer = batch_normalizer(trees, PPO.normalization)
    path_loss, clipped = 0.0, 0
    for tree, old_paths, ref_paths in zip(trees, unlinearize(batch, old),
                                          unlinearize(batch, ref_lp)):
        coeffs = path_coefficients(tree, PPO.normalization, normalizer)
        for p in range(tree.n_paths):
            loss = torch_ppo_path_loss(ref, tree.path_tokens(p), coeffs[p],
                                       float(tree.advantages[p][0]), old_paths[p], ref_paths[p])
            loss.backward()
            path_loss += float(loss.detach())
    assert float(tree_loss) == pytest.approx(path_loss, rel=1e-5, abs=1e-6)
    expected = {n: p.grad.numpy() for n, p in ref.named_parameters()}
    assert ours.keys() == expected.keys()
    for name, g in expected.items():
        assert np.linalg.norm(g) > 0, name
        assert rel_l2(ours[name], g) <= TOL, name


def test_save_then_from_pretrained_gives_the_same_model(checkpoint, tmp_path):
    path, ref, config, model = checkpoint
    jtree.hf.save(model, config, tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(back) is type(ref)
    for key in ("rope_parameters", "tie_word_embeddings", "attention_bias", "mlp_bias",
                "num_key_value_heads", "rms_norm_eps", "layer_types"):
        assert getattr(back.config, key, None) == getattr(ref.config, key, None), key
    # (jtree writes Qwen2's head_dim, which transformers' Qwen2 reads when present)
    assert back.model.layers[0].self_attn.head_dim == ref.model.layers[0].self_attn.head_dim
    expected = ref.state_dict()
    for name, value in back.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), expected[name].numpy(), err_msg=name)
    seq = np.arange(1, 45) % VOCAB
    np.testing.assert_array_equal(torch_logits(back, seq), torch_logits(ref, seq))


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
