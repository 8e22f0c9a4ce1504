"""jtree vs transformers on the same Qwen3 checkpoint (tiny, random, float32, CPU).

The PyTorch side here is written directly against transformers (not through
jtree.hf.torch_reference), so these tests also check the reference used by `compare-torch`.
"""

import json

import jax
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jtree.hf  # noqa: E402
from jtree.cli import main  # noqa: E402
from jtree.config.objective import Objective
from jtree.config.runtime import RuntimeConfig
from jtree.layout.coefficients import batch_normalizer, path_coefficients
from jtree.layout.linearize import linearize, unlinearize  # noqa: E402
from jtree.objectives.logprobs import token_logprobs  # noqa: E402
from jtree.objectives.objective import objective_loss
from jtree.trees.jsonl import write_sequence_groups  # noqa: E402
from jtree.trees.tree import TrajectoryTree  # noqa: E402
from tests.hf_util import random_model  # noqa: E402
from tests.models_util import rel_l2, tiny_runtime  # noqa: E402
from tests.strategies import one_row_forests  # noqa: E402
from tests.torch_util import TOL, VOCAB, torch_logits, write_qwen3_checkpoint  # noqa: E402


@pytest.fixture(scope="module", params=[dict(tie=False, bias=False), dict(tie=True, bias=True)],
                ids=["untied", "tied+bias"])
def checkpoint(request, tmp_path_factory):
    path = write_qwen3_checkpoint(tmp_path_factory.mktemp("hf"), **request.param)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    config, model = jtree.hf.load(path, tiny_runtime())
    return path, ref, config, model


def jtree_path_logits(model, batch):
    """Logits at every token of every path of a linearized batch: [tree][path] -> [L, V]."""
    hidden = np.asarray(model(batch.inputs).hidden)
    w = np.asarray(model.output_embedding())
    out = []
    for tree, row, off in zip(batch.layout.trees, batch.layout.rows, batch.layout.offsets):
        out.append([hidden[row, off + tree.path_token_index(p)] @ w for p in range(tree.n_paths)])
    return out


def test_logits_on_single_sequences_match_transformers(checkpoint):
    _, ref, _, model = checkpoint
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, VOCAB, n) for n in (1, 5, 17, 40)]
    batch = linearize([TrajectoryTree.from_sequences([s]) for s in seqs], 64)
    ours = jtree_path_logits(model, batch)
    for seq, (logits,) in zip(seqs, ours):
        expected = torch_logits(ref, seq)
        assert np.abs(expected).max() > 1.0  # logits of O(1): a real comparison
        np.testing.assert_allclose(logits, expected, atol=TOL, rtol=0)


@pytest.mark.parametrize("temperature,chunk", [(1.0, 1024), (0.7, 1024), (0.7, 8)],
                         ids=["T=1", "T=0.7", "T=0.7-chunked"])
