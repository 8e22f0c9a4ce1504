"""Tiny models and jitted helpers shared by model-level tests: tiny configs and models, jitted
log-prob and loss-and-gradient functions, tree-vs-baseline comparisons (layouts, log-probs, loss
and gradients), the float32 rounding model of sharded results, and the per-path inputs of dense
references."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import pytest
from flax import nnx
from hypothesis import assume

from jtree.config.architectures import (
    DeepseekV3Config,
    KimiLinearConfig,
    GptOssConfig,
    Llama3RopeScaling,
    LlamaConfig,
    NemotronHConfig,
    Qwen2Config,
    Qwen3_5Config,
    Qwen3_5MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
    YarnRopeScaling,
)
from jtree.config.objective import Objective
from jtree.config.runtime import RuntimeConfig
from jtree.kernels import TreeMask
from jtree.layout.baseline import linearize_baseline, unlinearize_baseline
from jtree.layout.batch import DeviceBatch, LossCoefficients
from jtree.layout.linearize import TreeBatch, linearize, unlinearize
from jtree.models import CausalLM
from jtree.objectives.objective import objective_loss
from jtree.step.train_step import make_logprob_fn


def tiny_runtime(**overrides) -> RuntimeConfig:
    """How the tests run models: the reference attention unless they say otherwise."""
    return RuntimeConfig(**dict(dict(attention_impl="reference"), **overrides))


def tiny_lm(config, seed: int = 0, **runtime) -> CausalLM:
    """A randomly initialized model of `config`, run by `tiny_runtime(**runtime)`."""
    return CausalLM(config, tiny_runtime(**runtime), rngs=nnx.Rngs(seed))


TINY_DENSE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  tie_word_embeddings=False, rope_theta=10_000.0)
# Llama 3's RoPE scaling at a scale tiny models reach: with head_dim 8 and theta 1e4 the
# wavelengths are 6.3, 63, 628 and 6283 positions, so against an original context of 100 (fast
# below 25, slow above 100) the first is kept, the second blended and the others slowed down.
TINY_LLAMA3_ROPE = Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=100)


def tiny_config(**overrides) -> Qwen3Config:
    return Qwen3Config(**dict(TINY_DENSE, **overrides))


def tiny_llama_config(**overrides) -> LlamaConfig:
    """A tiny Llama 3 with every option on: biases on attention and MLP, scaled RoPE."""
    return LlamaConfig(**dict(TINY_DENSE, attention_bias=True, mlp_bias=True,
                              rope_scaling=TINY_LLAMA3_ROPE, **overrides))


def tiny_qwen2_config(**overrides) -> Qwen2Config:
    return Qwen2Config(**dict(TINY_DENSE, **overrides))


# Tiny MoE / Qwen3-Next models that split 4 ways: 4 query heads over 2 kv heads, 8 experts, 4 GDN
# key heads with 2 value heads each. Layer 0 is MoE (Qwen3-Next: GDN + shared expert), layer 1
# attention + dense MLP; the router loss is on and weighs 0.5.
TINY_MOE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=(1,),
                router_aux_loss_coef=0.5, output_router_logits=True, tie_word_embeddings=False,
                rope_theta=10_000.0)
TINY_NEXT = dict(TINY_MOE, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8,
                 linear_value_head_dim=6, shared_expert_intermediate_size=24,
                 layer_types=("linear_attention", "full_attention"))


# Qwen3.5 (separate GDN projections): Qwen3-Next's tiny shapes with a MoE block in every layer
# (the MoE model) or a dense SwiGLU (the dense one, with attention biases on q/k/v/o too).
TINY_QWEN3_5_MOE = dict(TINY_NEXT, mlp_only_layers=(), partial_rotary_factor=0.5)
TINY_QWEN3_5 = {**{k: v for k, v in TINY_QWEN3_5_MOE.items() if k in {
    f.name for f in dataclasses.fields(Qwen3_5Config)}}, "attention_bias": True}


def tiny_qwen3_5_config(**overrides) -> Qwen3_5Config:
    return Qwen3_5Config(**dict(TINY_QWEN3_5, **overrides))


def tiny_qwen3_5_moe_config(**overrides) -> Qwen3_5MoeConfig:
    return Qwen3_5MoeConfig(**dict(TINY_QWEN3_5_MOE, **overrides))


# gpt-oss that splits 4 ways like TINY_MOE (4 query heads over 2 kv heads, 4 experts): layers
# [sliding (window 3), full], experts whose SwiGLU clamps at 1, YaRN RoPE blending some
# frequencies, the router loss on.
TINY_GPT_OSS = dict(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                    num_experts_per_tok=2, sliding_window=3, swiglu_limit=1.0,
                    router_aux_loss_coef=0.5, output_router_logits=True, rope_theta=100.0,
                    rope_scaling=YarnRopeScaling(factor=4.0, original_max_position_embeddings=64,
                                                 truncate=False))


def tiny_gpt_oss_config(**overrides) -> GptOssConfig:
    return GptOssConfig(**dict(TINY_GPT_OSS, **overrides))


# DeepSeek-V3 at test scale: a dense first layer and two DeepSeekMoE layers (8 experts in 4
# groups, 2 eligible, top 3, 2 shared), MLA with a query bottleneck, q/k heads of 16 + 8 (RoPE)
# features and value heads of 12, YaRN with mscale != mscale_all_dim.
TINY_DEEPSEEK_V3 = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2,
    num_experts=8, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12,
    qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=3,
    first_k_dense_replace=1, rope_theta=100.0,
    rope_scaling=YarnRopeScaling(factor=4.0, original_max_position_embeddings=16, mscale=1.0,
                                 mscale_all_dim=0.7))


def tiny_deepseek_v3_config(**overrides) -> DeepseekV3Config:
    return DeepseekV3Config(**dict(TINY_DEEPSEEK_V3, **overrides))


# Kimi-Linear's hybrid: KDA + dense, MLA (no RoPE) + DeepSeekMoE, KDA + DeepSeekMoE; 2 KDA
# heads of 8, 8 experts in 4 groups.
TINY_KIMI_LINEAR = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2,
    num_experts=8, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16,
    n_group=4, topk_group=2, num_experts_per_tok=3, linear_head_dim=8, linear_num_heads=2,
    layer_types=("linear_attention", "full_attention", "linear_attention"),
    mlp_layer_types=("dense", "sparse", "sparse"))


def tiny_kimi_linear_config(**overrides) -> KimiLinearConfig:
    return KimiLinearConfig(**dict(TINY_KIMI_LINEAR, **overrides))


def tiny_moe_config(**overrides) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(**dict(TINY_MOE, **overrides))


def tiny_next_config(**overrides) -> Qwen3NextConfig:
    return Qwen3NextConfig(**dict(TINY_NEXT, **overrides))


# Nemotron-H's four single-block layers (Mamba2, MoE, attention, MLP), 4 Mamba2 heads in 2
# groups, biases on the Mamba2 projections and conv, dt floored at 0.01; the MoE layer's 4
# squared-ReLU experts in 2 groups of which 1 is eligible, top 2, and a shared expert.
TINY_NEMOTRON_H = {
    "vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "intermediate_size": 48, "ssm_state_size": 8, "mamba_num_heads": 4,
    "mamba_head_dim": 6, "n_groups": 2, "conv_kernel": 4, "use_bias": True,
    "time_step_min": 0.01, "num_experts": 4, "n_group": 2, "topk_group": 1,
    "num_experts_per_tok": 2, "moe_intermediate_size": 16, "moe_shared_expert_intermediate_size": 24,
    "routed_scaling_factor": 2.0,
    "layers_block_type": ("linear_attention", "moe", "full_attention", "mlp")}


def tiny_nemotron_h_config(**overrides) -> NemotronHConfig:
    return NemotronHConfig(**{**TINY_NEMOTRON_H, **overrides})


def four_expert_config(kind: str, **overrides) -> Qwen3MoeConfig | Qwen3NextConfig:
    """The equivalence tests' smaller sparse models: `TINY_MOE` ("moe"), `TINY_NEXT` ("next")
    or `TINY_QWEN3_5_MOE` ("qwen3_5_moe"), the last two with 2 GDN key heads of 2 value heads
    each, cut to 4 experts."""
    if kind == "moe":
        return tiny_moe_config(num_experts=4, **overrides)
    make = tiny_next_config if kind == "next" else tiny_qwen3_5_moe_config
    return make(num_experts=4, linear_num_key_heads=2, linear_num_value_heads=4, **overrides)


@functools.lru_cache(maxsize=None)
def perturbed_moe_model(kind: str, **runtime):
    """(graphdef, params) of `four_expert_config(kind)` with every parameter perturbed by 0.2, so
    no term (router, shared expert, GDN decay) is negligible in a gradient comparison; run by
    `tiny_runtime(**runtime)`."""
    graphdef, params = nnx.split(tiny_lm(four_expert_config(kind), 0, **runtime))
    return graphdef, perturbed(params, scale=0.2)


def perturbed(params, scale: float = 0.1, seed: int = 1):
    """Noise on every weight, so that zero-initialized norms and near-uniform routers matter."""
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree_util.tree_leaves(params))))
    return jax.tree_util.tree_map(lambda x: x + scale * jax.random.normal(next(keys), x.shape),
                                  params)


def tiny_model(seed: int = 0, runtime: RuntimeConfig | None = None, **overrides):
    """(graphdef, params) of a randomly initialized tiny Qwen3 (run by `tiny_runtime()` unless
    `runtime` is given)."""
    return nnx.split(CausalLM(tiny_config(**overrides), runtime or tiny_runtime(),
                              rngs=nnx.Rngs(seed)))


@functools.lru_cache(maxsize=None)
def logprob_fn(graphdef):
    return jax.jit(make_logprob_fn(graphdef))


@functools.lru_cache(maxsize=None)
def loss_and_grad_fn(graphdef, objective: Objective):
    def f(params, inputs):
        return objective_loss(nnx.merge(graphdef, params), inputs, objective)[0]

    return jax.jit(jax.value_and_grad(f))


def scatter_paths(batch: TreeBatch, per_path: list[np.ndarray]) -> np.ndarray:
    """A [rows, S] array of a baseline batch set from one array per path (chains in order)."""
    arr = np.zeros(batch.shape, np.float32)
    for vals, r, off in zip(per_path, batch.layout.rows, batch.layout.offsets):
        arr[r, off : off + len(vals)] = vals
    return arr


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


def max_rel(a, b) -> float:
    """The largest element difference relative to the largest |b| (one wrong token shows)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12))


