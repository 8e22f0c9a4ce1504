"""Run one train step on several meshes of 8 forced host devices and compare with one device.

Run in a subprocess (`tests/step/test_mesh.py`): XLA_FLAGS must be set before jax creates its CPU
(model `dense`, `moe`, `next`, `llama`, `qwen2`, `qwen3_5`, `qwen3_5_moe`, `gpt_oss`,
`deepseek_v3`, `nemotron_h` or `kimi_linear`; `dense_lora`: `dense` training LoRA adapters;
`dense_critic` and
`dense_critic_model`: `dense` with PPO's critic, a value head or a separate smaller critic model;
mesh data x fsdp x model, or data x fsdp x context x model; mode `cp`: the context-parallel trees
of `cp_inputs`; objective `sft`, `ppo`, and with mode `cp` also `gspo` and `critic`: PPO with a
value head). Prints one JSON line per case with the largest relative differences to the single-device
step: loss, gradient norm, per-parameter gradients (Adam's first moment after one step, i.e. the
clipped gradient scaled by 1 - b1), updated parameters and their updates, and how many parameters
the mesh shards over `model` and over `fsdp`; and, in `rounding`, for each kind of result the one
farthest past its error model against the single-device step in float64 (what the test checks).

Compiles dominate the cost (two per case, ~10 s each at XLA's default backend optimization), so the
worker compiles as the test session does (the XLA_FLAGS it inherits: `tests.run_util.
CODEGEN_XLA_FLAGS`; both sides of every comparison use the same flags) and computes the
single-device reference (float32 and float64: one compile more) once per model, mode and objective
rather than once per mesh.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from typing import Any

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from jtree.layout.baseline import flatten_paths, linearize_baseline  # noqa: E402
from jtree.layout.batch import DeviceBatch, stack  # noqa: E402
from jtree.training.checkpoint import Checkpointer, abstract_like  # noqa: E402
from jtree.parallel.context import context_batch  # noqa: E402
from jtree.config.objective import CriticConfig, OffPolicyConfig
from jtree.objectives.pairs import path_pairs, with_pairs
from jtree.parallel.layer_stack import convert_tree, layer_groups  # noqa: E402
from jtree.layout.linearize import linearize  # noqa: E402
from jtree.layout.coefficients import batch_normalizer
from jtree.config.runtime import RuntimeConfig
from jtree.models import create_model
from jtree.config.model import LoraConfig
from jtree.models.lora import LoraParams, attach, lora_specs, trainable
from jtree.layout.microbatches import unit_counts  # noqa: E402
from jtree.layout.planner import LayoutConfig, plan_step  # noqa: E402
from jtree.config.run import MeshConfig
from jtree.parallel.sharding import make_mesh, named, param_rules, param_specs
from jtree.config.objective import Objective, OptimConfig
from jtree.step.optimizer import TrainState, make_optimizer, state_shardings
from jtree.step.train_step import (
    make_logprob_fn, make_sharded_grad_fn, make_sharded_logprob_fn, make_train_step, sharded_graphdef,
)
from tests.models_util import (  # noqa: E402
    U32, max_rel, perturbed, rel_l2, tiny_config, tiny_deepseek_v3_config, tiny_gpt_oss_config,
    tiny_kimi_linear_config, tiny_llama_config, tiny_moe_config, tiny_nemotron_h_config,
    tiny_next_config,
    tiny_qwen2_config, tiny_qwen3_5_config, tiny_qwen3_5_moe_config, tiny_runtime,
    worst_rounding,
)
from tests.strategies import explicit_tree, random_forest, sequences_tree  # noqa: E402
from jtree.trees.tree import TrajectoryTree  # noqa: E402

# Adam's eps at 1e-6, not 1e-8: the first update is g / (|g| + eps) per entry, so an entry
# whose gradient is ~0 in one run and ~1e-9 of rounding in the other (an MoE expert's rows
# few tokens reach) moves by a tenth of the learning rate (at 1e-8, by all of it). The gradients
# are compared directly; the updates by `update_rounding`, which carries such moves over from
# the gradients' errors. No warmup: the first step runs at the peak rate.
OPTIM = OptimConfig(learning_rate=1e-3, warmup_steps=0, decay_steps=10, eps=1e-6)
S, ROWS, GDN_CHUNK = 64, 8, 4
CP_ROWS = 4  # rows of each micro-batch of the context-parallel batch
# Kinds whose sharded step runs another attention kernel than their single-device reference.
MESH_IMPL = {"dense_tpu": "pallas_tpu"}
# Objectives `tis` and `seq_tis`: PPO and GSPO with truncated importance weights for the
# engine-vs-trainer gap (`jtree.objectives.off_policy`: pairs split over the rows like the
# critic's, whole on every device of the context axis).
OFF_POLICY = {"tis": ("ppo", OffPolicyConfig(kind="tis", cap=2.0)),
              "seq_tis": ("gspo", OffPolicyConfig(kind="seq_tis", cap=1.5))}


def case_model(kind: str) -> tuple[str, Any, RuntimeConfig]:
    """(architecture, config, runtime) of the tiny `dense`, `moe` or `next` model; `dense_cpu` is
    `dense` with the C++ `cpu` attention kernel (an XLA custom call inside shard_map);
    `dense_xla` is `dense` with the block-sparse `xla` kernel; `dense_tpu` is `dense` at head_dim 64 (what the Pallas TPU kernel tiles) with an `xla`
    reference step, whose sharded step runs the Pallas TPU kernel (`MESH_IMPL`) in the TPU
    interpreter; `dense_lora` is `dense` training LoRA adapters; `dense_scan` is `dense` with
    its layers scanned (stacked parameters split per layer); `moe_a2a` and `next_a2a` run
    their experts with token dispatch (`expert_dispatch="all_to_all"`); `dense_critic*` are
    `dense` (their critic: `case_critic`); `llama` (Llama 3 with attention and MLP biases and
    scaled RoPE) and `qwen2` (q/k/v biases, no q/k norm) are the other dense architectures;
    `qwen3_5` and `qwen3_5_moe` are Qwen3.5 (Qwen3-Next's hybrid with separate GDN projections),
    dense and MoE; `gpt_oss` (`gpt_oss_a2a`: token dispatch) is gpt-oss (sliding-window and
    full layers with sinks, experts with biases and the clamped SwiGLU) on the block-sparse
    `xla` kernel, whose block tables skip what the windows exclude; `deepseek_v3`
    (`deepseek_v3_a2a`: token dispatch) is DeepSeek-V3 (MLA with value heads narrower than q/k
    heads, DeepSeekMoE) on the `xla` kernel; `nemotron_h` (`nemotron_h_a2a`: token dispatch) is
    Nemotron-H (Mamba2, MoE, attention and MLP single-block layers); `kimi_linear` is Kimi-Linear
    (KDA and MLA without RoPE, DeepSeekMoE) on the `xla` kernel."""
    dispatch = "all_to_all" if kind.endswith("_a2a") else "psum"
    if kind in ("dense", "dense_cpu", "dense_tpu", "dense_lora", "dense_scan", "dense_xla",
                "dense_critic", "dense_critic_model"):
        impl = {"dense_cpu": "cpu", "dense_tpu": "xla", "dense_xla": "xla"}.get(kind, "reference")
        head_dim = {"dense_tpu": 64}.get(kind, 8)
        return ("qwen3", tiny_config(num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                     head_dim=head_dim),
                tiny_runtime(attention_impl=impl, scan_layers=kind == "dense_scan"))
    if kind in ("moe", "moe_a2a"):
        return "qwen3_moe", tiny_moe_config(), tiny_runtime(expert_dispatch=dispatch)
    if kind == "llama":
        return "llama", tiny_llama_config(vocab_size=64), tiny_runtime()
    if kind == "qwen2":
        return "qwen2", tiny_qwen2_config(vocab_size=64), tiny_runtime()
    if kind == "qwen3_5":
        return "qwen3_5", tiny_qwen3_5_config(), tiny_runtime()
    if kind in ("gpt_oss", "gpt_oss_a2a"):
        return "gpt_oss", tiny_gpt_oss_config(), tiny_runtime(attention_impl="xla",
                                                              expert_dispatch=dispatch)
    if kind == "qwen3_5_moe":
        return "qwen3_5_moe", tiny_qwen3_5_moe_config(), tiny_runtime(expert_dispatch=dispatch)
    if kind in ("deepseek_v3", "deepseek_v3_a2a"):
        return "deepseek_v3", tiny_deepseek_v3_config(), tiny_runtime(attention_impl="xla",
                                                                      expert_dispatch=dispatch)
    if kind in ("nemotron_h", "nemotron_h_a2a"):
        return "nemotron_h", tiny_nemotron_h_config(), tiny_runtime(expert_dispatch=dispatch)
    if kind == "kimi_linear":
        return "kimi_linear", tiny_kimi_linear_config(), tiny_runtime(attention_impl="xla")
    return "qwen3_next", tiny_next_config(), tiny_runtime(expert_dispatch=dispatch)


def case_critic(kind: str) -> CriticConfig | None:
    """PPO's critic of model `kind`: a value head (`dense_critic`), a separate critic model of
    another size (`dense_critic_model`, its own tensor-parallel and FSDP layout), else none."""
    if kind == "dense_critic":
        return CriticConfig(gamma=0.9, lam=0.8)
    if kind == "dense_critic_model":
        network = tiny_config(num_attention_heads=4, num_key_value_heads=4, vocab_size=64,
                              head_dim=4, hidden_size=16, num_hidden_layers=1)
        return CriticConfig(gamma=0.9, lam=0.8, model="separate", network=network)
    return None


def step_inputs(mode: str, objective: Objective, gdn: bool) -> DeviceBatch:
    """Two micro-batches of branching trees, raw coefficients plus per-row normalizer shares
    (the form `jtree.training.pipeline` produces), GDN chunk tables sized as the pipeline sizes them; with a
    critic (rewards) or off-policy weights, the pairs (one width for both micro-batches)."""
    rng = np.random.default_rng(7)
    forests = [random_forest(rng, max_nodes=8) for _ in range(10)]
    if objective.critic is not None:
        for f in forests:
            f["rewards"] = rng.normal(size=len(f["path_nodes"])).tolist()
    trees = [(explicit_tree if i % 2 else sequences_tree)(f) for i, f in enumerate(forests)]
    fn = linearize if mode == "tree" else linearize_baseline
    parts = (trees[:5], trees[5:])
    kw = {}
    if gdn:
        layout = LayoutConfig(S, micro_batches=None, rows=ROWS, gdn_chunk_size=GDN_CHUNK)
        units = [p if mode == "tree" else flatten_paths(p) for p in parts]
        plans = [plan_step([u.n_tree_tokens for u in us], layout, **unit_counts(us, GDN_CHUNK))
                 for us in units]  # each micro-batch's rows as linearize packs them
        kw = dict(gdn_chunk_size=GDN_CHUNK, gdn_chunks=max(p.gdn_chunks for p in plans))
    out = []
    batches = [fn(part, S, normalization=objective.normalization, normalizer=1.0, n_rows=ROWS,
                  **kw) for part in parts]
    if objective.critic is not None or objective.off_policy.enabled:
        kinds = dict(critic=objective.critic is not None, off_policy=objective.off_policy.enabled)
        width = max(path_pairs(b, **kinds).index.shape[-1] for b in batches)
        batches = [with_pairs(b, width, **kinds) for b in batches]
    for part, b in zip(parts, batches):
        row_norm = np.zeros(ROWS, np.float32)
        row_norm[0] = batch_normalizer(part, objective.normalization)
        out.append(dataclasses.replace(b.inputs, row_norm=row_norm))
    return stack(out)


def chain_tree(rng: np.random.Generator) -> TrajectoryTree:
    """A deep chain of 12 nodes of 5 tokens (60 tokens: it crosses every boundary of a 64-token
    row split over up to 8 devices), paths ending at its leaf and at an internal node, and a
    last child of the root laid out after the chain: its first token, at position 60, is scored
    by the root's last token, 7 devices back at context 8 (3 back at 4)."""
    parents = [-1] + list(range(11)) + [0]
    seg = [5] * 12 + [3]
    path_nodes = [11, 12, 5]
    lengths = [60, 8, 30]
    return TrajectoryTree.from_nodes(
        parents=parents, segments=[rng.integers(0, 64, size=k).tolist() for k in seg],
        path_nodes=path_nodes,
        loss_masks=[(rng.random(n) < 0.8).astype(int).tolist() for n in lengths],
        weights=rng.uniform(0.5, 2.0, size=3).tolist(),
        advantages=[rng.normal(size=n).tolist() for n in lengths],
        old_logprobs=[(-rng.uniform(0.5, 6.0, size=n)).tolist() for n in lengths],
        rewards=rng.normal(size=3).tolist())


def cp_inputs(objective: Objective, gdn: bool) -> DeviceBatch:
    """Two micro-batches of CP_ROWS even-split rows (a valid context-parallel layout): the deep
    chain of `chain_tree` in each, and random multi-level forests (siblings, paths ending at
    internal nodes) filling the rows, so nodes are cut by every device boundary; one reward per
    path and the pairs when the objective has a critic or off-policy weights; raw coefficients with per-row
    normalizer shares; `score_index` on; with `gdn`, one-device GDN chunk tables (the mesh
    rebuilds them per device). The single-device reference runs it as it is, the mesh laid out
    for its context size (`context_batch`)."""
    rng = np.random.default_rng(11)
    batches = []
    for _ in range(2):
        trees = [chain_tree(rng)]
        for _ in range(40):
            kwargs = random_forest(rng, max_nodes=10, max_seg=9)
            tree = TrajectoryTree.from_nodes(
                **kwargs, rewards=rng.normal(size=len(kwargs["path_nodes"])).tolist())
            if linearize(trees + [tree], S).shape[0] <= CP_ROWS:
                trees.append(tree)
        b = linearize(trees, S, normalization=objective.normalization, normalizer=1.0,
                      n_rows=CP_ROWS, score_len=S, gdn_chunk_size=GDN_CHUNK if gdn else None,
                      gdn_chunks=S if gdn else None)
        row_norm = np.zeros(CP_ROWS, np.float32)
        row_norm[0] = batch_normalizer(trees, objective.normalization)
        batches.append((b, row_norm))
    if objective.critic is not None or objective.off_policy.enabled:  # one pair width for both
        kinds = dict(critic=objective.critic is not None, off_policy=objective.off_policy.enabled)
        width = max(path_pairs(b, **kinds).index.shape[1] for b, _ in batches)
        batches = [(with_pairs(b, width, **kinds), norm) for b, norm in batches]
    return stack([dataclasses.replace(b.inputs, row_norm=norm) for b, norm in batches])


def restore_on_other_meshes(cfg, params, opt, directory: str) -> dict:
    """Save a sharded TrainState from a (data, fsdp, model) = (2, 2, 2) mesh, restore it onto
    (2, 1, 4), (8, 1, 1) and (1, 8, 1): tensor parallel and FSDP layouts both change; then
    scanned (stacked layers) onto (1, 4, 2), whose save restores unscanned onto (8, 1, 1)."""
    def sharded_state(data: int, fsdp: int, model_size: int):
        mesh = make_mesh(MeshConfig(data=data, fsdp=fsdp, model=model_size))
        specs = param_specs(params, param_rules(cfg, model_size), mesh)
        shardings = state_shardings(opt, params, named(mesh, specs), mesh)
        return shardings

    saved_sh = sharded_state(2, 2, 2)
    state = jax.device_put(TrainState(params, opt.init(params), np.int32(5)), saved_sh)
    ckpt = Checkpointer(directory, keep=1)
    ckpt.save(5, state, {"next_index": 5}, {"seed": 0})
    ckpt.wait()
    result = {"case": "restore", "equal": True, "resharded": True}
    for shape in ((2, 1, 4), (8, 1, 1), (1, 8, 1)):
        target = sharded_state(*shape)
        out = ckpt.restore(5, abstract_like(state, target))
        restored = out.state
        result["equal"] &= out.data_state == {"next_index": 5} and int(restored.step) == 5
        for a, b, sh in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(state),
                            jax.tree_util.tree_leaves(target)):
            result["equal"] &= bool(np.array_equal(np.asarray(a), np.asarray(b)))
            result["resharded"] &= a.sharding == sh
    # The same checkpoint into the scanned layout (stacked layers) on (1, 4, 2), saved so and
    # restored unscanned on (8, 1, 1).
    groups = layer_groups(cfg.decoder().layers)
    scanned = convert_tree(state, groups, scanned=True)
    mesh = make_mesh(MeshConfig(data=1, fsdp=4, model=2))
    stacked = scanned.params
    target = state_shardings(opt, stacked, named(mesh, param_specs(stacked, param_rules(cfg, 2),
                                                                   mesh)), mesh)
    for step, want, shardings in ((5, scanned, target), (6, state, sharded_state(8, 1, 1))):
        restored = ckpt.restore(step, abstract_like(want, shardings), layer_groups=groups).state
        for a, b, sh in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(want),
                            jax.tree_util.tree_leaves(shardings)):
            result["equal"] &= bool(np.array_equal(np.asarray(a), np.asarray(b)))
            result["resharded"] &= a.sharding == sh
        if step == 5:
            ckpt.save(6, restored, {"next_index": 5}, {"seed": 0})
            ckpt.wait()
    ckpt.close()
    return result


