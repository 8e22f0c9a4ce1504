"""Multi-token prediction on trees (`jtree.models.mtp`, docs/design.md "Multi-token prediction on
trees") against a per-path MTP reference written here in plain jnp from the parameters.

The reference runs the jtree model on each path as its own row (the baseline layout) only for
the main model's final hidden states; everything MTP does is written below in the sequence
convention of DeepSeek-V3 / Megatron: at depth k, sequence position i combines the previous
depth's state h_i with the embedding of token i+k ([norm(emb); norm(h)], Qwen3-Next's order),
runs one Qwen3 decoder layer over positions 0..n-k-1 of the path, and predicts token i+k+1 with
the main head, weighted by that token's loss coefficient c[p, i+k+1]. Trees: several levels,
siblings, paths ending at internal nodes, duplicate paths, several trees in one row.
"""

import dataclasses
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from jtree.config.objective import Objective
from jtree.hf import load, save
from jtree.hf.safetensors_io import SINGLE_FILE
from jtree.kernels import TreeMask
from jtree.layout.baseline import linearize_baseline
from jtree.layout.linearize import linearize
from jtree.models import CausalLM
from jtree.models.mtp import without_short_paths
from jtree.objectives.objective import objective_loss
from tests.hf_util import MTP_EXTRA, copy_checkpoint, with_mtp_tensors
from tests.models_util import (
    assert_grads_close,
    four_expert_config,
    perturbed,
    tiny_config,
    tiny_nemotron_h_config,
    tiny_next_config,
    tiny_qwen3_5_config,
    tiny_qwen3_5_moe_config,
    tiny_runtime,
)
from tests.run_util import WORKTREE
from tests.strategies import one_row_forests

S, VOCAB, MTP_WEIGHT = 128, 64, 0.7
CONFIG = tiny_config(vocab_size=VOCAB)
TREES = one_row_forests(VOCAB)
TREE = linearize(TREES, S, n_rows=1)
BASE = linearize_baseline(TREES, S)
# The baseline rows without `score_index`, so the loss's unindexed form runs too.
BASE_INPUTS = dataclasses.replace(BASE.inputs, score_index=None)


@functools.cache
def model(depth: int):
    """(graphdef, perturbed params) of the tiny Qwen3 with MTP modules of `depth`."""
    graphdef, params = nnx.split(CausalLM(CONFIG, tiny_runtime(), rngs=nnx.Rngs(3),
                                          mtp_depth=depth))
    return graphdef, perturbed(params, scale=0.2)


def rms(x, w):
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + CONFIG.rms_norm_eps) * w