# float32's unit roundoff: the largest relative error of one rounding to nearest, 2^-24.
U32 = float(np.finfo(np.float32).eps) / 2

# The error model of comparisons between float32 computations of the same values that sum in
# different orders: a sharded (mesh, context-parallel) step or kernel against the single-device
# one. Neither float32 result is exact, so each is compared with the exact value, approximated by
# the single-device computation in float64 (whose own rounding, ~1e-16 relative, is nil here):
#     e = err(float32 result, float64 result),   e_ref = the same for the single-device float32
# (`err` a relative L2 norm per tensor, or per scalar). Both errors are rounding of one
# computation: to first order e = kappa * sum(delta_i) over the roundings delta_i (|delta_i| <=
# U32), kappa the computation's condition number, the same for both; the sharded one reorders
# the sums and adds a psum of at most 8 partial sums. So
#     e <= max(RATIO * e_ref, LAMBDA * sqrt(n) * U32),
# with n the number of terms of the longest sum (the step's tokens; a kernel's loss terms).
# - RATIO * e_ref carries kappa, measured on the machine the test runs on by the single-device
#   run: an ill-conditioned gradient has a large e_ref and may have as large an e. Splitting an
#   n-term sum into p partial sums and a p-term psum does not lengthen its longest chain of
#   additions (n/p + p <= n), so a reordered sum rounds like the original; what makes e larger
#   is the sharded algorithms' extra work (an 8-way context split composes GDN chunk maps across
#   devices and gathers the scoring halo). Measured e / e_ref on gradients: up to 1.6 over the
#   default mesh cases, 2.6 on the slow ones (Qwen3-Next PPO with a critic, context 8: the
#   embedding's gradient 5.4e-6 against 2.1e-6); RATIO = 4 leaves 1.5x room. Qwen3-Next's
#   GDN dt_bias gradient on the context-parallel PPO mesh (tests/step/test_mesh.py, AMD Zen 5):
#   e = 7.3e-6, e_ref = 6.7e-6, bound 2.7e-5, while the two float32 steps differ by 1.06e-5,
#   past the old round 1e-5. (Updated parameters have a model of their own:
#   `tests.mesh_worker.update_rounding`.)
# - LAMBDA * sqrt(n) * U32 is the probabilistic bound of an n-term float32 sum (Higham and Mary,
#   SIAM J. Sci. Comput. 2019: it holds with probability >= 1 - 2 exp(-LAMBDA^2 / 2), 0.9993 at
#   LAMBDA = 4) for a well-conditioned result (kappa ~ 1): 5.4e-6 at n = 512 tokens. It is the
#   floor for results whose single-device error is small by chance (a loss 2.9e-9 off float64
#   where the mesh's is 1.1e-7, MoE PPO) while the sharded one rounds like an n-term sum.
# A dropped halo or a wrong sign moves results by far more (1e-3 and up; see the tests' module
# docstrings), orders of magnitude past either term.
ROUNDING_RATIO = 4.0
ROUNDING_LAMBDA = 4.0