def reference_step(model_kind: str, mode: str, kind: str, opt) -> dict[str, Any]:
    """The single-device step every mesh of this (model, mode, objective) is compared with."""
    arch, cfg, runtime = case_model(model_kind)
    critic = case_critic(model_kind)
    if kind == "critic":  # the context-parallel cases' objective: PPO with a value head
        critic = CriticConfig(gamma=0.95, lam=0.9, value_coef=0.5)
    model = create_model(arch, cfg, runtime, seed=3,
                         value_head=critic is not None and not critic.separate,
                         critic=critic.network if critic is not None else None)
    graphdef, params = nnx.split(model)
    if model_kind == "dense_lora":  # column- and row-parallel kernels and the vocab-split head
        lora = LoraConfig(rank=2, alpha=4.0, targets=("self_attn/(q|k|o)_proj", "mlp", "lm_head"))
        params = attach(params, lora, jax.random.key(0))
    if model_kind != "dense":
        params = perturbed(params)  # with LoRA, B != 0: A's gradients too are non-zero
    base, off_policy = OFF_POLICY.get(kind, (kind, OffPolicyConfig()))
    objective = Objective(kind="ppo" if kind == "critic" else base,
                          normalization="token_mean" if kind == "sft" else "seq_mean_token_mean",
                          critic=critic, off_policy=off_policy)
    if mode == "cp":
        inputs = cp_inputs(objective, cfg.decoder().needs_gdn_tables)
    else:
        inputs = step_inputs(mode, objective, cfg.decoder().needs_gdn_tables)
    if kind != "sft":
        rng = np.random.default_rng(1)
        inputs = inputs.with_coefficients(
            old_logprobs=(-rng.uniform(0.5, 5.0, inputs.shape)).astype(np.float32))
    state = TrainState(params, opt.init(trainable(params)), np.int32(0))
    ref_state, ref_metrics = jax.jit(make_train_step(graphdef, opt, objective))(state, inputs)
    ref = dict(arch=arch, cfg=cfg, model=model, params=params, objective=objective,
               inputs=inputs, state=ref_state, metrics=ref_metrics)
    # Context-parallel PPO recomputes the old log-probs over the mesh (`compare_on_mesh`): their
    # single-device values, once (not for the Pallas TPU case, which checks only its step).
    if mode == "cp" and kind == "ppo" and model_kind not in MESH_IMPL:
        ref["logprobs"] = np.asarray(stacked_logprobs(graphdef, params, inputs))
    return ref | {"exact": exact_step(ref, runtime, critic, opt)}