def test_tree_logprobs_equal_transformers_per_path(checkpoint, temperature, chunk):
    """Tree log-probs at `objective.temperature` T are log_softmax(logits / T) of each path run
    alone in transformers, also when the log-sum-exp runs in several chunks."""
    _, ref, _, model = checkpoint
    trees = one_row_forests(VOCAB)
    batch = linearize(trees, 128)
    assert batch.shape[0] == 1  # several trees share the row
    ours = unlinearize(batch, np.asarray(token_logprobs(model, batch.inputs, chunk=chunk,
                                                        temperature=temperature)))
    for tree, tree_logp in zip(trees, ours):
        for p in range(tree.n_paths):
            tokens = tree.path_tokens(p)
            logits = torch.as_tensor(torch_logits(ref, tokens))
            expected = torch.log_softmax(logits[:-1] / temperature, -1).gather(
                1, torch.as_tensor(tokens[1:, None], dtype=torch.int64))[:, 0].numpy()
            assert tree_logp[p][0] == 0.0
            np.testing.assert_allclose(tree_logp[p][1:], expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("normalization", ["seq_mean_token_mean", "token_mean"])
def test_tree_loss_gradient_equals_pytorch_per_path_gradient(checkpoint, normalization):
    _, ref, config, model = checkpoint
    trees = one_row_forests(VOCAB)
    batch = linearize(trees, 128, normalization=normalization)
    graphdef, params = nnx.split(model, nnx.Param)

    def loss_fn(p):
        return objective_loss(nnx.merge(graphdef, p), batch.inputs,
                              Objective(kind="sft", normalization=normalization))[0]

    tree_loss, grads = jax.value_and_grad(loss_fn)(params)
    ours = jtree.hf.to_hf_tensors(grads, config)

    ref.zero_grad(set_to_none=True)
    normalizer = batch_normalizer(trees, normalization)
    path_loss = 0.0
    for tree in trees:
        coeffs = path_coefficients(tree, normalization, normalizer)
        for p in range(tree.n_paths):
            ids = torch.as_tensor(tree.path_tokens(p).astype(np.int64))[None]
            logp = torch.log_softmax(ref(input_ids=ids).logits[0, :-1], -1).gather(
                1, ids[0, 1:, None])[:, 0]
            loss = -(torch.as_tensor(coeffs[p][1:]) * logp).sum()
            loss.backward()
            path_loss += float(loss.detach())
    assert float(tree_loss) == pytest.approx(path_loss, rel=1e-5)
    expected = {n: p.grad.numpy() for n, p in ref.named_parameters()}
    assert ours.keys() == expected.keys()
    for name, g in expected.items():
        assert np.linalg.norm(g) > 0, name
        assert rel_l2(ours[name], g) <= TOL, name


@pytest.mark.parametrize("tie", [False, True])
def test_save_then_from_pretrained_gives_the_same_logits(tmp_path, tie):
    cfg, model = random_model(seed=7, tie_word_embeddings=tie, attention_bias=tie)
    jtree.hf.save(model, cfg, tmp_path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert ref.config.tie_word_embeddings == tie
    seqs = [np.arange(1, 30) % cfg.vocab_size, np.array([5, 3, 60, 2])]
    batch = linearize([TrajectoryTree.from_sequences([s]) for s in seqs], 64)
    for seq, (logits,) in zip(seqs, jtree_path_logits(model, batch)):
        np.testing.assert_allclose(logits, torch_logits(ref, seq), atol=TOL, rtol=0)


def test_bfloat16_save_loads_in_transformers_as_bfloat16(tmp_path):
    cfg, model = random_model(seed=8)
    jtree.hf.save(model, cfg, tmp_path, dtype="bfloat16")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert ref.dtype == torch.bfloat16
    w = ref.model.layers[0].mlp.up_proj.weight.detach().float().numpy()
    ours = np.asarray(model.model.layers[0].mlp.up_proj.kernel[...]).T
    np.testing.assert_array_equal(w, ours.astype(jax.numpy.bfloat16).astype(np.float32))


def test_transformers_sharded_and_bfloat16_checkpoints_load(tmp_path):
    write_qwen3_checkpoint(tmp_path / "single", tie=True, bias=False, seed=3)
    write_qwen3_checkpoint(tmp_path / "sharded", tie=True, bias=False, seed=3,
                           max_shard_size="20KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) >= 3
    _, single = jtree.hf.load(tmp_path / "single")
    _, sharded = jtree.hf.load(tmp_path / "sharded")
    a, b = nnx.state(single, nnx.Param), nnx.state(sharded, nnx.Param)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(x, y)

    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "single").to(torch.bfloat16)
    ref.save_pretrained(tmp_path / "bf16")
    _, bf = jtree.hf.load(tmp_path / "bf16",
                          RuntimeConfig(dtype="bfloat16", param_dtype="bfloat16"))
    assert bf.runtime.param_dtype == "bfloat16"
    expected = ref.model.layers[2].self_attn.o_proj.weight.detach().float().numpy().T
    got = np.asarray(bf.model.layers[2].self_attn.o_proj.kernel[...]).astype(np.float32)
    np.testing.assert_array_equal(got, expected)


@pytest.fixture(scope="module")
def cli_checkpoint(tmp_path_factory):
    return write_qwen3_checkpoint(tmp_path_factory.mktemp("hf_cli"), tie=True, bias=True, seed=1)


def _data_file(path):
    write_sequence_groups(path, one_row_forests(VOCAB))
    return path


def test_compare_torch_passes_on_a_checkpoint_and_reports(cli_checkpoint, tmp_path, capsys):
    path = cli_checkpoint
    out = tmp_path / "r.json"
    code = main(["compare-torch", "--hf-dir", str(path), "--data",
                 str(_data_file(tmp_path / "d.jsonl")), "--attention-impl", "reference",
                 "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    report = json.loads(out.read_text())
    assert report["failures"] == []
    assert report["paths"] == sum(t.n_paths for t in one_row_forests(VOCAB))
    assert 0 < report["max_abs_logits"] <= TOL and report["max_abs_logprobs"] <= TOL
    assert report["max_rel_grad"] <= TOL
    assert report["tree_loss"] == pytest.approx(report["path_loss"], rel=1e-5)
    groups = report["groups"]
    assert groups["full_attention"]["layers"] == 3 and groups["full_attention"]["tensors"] > 0
    assert "full_attention" in text and "overall" in text


def test_compare_torch_fails_when_pytorch_computes_something_else(cli_checkpoint, tmp_path,
                                                                    monkeypatch, capsys):
    """A wrong weight in one layer of the PyTorch model: non-zero exit, the layer's group and
    tensor show up."""
    from jtree.hf import torch_reference

    path = cli_checkpoint
    load = torch_reference.load_torch_model

    def perturbed(directory):
        model = load(directory)
        with torch.no_grad():
            model.model.layers[1].mlp.down_proj.weight.mul_(1.01)
        return model

    monkeypatch.setattr(torch_reference, "load_torch_model", perturbed)
    out = tmp_path / "r.json"
    code = main(["compare-torch", "--hf-dir", str(path), "--data",
                 str(_data_file(tmp_path / "d.jsonl")), "--attention-impl", "reference",
                 "--json", str(out)])
    assert code == 1
    report = json.loads(out.read_text())
    assert report["max_abs_logits"] > TOL and report["failures"]
    assert "FAIL" in capsys.readouterr().out