def rounding_bound(ref_error: float, n: int) -> float:
    """The largest error against the float64 value the model allows a float32 result whose
    single-device float32 counterpart is `ref_error` from it, the longest sum having `n` terms."""
    return max(ROUNDING_RATIO * ref_error, ROUNDING_LAMBDA * math.sqrt(n) * U32)


def worst_rounding(got: dict[str, Any], ref: dict[str, Any], exact: dict[str, Any], n: int,
                   err: Callable[[Any, Any], float] = rel_l2) -> dict[str, Any]:
    """Of the named float32 results `got` (sharded) and `ref` (single-device) and their float64
    values `exact`, the one farthest past `rounding_bound`: its name, error, single-device error,
    bound and `excess` = error / bound (<= 1: within the error model)."""
    worst = {"excess": 0.0}
    for name, want in exact.items():
        error, ref_error = err(got[name], want), err(ref[name], want)
        bound = rounding_bound(ref_error, n)
        if error / bound >= worst["excess"]:
            worst = {"name": name, "error": error, "ref_error": ref_error, "bound": bound,
                     "excess": error / bound}
    return worst


def assert_grads_close(got, want, tol: float = 1e-5, floor: float = 1e-6) -> None:
    """Every leaf within `tol` relative L2 of `want`'s leaf, or within `floor` of the whole
    gradient's norm. Float32 rounding of the sums leaves ~2e-7 of the whole norm in every leaf
    (measured on tiny random forests: 1.5-2.4e-7 for tree vs baseline, and the same for the
    dense reference vs baseline), which exceeds 1e-5 of a leaf whose gradient nearly cancels (a
    k-norm weight when each query sees one to three keys)."""
    leaves = jax.tree_util.tree_leaves(want)
    total = float(np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in leaves)))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), leaves):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        err = float(np.linalg.norm(a - b))
        assert err <= max(tol * float(np.linalg.norm(b)), floor * total), (
            jax.tree_util.keystr(path), err, float(np.linalg.norm(b)), total)