def stacked_logprobs(graphdef: nnx.GraphDef, params: Any, inputs: DeviceBatch) -> jax.Array:
    """The single-device token log-probs of every micro-batch of `inputs`."""
    one = make_logprob_fn(graphdef)
    return jax.jit(lambda p, x: jax.lax.map(lambda m: one(p, m), x))(params, inputs)


def as_float64(params: Any) -> Any:
    """`params` in float64 (the same values), a LoRA run's recorded dtypes too (its merge casts
    the base to them)."""
    params = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), params)
    if isinstance(params, LoraParams):
        params = dataclasses.replace(params, dtypes=("float64",) * len(params.dtypes))
    return params


def exact_step(ref: dict[str, Any], runtime: RuntimeConfig, critic: CriticConfig | None,
               opt) -> dict[str, Any]:
    """The reference step again in float64, from the same parameters and inputs: the exact
    values the float32 steps' rounding is measured against (`tests.models_util.worst_rounding`).
    It runs the `reference` attention (the float32 runs' kernels compute the same values, in
    float32 only). State, metrics and (where the reference has them) log-probs as numpy arrays,
    and the float64 initial parameters."""
    with jax.enable_x64(True):
        runtime = dataclasses.replace(runtime, dtype="float64", param_dtype="float64",
                                      attention_impl="reference")
        model = create_model(ref["arch"], ref["cfg"], runtime, seed=3,
                             value_head=critic is not None and not critic.separate,
                             critic=critic.network if critic is not None else None)
        graphdef = nnx.split(model)[0]
        params = as_float64(ref["params"])
        state = TrainState(params, opt.init(trainable(params)), np.int32(0))
        new_state, metrics = jax.jit(make_train_step(graphdef, opt, ref["objective"]))(
            state, ref["inputs"])
        exact = {"params": params, "state": jax.tree_util.tree_map(np.asarray, new_state),
                 "metrics": jax.tree_util.tree_map(np.asarray, metrics)}
        if "logprobs" in ref:
            exact["logprobs"] = np.asarray(stacked_logprobs(graphdef, params, ref["inputs"]))
    return exact