def ref_layer(p, x, positions):
    """One Qwen3 decoder layer on a single sequence x [n, d] at `positions` (causal)."""
    n, heads, kv, hd = x.shape[0], CONFIG.num_attention_heads, CONFIG.num_key_value_heads, \
        CONFIG.head_dim
    a = p["self_attn"]
    h = rms(x, p["input_layernorm"]["weight"])
    q = rms((h @ a["q_proj"]["kernel"]).reshape(n, heads, hd), a["q_norm"]["weight"])
    k = rms((h @ a["k_proj"]["kernel"]).reshape(n, kv, hd), a["k_norm"]["weight"])
    v = (h @ a["v_proj"]["kernel"]).reshape(n, kv, hd)
    inv = 1.0 / CONFIG.rope_theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
    ang = jnp.asarray(positions, jnp.float32)[:, None] * inv
    cos, sin = jnp.cos(jnp.concatenate([ang, ang], -1)), jnp.sin(jnp.concatenate([ang, ang], -1))

    def rope(t):
        half = jnp.concatenate([-t[..., hd // 2:], t[..., :hd // 2]], -1)
        return t * cos[:, None] + half * sin[:, None]

    q, k = rope(q), rope(k)
    k, v = (jnp.repeat(t, heads // kv, axis=1) for t in (k, v))
    scores = jnp.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
    scores = jnp.where(np.tril(np.ones((n, n), bool)), scores, -jnp.inf)
    o = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, -1), v).reshape(n, heads * hd)
    x = x + o @ a["o_proj"]["kernel"]
    m = p["mlp"]
    h = rms(x, p["post_attention_layernorm"]["weight"])
    return x + (jax.nn.silu(h @ m["gate_proj"]["kernel"]) * (h @ m["up_proj"]["kernel"])) \
        @ m["down_proj"]["kernel"]


def ref_mtp_loss(params, hidden, tokens, coef, depth):
    """sum over depths k (averaged) of sum_i c[i+k+1] * -log q_k(t[i+k+1]) on one path: its final
    hidden states `hidden` [n, d], tokens [n] and loss coefficients [n] (a path padded at its end
    with zero coefficients gives the same value: every step is causal)."""
    mtp, emb = params["mtp"], params["model"]["embed_tokens"]["embedding"]
    w_out = params["lm_head"]["kernel"]
    n, total, prev = len(tokens), 0.0, hidden
    for k in range(1, depth + 1):
        e = rms(emb[tokens[k:]], mtp["pre_fc_norm_embedding"]["weight"])
        x = jnp.concatenate([e, rms(prev[: n - k], mtp["pre_fc_norm_hidden"]["weight"])], -1)
        x = ref_layer(mtp["layers"][k - 1], x @ mtp["fc"]["kernel"], np.arange(n - k))
        prev = rms(x, mtp["norm"]["weight"])  # what the head reads and depth k+1 chains
        logp = jax.nn.log_softmax(prev[: n - k - 1] @ w_out, -1)
        total = total - jnp.sum(coef[k + 1:] * jnp.take_along_axis(
            logp, tokens[k + 1:, None], axis=-1)[:, 0])
    return total / depth


def per_path(batch, values):
    """Each path's slice of baseline-layout [rows, S, ...] values, in the batch's path order,
    zero-padded at the end to the longest path: [paths, L, ...]."""
    lengths = [len(t.path_tokens(p)) for t in TREES for p in range(t.n_paths)]
    longest = max(lengths)
    return jnp.stack([jnp.pad(values[r, off: off + n],
                              [(0, longest - n)] + [(0, 0)] * (values.ndim - 2))
                      for r, off, n in zip(batch.layout.rows, batch.layout.offsets, lengths)])


@functools.cache
def reference_fn(depth: int):
    """params -> (main SFT loss + MTP_WEIGHT * reference MTP loss, reference MTP loss): the main
    model per path (baseline rows), the MTP part per path as written above."""
    graphdef, _ = model(depth)
    tokens = per_path(BASE, np.asarray(BASE.inputs.tokens))
    coef = per_path(BASE, np.asarray(BASE.inputs.coefficients.weight))

    def f(params):
        lm = nnx.merge(graphdef, params)
        main, _ = objective_loss(lm, BASE_INPUTS, Objective(kind="sft"))
        hidden = per_path(BASE, lm(BASE_INPUTS).hidden)
        one_path = functools.partial(ref_mtp_loss, nnx.to_pure_dict(params), depth=depth)
        mtp = jnp.sum(jax.vmap(one_path)(hidden, tokens, coef))
        return main + MTP_WEIGHT * mtp, mtp

    return jax.jit(jax.value_and_grad(f, has_aux=True))


@functools.cache
def jtree_fn(depth: int):
    graphdef, _ = model(depth)
    objective = Objective(kind="sft", mtp_weight=MTP_WEIGHT, mtp_depth=depth)

    def f(params, inputs):
        loss, metrics = objective_loss(nnx.merge(graphdef, params), inputs, objective)
        return loss, metrics["mtp_nll"]

    return jax.jit(jax.value_and_grad(f, has_aux=True))


def test_trees_really_branch():
    paths = [tuple(t.path_tokens(p)) for t in TREES for p in range(t.n_paths)]
    assert max(len(p) for p in paths) >= 5 and len(set(paths)) < len(paths)
    assert len(paths) > len(TREES) and TREE.inputs.tokens.shape[0] == 1


@pytest.mark.parametrize("depth", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_tree_mtp_equals_per_path_reference(depth):
    """Loss, MTP loss and the gradient of every parameter (main model and MTP) of the tree
    equal the per-path reference at 1e-5; the baseline rows give the same MTP loss."""
    _, params = model(depth)
    (ref_loss, ref_mtp), ref_grads = reference_fn(depth)(params)
    (loss, mtp), grads = jtree_fn(depth)(params, TREE.inputs)
    assert float(ref_mtp) > 0.1
    assert float(mtp) == pytest.approx(float(ref_mtp), rel=1e-5)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    assert_grads_close(grads, ref_grads)
    (_, base_mtp), _ = jtree_fn(depth)(params, BASE_INPUTS)
    assert float(base_mtp) == pytest.approx(float(ref_mtp), rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["xla", "cpu"])
def test_tree_mtp_through_block_sparse_kernels(impl):
    """The MTP layer's mask (the paths' first tokens hidden as keys) through the block-sparse
    kernels' block tables, traced (jit) and from host arrays (eager): the reference's MTP loss."""
    graphdef = nnx.split(CausalLM(CONFIG, tiny_runtime(attention_impl=impl), rngs=nnx.Rngs(3),
                                  mtp_depth=1))[0]
    _, params = model(1)
    (_, ref_mtp), _ = reference_fn(1)(params)
    objective = Objective(kind="sft", mtp_weight=MTP_WEIGHT)

    def mtp_nll(params, inputs):
        return objective_loss(nnx.merge(graphdef, params), inputs, objective)[1]["mtp_nll"]

    for got in (jax.jit(mtp_nll)(params, TREE.inputs), mtp_nll(params, TREE.inputs)):
        assert float(got) == pytest.approx(float(ref_mtp), rel=1e-5)


@pytest.mark.slow
def test_qwen3_next_mtp_tree_equals_baseline():
    """Qwen3-Next (GDN and gated attention, (1 + w) norms, MoE with a shared expert in every
    layer, the MTP layer too), depth 2: the tree's loss, MTP loss and gradients equal the
    baseline rows'."""
    cfg = four_expert_config("next", mlp_only_layers=())
    graphdef, params = nnx.split(CausalLM(cfg, tiny_runtime(), rngs=nnx.Rngs(4), mtp_depth=2))
    params = perturbed(params, scale=0.2)
    tree = linearize(TREES, S, n_rows=1, gdn_chunk_size=3, gdn_chunks=S)
    base = linearize_baseline(TREES, S, gdn_chunk_size=3, gdn_chunks=S)
    objective = Objective(kind="sft", mtp_weight=MTP_WEIGHT, mtp_depth=2)

    @jax.jit
    @functools.partial(jax.value_and_grad, has_aux=True)
    def f(params, inputs):
        loss, metrics = objective_loss(nnx.merge(graphdef, params), inputs, objective)
        return loss, metrics["mtp_nll"]

    (loss_t, mtp_t), g_t = f(params, tree.inputs)
    (loss_b, mtp_b), g_b = f(params, base.inputs)
    assert float(mtp_b) > 0.1
    assert float(mtp_t) == pytest.approx(float(mtp_b), rel=1e-5)
    assert float(loss_t) == pytest.approx(float(loss_b), rel=1e-5)
    assert_grads_close(g_t, g_b)


@pytest.mark.slow
def test_mtp_on_a_mesh_equals_one_device():
    """SFT + depth-2 MTP over a (data, fsdp, model) = (2, 2, 2) mesh of 8 host devices: loss,
    MTP loss and every gradient within the error model against one device
    (`tests/mtp_mesh_worker.py`)."""
    env = dict(os.environ, PYTHONPATH=str(WORKTREE))
    proc = subprocess.run([sys.executable, "-m", "tests.mtp_mesh_worker"], cwd=WORKTREE,
                          env=env, capture_output=True, text=True, timeout=1200, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["mtp_nll"] > 0.1
    for kind in ("scalars", "grads"):
        assert result[kind]["excess"] <= 1.0, result[kind]


def test_mtp_refusals():
    graphdef, params = model(1)
    with pytest.raises(ValueError, match="mtp_depth"):
        objective_loss(nnx.merge(graphdef, params), TREE.inputs,
                       Objective(kind="sft", mtp_weight=1.0, mtp_depth=2))
    with pytest.raises(ValueError, match="mtp_depth: 2 is read only"):
        Objective(mtp_depth=2)
    # A redundancy-free part's mask (cached prefix keys), context parallelism.
    with pytest.raises(ValueError, match="mtp_weight: not available with run.mode=redundancy"):
        without_short_paths(TreeMask(np.ones((1, 4), np.int32), prefix_end=np.ones((1, 2),
                                                                                  np.int32)),
                            np.zeros((1, 4), np.int32), 1)
    lm = nnx.merge(graphdef, params)
    lm.mtp.runtime = tiny_runtime(context_axis="context")
    with pytest.raises(ValueError, match="mtp_weight: not available under context"):
        lm.mtp(*(None,) * 5)
    # Nemotron-H: its attention layers have no feed-forward, and a Mamba2 or MLP-only MTP layer
    # would not keep the tree loss the per-path one (a recurrence carries hidden path starts).
    with pytest.raises(ValueError, match="no attention layer with a feed-forward"):
        CausalLM(tiny_nemotron_h_config(), tiny_runtime(), rngs=nnx.Rngs(0), mtp_depth=1)


# ---------------------------------------------------------------- Hugging Face checkpoints
HF_CONFIGS = {"qwen3_next": lambda: tiny_next_config(mlp_only_layers=(), num_experts=4),
              "qwen3_5": tiny_qwen3_5_config,
              "qwen3_5_moe": lambda: tiny_qwen3_5_moe_config(num_experts=4)}



@pytest.mark.parametrize("arch", sorted(HF_CONFIGS))
def test_hf_mtp_round_trip(arch, tmp_path):
    """A checkpoint with Hub-named `mtp.*` tensors loads into the MTP modules (mtp_depth=1),
    each tensor where its name says, saves back bit for bit, and loads without them
    (mtp_depth=0: skipped) as before."""
    cfg = HF_CONFIGS[arch]()
    save(CausalLM(cfg, tiny_runtime(), rngs=nnx.Rngs(0)), cfg, tmp_path / "plain")
    src = copy_checkpoint(tmp_path / "plain", tmp_path / "mtp", edit_tensors=lambda t:
                          with_mtp_tensors(t, cfg.hidden_size))
    tensors = load_file(str(src / SINGLE_FILE))
    _, lm = load(src, tiny_runtime(), mtp_depth=1)
    mtp = lm.mtp
    np.testing.assert_array_equal(np.asarray(mtp.fc.kernel[...]), tensors["mtp.fc.weight"].T)
    for name, attr in (("norm", "norm"), ("hidden", "pre_fc_norm_hidden"),
                       ("embedding", "pre_fc_norm_embedding")):
        hf = next(n for n, a in MTP_EXTRA.items() if a == name)
        np.testing.assert_array_equal(np.asarray(getattr(mtp, attr).weight[...]), tensors[hf])
    np.testing.assert_array_equal(np.asarray(mtp.layers[0].self_attn.o_proj.kernel[...]),
                                  tensors["mtp.layers.0.self_attn.o_proj.weight"].T)
    save(lm, cfg, tmp_path / "saved")
    saved = load_file(str(tmp_path / "saved" / SINGLE_FILE))
    assert saved.keys() == tensors.keys()
    for name, value in tensors.items():
        np.testing.assert_array_equal(saved[name], value, err_msg=name)
    _, plain = load(src, tiny_runtime())
    assert plain.mtp is None
    with pytest.raises(ValueError, match="missing tensor.*mtp.layers.1"):
        load(src, tiny_runtime(), mtp_depth=2)


def test_hf_mtp_refused_without_mtp_tensors(tmp_path):
    save(CausalLM(CONFIG, tiny_runtime(), rngs=nnx.Rngs(0)), CONFIG, tmp_path)
    with pytest.raises(ValueError, match="mtp_depth: Qwen3Config checkpoints carry no"):
        load(tmp_path, tiny_runtime(), mtp_depth=1)