def off_policy_ppo_inputs(params, graphdef, tree: TreeBatch, base: TreeBatch, seed: int):
    """Tree and baseline inputs with the same old/ref log-probs per path token, both off the
    current policy (so the PPO clip really acts), set on the tree and copied to every path."""
    rng = np.random.default_rng(seed)
    cur = np.asarray(logprob_fn(graphdef)(params, tree.inputs))
    old = (cur + rng.normal(0, 0.3, cur.shape)).astype(np.float32)
    ref = (cur + rng.normal(0, 0.3, cur.shape)).astype(np.float32)
    tree_in = tree.inputs.with_coefficients(old_logprobs=old, ref_logprobs=ref)
    base_in = base.inputs.with_coefficients(**{
        name: scatter_paths(base, [p for t in unlinearize(tree, x) for p in t])
        for name, x in (("old_logprobs", old), ("ref_logprobs", ref))})
    return tree_in, base_in


def assert_loss_and_grads_match(graphdef, params, tree_in, base_in, objective: Objective) -> None:
    """Tree loss == baseline loss and every parameter gradient within 1e-5 relative L2."""
    fn = loss_and_grad_fn(graphdef, objective)
    loss_t, g_t = fn(params, tree_in)
    loss_b, g_b = fn(params, base_in)
    if objective.kind == "sft":  # a sum of same-sign terms: plain relative difference
        assert float(loss_t) == pytest.approx(float(loss_b), rel=1e-6, abs=1e-9)
    else:
        # The surrogate of mixed-sign advantages cancels, so a 1-ulp log-prob difference can be a
        # large fraction of a near-zero loss; measure relative to the loss scale sum(|W|+|P|+|N|).
        c = tree_in.coefficients
        scale = sum(float(np.abs(x).sum()) for x in (c.weight, c.adv_pos, c.adv_neg))
        assert abs(float(loss_t) - float(loss_b)) <= 1e-6 * max(abs(float(loss_b)), scale)
    assert_grads_close(g_t, g_b)