def model_base(params: Any) -> Any:
    """The frozen part of a LoRA run's parameters (nothing for a run that trains all)."""
    return params.base if isinstance(params, LoraParams) else ()


def split_over(array: jax.Array, axis: str) -> bool:
    """Whether `array` is split over mesh axis `axis` (alone or with others on one dimension)."""
    return any(axis == entry or (isinstance(entry, tuple) and axis in entry)
               for entry in array.sharding.spec)


def named_leaves(tree: Any) -> dict[str, np.ndarray]:
    """The leaves of `tree` by their paths, as numpy arrays."""
    return {jax.tree_util.keystr(path): np.asarray(x)
            for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def adam_direction(mu: np.ndarray, optim: OptimConfig) -> np.ndarray:
    """AdamW's first update over -learning rate (without weight decay), in float64, from the
    first moment `mu`: g / (|g| + eps), g = mu / (1 - b1) the clipped gradient (after one step
    the bias-corrected moments are g and g^2)."""
    g = np.asarray(mu, np.float64) / (1 - optim.b1)
    return g / (np.abs(g) + optim.eps)


def update_rounding(state: TrainState, exact: TrainState, initial: Any,
                    optim: OptimConfig = OPTIM) -> dict[str, Any]:
    """The trained parameters' update (new - initial) against the float64 step's, per parameter,
    after one step of `optim` (no warmup), with the error model of an update (which is the
    updated parameters' error too): the one-step AdamW update is a function of the gradient
    alone, lr * (g / (|g| + eps) + decay * p), so its error is the gradient's error carried
    through that function (computed in float64 from the two first moments) plus its own float32
    rounding: at most twelve U32 of each entry (the first moment and its bias correction, whose
    float32 1 - 0.9 is 4 U32 off 0.1; the second moment's square, two products and square root;
    + eps, the division, lr; the decay is 0 here) and one U32 of the new parameter (stored in
    float32). Adam amplifies the error of an entry whose gradient is near eps by up to 1 / eps,
    which no reduction-order model of the update itself bounds (on a 4 x 2 mesh, MoE's q_proj
    update was 4.1x as far from float64 as the single device's, 2e-5 relative), whereas the
    gradients it comes from are checked by `worst_rounding`. Where the carried error dominates,
    error / bound is close to (and below) 1 by construction: measured up to 0.97. The worst
    parameter: its name, relative error, relative bound and `excess` = error / bound (<= 1:
    within the model)."""
    mu, mu_exact = (named_leaves(optax.tree_utils.tree_get(s.opt_state, "mu"))
                    for s in (state, exact))
    new, new_exact, start = (named_leaves(trainable(p)) for p in (
        state.params, exact.params, initial))
    worst = {"excess": 0.0}
    for name, want in new_exact.items():
        update, update_exact = (np.asarray(p, np.float64) - start[name] for p in (new[name], want))
        carried = optim.learning_rate * np.linalg.norm(
            adam_direction(mu[name], optim) - adam_direction(mu_exact[name], optim))
        rounding = U32 * (12 * np.linalg.norm(update_exact) + np.linalg.norm(want))
        scale = max(float(np.linalg.norm(update_exact)), 1e-30)
        error, bound = float(np.linalg.norm(update - update_exact)), float(carried + rounding)
        if error / bound >= worst["excess"]:
            worst = {"name": name, "error": error / scale, "bound": bound / scale,
                     "excess": error / bound}
    return worst


def compare_on_mesh(case: str, ref: dict[str, Any], opt) -> dict[str, Any]:
    """One sharded step on the case's mesh (the first D x F x [C x] M devices), with its largest
    relative differences to `ref`."""
    sizes = [int(x) for x in case.split(":")[3].split("x")]
    data, fsdp, context, model_size = sizes if len(sizes) == 4 else (sizes[0], sizes[1], 1,
                                                                     sizes[2])
    params, objective, model = ref["params"], ref["objective"], ref["model"]
    mesh = make_mesh(MeshConfig(data=data, fsdp=fsdp, context=context, model=model_size),
                     jax.devices()[:data * fsdp * context * model_size])
    network = model.critic.config if model.critic is not None else None
    rules = param_rules(ref["cfg"], model_size, critic=network)
    specs, step_specs = lora_specs(params, rules, mesh)
    sharded_params = jax.device_put(params, named(mesh, specs))
    impl = MESH_IMPL.get(case.split(":")[0])
    interpret = contextlib.nullcontext()
    if impl is not None:
        model = create_model(ref["arch"], ref["cfg"],
                             dataclasses.replace(model.runtime, attention_impl=impl), seed=3)
        interpret = pltpu.force_tpu_interpret_mode()
    model_specs = param_specs(nnx.split(model)[1], rules, mesh)
    graphdef = sharded_graphdef(model, model_specs, mesh)
    grad_fn = make_sharded_grad_fn(graphdef, objective, mesh, step_specs)
    shardings = state_shardings(opt, params, named(mesh, specs), mesh)
    step = jax.jit(make_train_step(graphdef, opt, objective, grad_fn=grad_fn),
                   out_shardings=(shardings, None))
    inputs = ref["inputs"] if context == 1 else context_batch(
        ref["inputs"], context, conv_kernel=getattr(ref["cfg"], "linear_conv_kernel_dim", None))
    with interpret:
        new_state, metrics = step(
            TrainState(sharded_params, opt.init(trainable(sharded_params)), np.int32(0)),
            inputs)
    ref_state, ref_metrics = ref["state"], ref["metrics"]
    leaves = jax.tree_util.tree_leaves
    held = leaves((new_state.params, new_state.opt_state))
    extra = {}
    exact = ref["exact"]
    # The old comparisons with the single-device float32 step are reported (`*_rel*`); the
    # checks hold each float32 result to the error model against the float64 step (`rounding`,
    # one worst result per kind). The longest sums of the step run over all its tokens.
    n = int(np.prod(ref["inputs"].shape))
    rounding = {}
    # Old log-probs recomputed over the mesh (not for the Pallas TPU case, which checks the
    # kernel's step in its interpreter and nothing else: the reference has none).
    if "logprobs" in ref:
        logprob = np.asarray(jax.jit(make_sharded_logprob_fn(graphdef, mesh, step_specs))(
            sharded_params, inputs))
        extra["logprobs_rel"] = max_rel(logprob, ref["logprobs"])
        rounding["logprobs"] = worst_rounding({"logprobs": logprob}, {"logprobs": ref["logprobs"]},
                                              {"logprobs": exact["logprobs"]}, n, max_rel)
    if objective.off_policy.enabled:  # the weights' metrics, each pair counted on one device
        names = ("offpolicy_kl_k1", "offpolicy_kl_k3", "offpolicy_corrected_frac")
        extra["offpolicy_rel"] = max(
            abs(float(metrics[k]) - float(ref_metrics[k])) / max(abs(float(ref_metrics[k])), 1e-6)
            for k in names)
        rounding["offpolicy"] = worst_rounding(*({k: m[k] for k in names} for m in (
            metrics, ref_metrics, exact["metrics"])), n)
    for name in ("loss", "grad_norm"):
        rounding[name] = worst_rounding(*({name: m[name]} for m in (
            metrics, ref_metrics, exact["metrics"])), n)
    rounding["grads"] = worst_rounding(*(named_leaves(optax.tree_utils.tree_get(
        s.opt_state, "mu")) for s in (new_state, ref_state, exact["state"])), n)
    rounding["update"] = update_rounding(new_state, exact["state"], exact["params"])
    return extra | {
        "case": case,
        "rounding": rounding,
        "loss_rel": abs(float(metrics["loss"]) - float(ref_metrics["loss"]))
        / abs(float(ref_metrics["loss"])),
        "grad_norm_rel": abs(float(metrics["grad_norm"]) - float(ref_metrics["grad_norm"]))
        / float(ref_metrics["grad_norm"]),
        "grads_rel_l2": max(rel_l2(a, b) for a, b in zip(
            leaves(optax.tree_utils.tree_get(new_state.opt_state, "mu")),
            leaves(optax.tree_utils.tree_get(ref_state.opt_state, "mu")))),
        "params_rel_l2": max(rel_l2(a, b) for a, b in
                             zip(leaves(new_state.params), leaves(ref_state.params))),
        "params_worst": max(
            ((rel_l2(a, b), jax.tree_util.keystr(path)) for (path, a), b in zip(
                jax.tree_util.tree_leaves_with_path(new_state.params),
                leaves(ref_state.params))))[1],
        "update_rel_l2": max(
            rel_l2(np.asarray(a) - np.asarray(p0), np.asarray(b) - np.asarray(p0))
            for a, b, p0 in zip(leaves(new_state.params), leaves(ref_state.params),
                                leaves(params))),
        # A LoRA step leaves the frozen base bit for bit as it was.
        "frozen_equal": all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
            leaves(model_base(new_state.params)), leaves(model_base(params)))),
        "model_sharded": sum(split_over(a, "model") for a in leaves(new_state.params)),
        "fsdp_sharded": sum(split_over(a, "fsdp") for a in leaves(new_state.params)),
        "leaves": len(leaves(new_state.params)),
        "matrices": sum(np.ndim(a) >= 2 for a in leaves(new_state.params)),
        # Bytes of parameters and optimizer state after the step: in all, on the first device,
        # and of the arrays every device holds whole.
        "state_bytes": sum(a.nbytes for a in held),
        "device0_bytes": sum(a.addressable_shards[0].data.nbytes for a in held),
        "replicated_bytes": sum(a.nbytes for a in held if a.sharding.is_fully_replicated),
        # Tensors the tensor-parallel rules replicate (MoE router, Next's conv weight) are
        # split over `fsdp` alone; 1-D per-head tensors (Next's A_log, dt_bias) over `model`.
        "fsdp_only_bytes": sum(a.nbytes for a in held if "fsdp" in a.sharding.spec
                               and "model" not in a.sharding.spec),
        "model_only_bytes": sum(a.nbytes for a in held if "model" in a.sharding.spec
                                and "fsdp" not in a.sharding.spec),
        "replicated_max_ndim": max(a.ndim for a in held if a.sharding.is_fully_replicated),
    }


def main(cases: list[str]) -> None:
    opt = make_optimizer(OPTIM)
    references: dict[tuple[str, str, str], dict[str, Any]] = {}
    for case in cases:
        if case.startswith("restore:"):
            _, cfg, runtime = case_model("dense")
            params = nnx.split(create_model("qwen3", cfg, runtime, seed=3))[1]
            print(json.dumps(dict(restore_on_other_meshes(cfg, params, opt, case[8:]),
                                  case=case)), flush=True)
            continue
        key = tuple(case.split(":")[:3])
        if key not in references:
            references[key] = reference_step(*key, opt)
        print(json.dumps(compare_on_mesh(case, references[key], opt)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
