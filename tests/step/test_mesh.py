"""One train step over ('data', 'fsdp', 'context', 'model') meshes of 8 host devices equals the
single-device step.

The meshes run in a subprocess (`tests/mesh_worker.py`) because the device count is fixed when jax
creates its CPU backend. A case is `model:mode:objective:DxFxM` (data x fsdp x model), model
`dense` (Qwen3), `moe` (Qwen3-MoE: expert parallel, router loss pooled over the data shards) or
`next` (Qwen3-Next: Gated DeltaNet heads split, gated attention, shared expert), `llama` (Llama 3:
biases on attention and MLP, scaled RoPE) or `qwen2` (q/k/v biases); `dense_cpu` is
Qwen3 with the C++ `cpu` attention kernel, `dense_lora` Qwen3 training LoRA adapters (read split
like their kernels, FSDP included; the frozen base must come out of the step bit for bit as it went
in), `dense_critic` and `dense_critic_model` Qwen3 trained by PPO with a critic (a
value head; a separate, smaller critic model laid out by its own rules); `dense_tpu` is Qwen3 whose
sharded step runs the Pallas
TPU kernel in the TPU interpreter (its outputs and custom_vjp cotangents must carry the inputs'
varying mesh axes), compared with the `xla` step on one device, on two-device meshes. Float32,
Context parallelism (mode `cp`, mesh `DxFxCxM`): the rows of `tests.mesh_worker.cp_inputs`
(a deep chain crossing every device boundary, a node scored by a position 3 and 7 devices back,
random multi-level forests cut by the boundaries), split over C = 2, 4, 8 devices, mixed with
data, FSDP and tensor parallelism; dense (the `reference`, the block-sparse `xla` and, in its
interpreter, the Pallas TPU kernel), MoE (router loss pooled over the context axis too) and
Qwen3-Next (the Gated DeltaNet chunk scan and conv across device slices, with the per-device
tables of `jtree.parallel.context.context_batch`), SFT, PPO, GSPO and PPO with a critic.
Objectives `tis` and `seq_tis` are PPO and GSPO with off-policy weights formed in the step from
the rows' pairs (their metrics compared too).
Tolerances (docs/design.md, Numerics): the mesh step and the single-device step sum in different
orders, so neither is exact; each float32 result of the mesh step (loss, gradient norm, every
parameter's gradient, update and updated value) is held to an error model against the same step
on one device in float64, scaled by how far the single-device float32 step is from it
(`tests.models_util.rounding_bound`, `tests.mesh_worker.update_rounding`). Real bugs stay far
past it: with the scoring halo dropped (`jtree.parallel.context.scoring_view`), the GDN conv halo
dropped, the GDN states entering from other devices zeroed, or their cotangent's sign flipped,
the Qwen3-Next context-parallel PPO case's worst gradient is 2.7e-2 to 1.3e-1 off float64, 5e3
to 2.4e4 times its bound (measured once, each bug undone). The
2 kv heads on a 4-way model axis exercise replicated KV heads; every case exercises the
vocab-parallel embedding and loss. FSDP meshes mix the axes: (1, 8, 1), (2, 4, 1), (1, 4, 2) and
(2, 2, 2), every parameter of two or more dimensions sharded over `fsdp` and gathered per layer.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.covering import latin, staggered
from tests.run_util import WORKTREE

MESHES = ("8x1x1", "4x1x2", "2x1x4")
FSDP_MESHES = ("1x8x1", "2x4x1", "1x4x2", "2x2x2")


def run_cases(cases: list[str]) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(WORKTREE))
    proc = subprocess.run([sys.executable, "-m", "tests.mesh_worker", *cases], cwd=WORKTREE,
                          env=env, capture_output=True, text=True, timeout=1700)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["case"] for r in results] == cases
    return results


def check(result: dict) -> None:
    # Every float32 result of the mesh step within its error model against the float64 step
    # (`tests.models_util.rounding_bound`; the updates, whose error is the updated parameters'
    # too: `tests.mesh_worker.update_rounding`): loss, gradient norm, every gradient (Adam's
    # first moment) and update, CP PPO's log-probs from the sharded forward, the off-policy
    # metrics. The worst of each kind
    # is in `rounding`; the direct differences to the single-device float32 step (`*_rel*`), the
    # old round 1e-5 comparisons, are reported with it.
    for kind, worst in result["rounding"].items():
        assert worst["excess"] <= 1.0, (kind, worst, result)
    assert result["frozen_equal"], result  # a LoRA step leaves the base as it was
    sizes = [int(x) for x in result["case"].split(":")[3].split("x")]  # DxFxM or DxFxCxM
    fsdp, model = sizes[1], sizes[-1]
    if model > 1:
        assert result["model_sharded"] > 0, result  # tensor parallel really split weights
    if fsdp > 1:  # FSDP split every parameter but the 1-D ones (norms, biases): at least half
        # of those of two or more dimensions (stacked per-layer norms of scanned layers, which
        # stay whole, count there too; unscanned, all of them are split, measured). Counted
        # against matrices, not all leaves: Llama's biases outnumber its kernels.
        assert result["fsdp_sharded"] >= result["matrices"] // 2, result
    if fsdp * model == 8:  # no replicas: a device holds 1/8 of the state plus 1-D tensors
        assert result["replicated_max_ndim"] <= 1, result
        whole, fsdp_only = result["replicated_bytes"], result["fsdp_only_bytes"]
        model_only = result["model_only_bytes"]
        split = result["state_bytes"] - whole - fsdp_only - model_only
        bound = split / 8 + fsdp_only / fsdp + model_only / model + whole
        assert result["device0_bytes"] <= bound, result


def test_dense_and_moe_tree_and_baseline_steps_on_every_mesh(tmp_path):
    # Dense tree and baseline and MoE tree with the SFT objective on the data x model meshes,
    # PPO on MoE (data x FSDP x tensor parallel), Qwen3-Next on one tensor-parallel mesh, a
    # checkpoint resharded across tensor-parallel and FSDP meshes, LoRA on an FSDP x
    # tensor-parallel mesh, and Qwen3-Next PPO (MoE, Gated DeltaNet and attention) under FSDP x
    # context x tensor parallelism (its old log-probs recomputed by the sharded forward, FSDP
    # gathers included). MoE's baseline, FSDP alone, the CPU and TPU kernels, Next and LoRA on
    # every data x model mesh, the FSDP and context-parallel sweeps and the critic run in the
    # slow tests below.
    cases = ["dense:tree:sft:8x1x1", "dense:baseline:sft:4x1x2", "moe:tree:sft:4x1x2"]
    cases += ["next:tree:sft:2x1x4", "moe:tree:ppo:2x2x2", "dense_lora:tree:ppo:2x2x2",
              "next:cp:ppo:1x2x2x2"]
    step_results = run_cases(cases + [f"restore:{tmp_path}/ckpt"])
    for result in step_results[:-1]:
        check(result)
    restore = step_results[-1]
    # (2,2,2) -> TP, DP, FSDP meshes; scanned onto (1,4,2) and back unscanned onto (8,1,1)
    assert restore["equal"] and restore["resharded"], restore


@pytest.mark.slow
def test_lora_on_every_mesh_and_more_kernels_layouts_and_objectives():
    # LoRA on each data x model mesh, tree and baseline mode in turn (dense and MoE meet these
    # meshes in the default test above, Qwen3-Next one of them there and the FSDP and context
    # meshes in the sweeps below, where every model also runs PPO).
    cases = [f"dense_lora:{mode}:sft:{mesh}"
             for mesh, mode in zip(MESHES, ("tree", "baseline", "tree"))]
    cases += ["dense_tpu:tree:sft:2x1x1", "dense_tpu:baseline:sft:1x1x2",
              "dense_tpu:tree:sft:1x1x2", "dense_cpu:tree:sft:4x1x2"]
    # MoE's baseline on the widest tensor-parallel mesh, and FSDP alone over all eight devices
    cases += ["moe:baseline:sft:2x1x4", "dense:tree:sft:1x8x1"]
    cases += ["dense_scan:tree:sft:2x1x4", "dense_scan:tree:ppo:2x2x2"]
    # off-policy weights, PPO and GSPO, on a data x FSDP x tensor mesh and context-parallel
    # meshes (the weights' sums over pairs split over rows and gathered over the context axis)
    cases += ["dense:tree:tis:2x2x2", "dense:cp:tis:1x2x2x1", "dense:cp:seq_tis:1x1x4x1"]
    for result in run_cases(cases + ["dense:baseline:ppo:2x1x4"]):
        check(result)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("model", ("dense_critic", "dense_critic_model"))
def test_ppo_with_a_critic_on_every_mesh(model):
    # PPO with the value head, or with the separate critic model: tree mode on data parallel,
    # on all three axes, and on tensor parallel (value head) or FSDP (critic model) alone; the
    # per-path baseline on one more mesh (tensor parallel and FSDP for the value head, FSDP and
    # tensor parallel for the critic model).
    alone = "2x1x4" if model == "dense_critic" else "1x8x1"
    cases = [f"{model}:tree:ppo:{mesh}" for mesh in ("8x1x1", alone, "2x2x2")]
    cases += [f"{model}:baseline:ppo:" + ("4x1x2" if model == "dense_critic" else "1x4x2")]
    for result in run_cases(cases):
        check(result)


FSDP_MODELS = ("dense", "moe", "next", "dense_lora")


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("model", FSDP_MODELS)
def test_fsdp_meshes_for_every_model_mode_and_objective(model):
    # One subprocess per model: every FSDP mesh, and on them tree and baseline, SFT and PPO in
    # turn (each mesh meets all four; each model but Qwen3-Next too, whose compiles cost three
    # times a dense model's: it runs two cases, tree with SFT and the baseline with PPO).
    combos = [f"{mode}:{objective}" for mode in ("tree", "baseline") for objective in ("sft", "ppo")]
    cases = [f"{model}:{combo}:{mesh}"
             for m, mesh, combo in latin(FSDP_MODELS, FSDP_MESHES, combos) if m == model]
    if model == "next":
        cases = cases[1:3]
    for result in run_cases(cases):
        check(result)


# (Context 2 alone is the Pallas TPU case's below and the default test's, with FSDP and tensor
# parallelism.)
CP_MESHES = ("1x1x4x1", "1x1x8x1", "2x1x2x2", "1x2x4x1", "2x2x2x1", "1x1x2x4")
CP_MODELS = ("dense", "dense_xla", "moe", "next")


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("model", CP_MODELS + ("dense_tpu",))
def test_context_parallel_meshes_for_every_model_and_objective(model):
    if model == "dense_tpu":  # the Pallas TPU kernel in its interpreter at a query offset
        # (on 2 and 4 devices: on the 8 of 2x1x2x2 the interpreter of jax 0.10.2 deadlocks at
        # its cross-device barrier, in the one-device-per-thread simulation, not in the kernel)
        for result in run_cases(["dense_tpu:cp:sft:1x1x2x1", "dense_tpu:cp:ppo:1x1x4x1"]):
            check(result)
        return
    # One subprocess per model: three of the context-parallel meshes, staggered so that every
    # mesh meets a model, SFT and PPO in turn (each model and each mesh meets both); GSPO (path sums over the gathered rows) and PPO with a critic (GAE
    # over the gathered values) on one of three meshes each, with perturbed weights (the `dense`
    # model's initial weights leave gradient entries near Adam's eps, where the first update's
    # sign-like step amplifies rounding).
    cases = [f"{model}:cp:{objective}:{mesh}"
             for m, mesh, objective in staggered(CP_MODELS, CP_MESHES, 3, ("sft", "ppo"))
             if m == model]
    if model != "dense":
        extra = ("1x1x4x1", "2x1x2x2", "1x1x8x1")
        index = CP_MODELS.index(model)
        cases += [f"{model}:cp:gspo:{extra[index % 3]}",
                  f"{model}:cp:critic:{extra[(index + 1) % 3]}"]
    for result in run_cases(cases):
        check(result)


def test_llama_and_qwen2_steps_on_fsdp_context_and_model_axes():
    # Llama 3 (attention and MLP biases, scaled RoPE) under FSDP x context x tensor parallelism,
    # PPO with its old log-probs from the sharded forward; Qwen2 (q/k/v biases) on data x FSDP x
    # tensor parallel, SFT. About 40 s on 2 CPU cores.
    for result in run_cases(["llama:cp:ppo:1x2x2x2", "qwen2:tree:sft:2x2x2"]):
        check(result)


@pytest.mark.slow
def test_qwen3_5_steps_on_fsdp_context_and_model_axes():
    # Qwen3.5 dense (separate GDN projections, attention biases) and MoE (experts split over
    # `model`) under FSDP x context x tensor parallelism, PPO: the GDN's grouped in_proj_qkv
    # split by key heads, its recurrence through the context axis' affine scan. Slow (the
    # default suite's Qwen3.5 checks are tests/hf/test_hf_qwen3_5.py's): about a minute on 2 CPU
    # cores.
    for result in run_cases(["qwen3_5:cp:ppo:1x2x2x2", "qwen3_5_moe:cp:ppo:1x2x2x2"]):
        check(result)


def test_gpt_oss_step_on_fsdp_context_and_model_axes():
    # gpt-oss (sliding-window and full layers with sinks, expert parallel MoE with biases and the
    # clamped SwiGLU, YaRN) under FSDP x context x tensor parallelism, PPO, on the `xla` kernel:
    # the windows count in path positions gathered over the context axis. About a minute on 2
    # CPU cores.
    for result in run_cases(["gpt_oss:cp:ppo:1x2x2x2"]):
        check(result)


@pytest.mark.slow
def test_deepseek_v3_step_on_fsdp_context_and_model_axes():
    # DeepSeek-V3 (MLA heads split over `model` with the latent projections replicated, value
    # heads narrower than q/k heads gathered over the context axis; DeepSeekMoE's experts split
    # over `model`, its group-limited router and selection bias replicated, its shared experts a
    # Megatron SwiGLU) under FSDP x context x tensor parallelism, PPO, on the `xla` kernel.
    # With token dispatch (all_to_all), the router variant and the ungated shared experts on the
    # dispatched tokens.
    for result in run_cases(["deepseek_v3:cp:ppo:1x2x2x2", "deepseek_v3_a2a:tree:sft:2x2x2"]):
        check(result)


@pytest.mark.slow
def test_kimi_linear_step_on_fsdp_context_and_model_axes():
    # Kimi-Linear (KDA heads split over `model`, its conv halo and per-channel-decay states
    # crossing the context axis as composed chunk maps; MLA without RoPE; DeepSeekMoE) under
    # FSDP x context x tensor parallelism, PPO, on the `xla` kernel.
    for result in run_cases(["kimi_linear:cp:ppo:1x2x2x2"]):
        check(result)


@pytest.mark.slow
def test_gpt_oss_token_dispatch_step():
    # gpt-oss's experts with token dispatch (all_to_all): the expert biases travel with the
    # experts' shards.
    for result in run_cases(["gpt_oss_a2a:tree:sft:2x2x2"]):
        check(result)


@pytest.mark.slow
def test_nemotron_h_steps_on_fsdp_context_and_model_axes():
    # Nemotron-H (Mamba2, MoE, attention and MLP single-block layers) under FSDP x context x
    # tensor parallelism, PPO: the Mamba2 B/C groups split over `model` with their heads (the
    # grouped in_proj column-parallel, conv channels, dt_bias, A_log, D and the per-group gated
    # norm split alike, out_proj row-parallel), the conv's halo and the states crossing devices
    # as composed chunk maps over `context`, the squared-ReLU experts split over `model` with the
    # group-limited router replicated; and data x FSDP x tensor parallelism with token dispatch
    # (all_to_all), SFT. About 3 minutes on 2 CPU cores.
    for result in run_cases(["nemotron_h:cp:ppo:1x2x2x2", "nemotron_h_a2a:tree:sft:2x2x2"]):
        check(result)