# The equivalence tests' layouts: rows of 64 tokens, 3 rows in tree mode and 40 for the per-path
# baseline (a row per path at most).
EQUIVALENCE_SEQ, EQUIVALENCE_TREE_ROWS, EQUIVALENCE_BASE_ROWS = 64, 3, 40


def tree_and_baseline(trees, normalization: str,
                      gdn_chunk_size: int | None = None) -> tuple[TreeBatch, TreeBatch]:
    """(tree batch, baseline batch) of `trees` in the equivalence tests' layouts; with
    `gdn_chunk_size`, GDN chunk tables of chunks that many tokens long on both sides."""
    gdn = {} if gdn_chunk_size is None else dict(gdn_chunk_size=gdn_chunk_size,
                                                 gdn_chunks=EQUIVALENCE_SEQ)
    tree = linearize(trees, EQUIVALENCE_SEQ, normalization=normalization,
                     n_rows=EQUIVALENCE_TREE_ROWS, **gdn)
    base = linearize_baseline(trees, EQUIVALENCE_SEQ, normalization=normalization,
                              n_rows=EQUIVALENCE_BASE_ROWS, **gdn)
    return tree, base


def path_logprob_pairs(graphdef, params, trees, tree: TreeBatch,
                       base: TreeBatch) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every path of `trees`: (its log-probs read from the tree batch, from the baseline)."""
    fn = logprob_fn(graphdef)
    lp_tree = unlinearize(tree, np.asarray(fn(params, tree.inputs)))
    lp_base = unlinearize_baseline(base, np.asarray(fn(params, base.inputs)), trees)
    return [(a, b) for a_paths, b_paths in zip(lp_tree, lp_base)
            for a, b in zip(a_paths, b_paths)]


def assert_logprobs_equal_baseline(graphdef, params, trees, tree: TreeBatch,
                                   base: TreeBatch) -> None:
    """Every path's tree log-probs within 1e-5 of the baseline's."""
    for a, b in path_logprob_pairs(graphdef, params, trees, tree, base):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def assert_equal_baseline_under_ppo(graphdef, params, trees) -> None:
    """Tree log-probs, PPO loss and gradients == the per-path baseline's."""
    tree, base = tree_and_baseline(trees, "seq_mean_token_mean")
    assert_logprobs_equal_baseline(graphdef, params, trees, tree, base)
    tree_in, base_in = off_policy_ppo_inputs(params, graphdef, tree, base, seed=len(trees))
    # A forest that scores no token (one-token paths) trains nothing: its only loss is a MoE
    # router's, which on a single token is constant when the router normalizes over the chosen
    # experts (gpt-oss), so both gradients are float32 rounding alone (~1e-7) and no relative
    # comparison means anything. The router loss on real forests is compared in every other draw.
    c = tree_in.coefficients
    assume(any(np.abs(x).sum() > 0 for x in (c.weight, c.adv_pos, c.adv_neg)))
    objective = Objective(kind="ppo", clip_low=0.2, clip_high=0.28, kl_coef=0.05,
                          entropy_coef=0.01)
    assert_loss_and_grads_match(graphdef, params, tree_in, base_in, objective)


def path_inputs(tokens: list[np.ndarray], length: int) -> DeviceBatch:
    """Each path alone in its own row: plain causal attention over its tokens, padding after (the
    inputs of the dense per-path references the training tests compare a run's step with)."""
    k = len(tokens)
    arrays = {n: np.zeros((k, length), np.int32) for n in ("tokens", "pos", "path_count")}
    end = np.tile(np.arange(1, length + 1, dtype=np.int32), (k, 1))
    pred = np.full((k, length), -1, np.int32)
    node = np.full((k, length), -1, np.int32)
    valid = np.zeros((k, length), bool)
    for i, t in enumerate(tokens):
        n = len(t)
        arrays["tokens"][i, :n], arrays["pos"][i, :n], arrays["path_count"][i, :n] = \
            t, np.arange(n), 1
        end[i, :n], pred[i, 1:n], node[i, :n], valid[i, :n] = n, np.arange(n - 1), 0, True
    zeros = np.zeros((k, length), np.float32)
    return DeviceBatch(arrays["tokens"], arrays["pos"], TreeMask(end), pred, node, valid,
                       arrays["path_count"], LossCoefficients(*[zeros] * 6))
