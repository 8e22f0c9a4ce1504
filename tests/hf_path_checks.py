"""Checks of a tiny random transformers checkpoint against jtree, path by path, shared by the
architecture tests (`tests/hf/test_hf_llama_qwen2.py`, `tests/hf/test_hf_qwen3_5.py`,
`tests/hf/test_hf_gpt_oss.py`): each checkpoint is written by transformers itself with every
parameter random (norm weights and biases too), so a swapped, transposed or misnamed tensor
cannot hide; the trees branch at several levels, with siblings, paths ending inside and
duplicates. Import after `pytest.importorskip("torch")` and
`pytest.importorskip("transformers")`."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import jtree.hf
from jtree.cli import main
from jtree.config.objective import Objective
from jtree.layout.coefficients import batch_normalizer, path_coefficients
from jtree.layout.linearize import linearize, unlinearize
from jtree.trees.jsonl import write_sequence_groups
from jtree.trees.tree import TrajectoryTree
from tests.models_util import logprob_fn, loss_and_grad_fn, rel_l2
from tests.strategies import one_row_forests
from tests.torch_util import TOL, VOCAB, torch_logits


def write_random_checkpoint(config: Any, path: Path) -> torch.nn.Module:
    """transformers' causal LM of `config`, every parameter random (norm weights around 1),
    saved to `path`."""
    model = transformers.AutoModelForCausalLM.from_config(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if name.endswith("norm.weight") else 0.0))
    model.save_pretrained(path)
    return model.eval()


def write_deepseek_checkpoint(config: Any, path: Path) -> torch.nn.Module:
    """`write_random_checkpoint`, then the routers' selection biases random too (saved again): a
    DeepSeek-style router's `e_score_correction_bias`, a buffer the writer leaves at zero, set on
    the scale of the sigmoid scores so that it changes which experts are chosen (DeepSeek-V3,
    Kimi-Linear, Nemotron-H)."""
    ref = write_random_checkpoint(config, path)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, b in ref.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.3)
    ref.save_pretrained(path)
    return ref


def compare_trees() -> list[TrajectoryTree]:
    """Branching trees and a single sequence longer than the others (up to position 40)."""
    rng = np.random.default_rng(2)
    return one_row_forests(VOCAB) + [TrajectoryTree.from_sequences([rng.integers(0, VOCAB, 41)])]


def compare_torch_report(path: Path, tmp_path: Path, *extra: str) -> dict[str, Any]:
    """`jtree compare-torch` on `compare_trees()`: logits, log-probs and SFT gradients within
    1e-4 of transformers per path; the JSON report, for the caller's checks of its groups."""
    write_sequence_groups(tmp_path / "d.jsonl", compare_trees())
    out, text = tmp_path / "r.json", io.StringIO()
    with contextlib.redirect_stdout(text):
        code = main(["compare-torch", "--hf-dir", str(path), "--data", str(tmp_path / "d.jsonl"),
                     "--attention-impl", "reference", "--json", str(out), *extra])
    r = json.loads(out.read_text())
    assert code == 0, text.getvalue()
    assert r["failures"] == []
    assert r["paths"] == sum(t.n_paths for t in compare_trees())
    assert 0 < r["max_abs_logits"] <= TOL  # every position of every path
    assert r["max_abs_logprobs"] <= TOL  # tree log-probs vs each path run alone in transformers
    assert r["max_rel_grad"] <= TOL  # per tensor, tree SFT loss vs per-path loss
    assert r["tree_loss"] == pytest.approx(r["path_loss"], rel=1e-5)
    return r


def assert_tree_logprobs_equal_per_path(ref: torch.nn.Module, model: Any,
                                        gdn_chunk_size: int | None = None) -> float:
    """The tree log-probs of `compare_trees()` equal transformers' on each path alone; returns
    the largest difference."""
    trees = compare_trees()
    batch = linearize(trees, 160, gdn_chunk_size=gdn_chunk_size)
    graphdef, params = nnx.split(model, nnx.Param)
    ours = unlinearize(batch, np.asarray(logprob_fn(graphdef)(params, batch.inputs)))
    worst = 0.0
    for tree, tree_logp in zip(trees, ours):
        for p in range(tree.n_paths):
            tokens = tree.path_tokens(p)
            logits = torch.as_tensor(torch_logits(ref, tokens))
            expected = torch.log_softmax(logits[:-1], -1).gather(
                1, torch.as_tensor(tokens[1:, None], dtype=torch.int64))[:, 0].numpy()
            np.testing.assert_allclose(tree_logp[p][1:], expected, atol=TOL, rtol=0)
            worst = max(worst, float(np.abs(tree_logp[p][1:] - expected).max()))
    return worst


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


def assert_ppo_gradients_equal_per_path(ref: torch.nn.Module, config: Any, model: Any,
                                        gdn_chunk_size: int | None = None) -> float:
    """Advantages of both signs on paths that share tokens, old and reference log-probs off the
    current policy (so the clip acts): the tree loss and every gradient equal the sum of the
    per-path losses in transformers. Returns the largest relative gradient difference."""
    rng = np.random.default_rng(3)
    trees = [t.with_advantages(list(rng.normal(0, 1, t.n_paths))) for t in compare_trees()]
    batch = linearize(trees, 160, normalization=PPO.normalization, gdn_chunk_size=gdn_chunk_size)
    graphdef, params = nnx.split(model, nnx.Param)
    cur = np.asarray(logprob_fn(graphdef)(params, batch.inputs))
    old = (cur + rng.normal(0, 0.3, cur.shape)).astype(np.float32)
    ref_lp = (cur + rng.normal(0, 0.3, cur.shape)).astype(np.float32)
    inputs = batch.inputs.with_coefficients(old_logprobs=old, ref_logprobs=ref_lp)
    tree_loss, grads = loss_and_grad_fn(graphdef, PPO)(params, inputs)

    ref.zero_grad(set_to_none=True)
    normalizer = batch_normalizer(trees, PPO.normalization)
    path_loss = 0.0
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
    # transformers' buffers that jtree holds as parameters (DeepSeek-V3's expert selection
    # bias) only order things: no gradient reaches them in jtree either
    buffers = frozenset(n for n, _ in ref.named_buffers()) - frozenset(expected)
    # (experts in the layout transformers holds them: fused in transformers 5)
    ours = jtree.hf.to_hf_tensors(grads, config, names=frozenset(expected) | buffers)
    for name in buffers & ours.keys():
        assert not np.any(ours.pop(name)), name
    assert ours.keys() == expected.keys()
    worst = 0.0
    for name, g in expected.items():
        assert np.linalg.norm(g) > 0, name
        assert rel_l2(ours[name], g) <= TOL, name
        worst = max(worst, rel_l2(ours[name], g))
    return worst


def assert_from_pretrained_gives_the_same_model(ref: torch.nn.Module, saved: Path,
                                                keys: tuple[str, ...]) -> None:
    """transformers loads the directory jtree saved as the same class, `keys` of its config and
    every tensor equal to `ref`'s, and the same logits."""
    back = transformers.AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    assert type(back) is type(ref)
    for key in keys:
        assert getattr(back.config, key, None) == getattr(ref.config, key, None), key
    expected = ref.state_dict()
    assert back.state_dict().keys() == expected.keys()
    for name, value in back.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), expected[name].numpy(), err_msg=name)
    seq = np.arange(1, 45) % VOCAB
    np.testing.assert_array_equal(torch_logits(back, seq), torch_logits(ref, seq))
