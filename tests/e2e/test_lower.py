"""The sharded train step (data x tensor parallel, optax update) lowers for TPU and CUDA on this
CPU machine (`launch/lower_step.py`); nothing is compiled for or run on the chips."""

import os
import subprocess
import sys

import pytest

from tests.run_util import WORKTREE


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_tiny_step_lowers_for_accelerators(platform):
    env = dict(os.environ, PYTHONPATH=str(WORKTREE))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "jtree.launch.lower_step", "--config", "configs/tiny.yaml", "--platform",
         platform, "--devices", "4", "mesh.model=2", "data.seq_len=128",
         "model.num_hidden_layers=1"],
        cwd=WORKTREE, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"for {platform}:" in proc.stdout and "mesh data=2 x fsdp=1 x model=2" in proc.stdout
    assert "all_reduce" in proc.stdout  # tensor- and data-parallel collectives are in the module
    # `auto` resolves for the target, not for this CPU host: never the C++ kernel's custom call
    assert "attention xla;" in proc.stdout and "jtree_tree_attention" not in proc.stdout


def test_triton_kernel_lowers_inside_the_sharded_cuda_step():
    """`pallas_triton` (what `auto` picks on every GPU but Hopper) inside the sharded step's
    shard_map, data x tensor parallel: its pallas_calls type their outputs as varying over the mesh
    axes their inputs vary over (`check_vma` rejects untyped outputs), and the module holds them as
    Triton custom calls."""
    env = dict(os.environ, PYTHONPATH=str(WORKTREE))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "jtree.launch.lower_step", "--config", "configs/tiny.yaml",
         "--platform", "cuda", "--devices", "4", "mesh.model=2", "data.seq_len=128",
         "model.num_hidden_layers=1", "runtime.attention_impl=pallas_triton"],
        cwd=WORKTREE, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mesh data=2 x fsdp=1 x model=2" in proc.stdout, proc.stdout
    assert "attention pallas_triton;" in proc.stdout, proc.stdout
    assert "custom calls __gpu$xla.gpu.triton" in proc.stdout, proc.stdout


@pytest.mark.parametrize("config, overrides", [
    ("qwen3_30b_a3b", ["model.num_hidden_layers=1", "mesh.fsdp=1"]),
    ("qwen3_next_80b_a3b", ["model.num_hidden_layers=2", "model.full_attention_interval=2",
                            "mesh.fsdp=1"]),
], ids=["qwen3_30b_a3b", "qwen3_next_80b_a3b"])
def test_moe_and_next_configs_lower_for_tpu_at_full_width(config, overrides):
    """The shipped MoE / Qwen3-Next configs at their real widths, sequence lengths and mesh.model=8
    (experts, GDN heads, vocabulary split 8 ways), cut to 1-2 layers (for Next: one Gated DeltaNet
    and one gated-attention layer) so that tracing stays quick."""
    env = dict(os.environ, PYTHONPATH=str(WORKTREE))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "jtree.launch.lower_step", "--config", f"configs/{config}.yaml",
         "--platform", "tpu", "--devices", "8", *overrides],
        cwd=WORKTREE, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "for tpu:" in proc.stdout, proc.stdout
    assert "mesh data=1 x fsdp=1 x model=8" in proc.stdout, proc.stdout
    assert "all_reduce" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("config, params, platform", [
    ("qwen3_30b_a3b", "30,532,122,624", "cuda"), ("qwen3_next_80b_a3b", "79,674,391,296", "tpu"),
])
def test_big_configs_lower_at_full_depth_on_their_target_mesh(config, params, platform):
    """The shipped 30B-A3B (48 layers) and Next-80B-A3B (48 layers) configs as they are: full
    depth, scanned layers, their 64-device FSDP x tensor-parallel mesh; FSDP's gathers and
    reduce-scatters are in the module. One platform each: both also lower for TPU at full width
    cut to one or two layers (above), and a Gated DeltaNet hybrid for CUDA at full depth in the
    Qwen3.5-9B case below."""
    env = dict(os.environ, PYTHONPATH=str(WORKTREE))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "jtree.launch.lower_step", "--config", f"configs/{config}.yaml",
         "--platform", platform, "--devices", "64"],
        cwd=WORKTREE, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"for {platform}: {params} parameters" in proc.stdout, proc.stdout
    assert "mesh data=1 x fsdp=8 x model=8" in proc.stdout, proc.stdout
    assert "all_gather" in proc.stdout and "reduce_scatter" in proc.stdout, proc.stdout


# (config, overrides of the cut-down case, parameters at full depth: the model's as transformers
# counts them)
CUDA_CONFIGS = {
    "llama3_8b": (["model.num_hidden_layers=1"], "8,030,261,248"),
    # Qwen3.5-9B's text model: one Gated DeltaNet and one gated-attention layer
    "qwen3_5_9b": (["model.num_hidden_layers=2", "model.full_attention_interval=2"],
                   "8,953,803,264"),
    # gpt-oss-20b: one sliding-window and one full-attention layer; at full depth the count of
    # transformers' GptOssForCausalLM of these shapes
    "gpt_oss_20b": (["model.num_hidden_layers=2"], "20,914,757,184"),
}


@pytest.mark.parametrize("config", list(CUDA_CONFIGS))
@pytest.mark.parametrize("full_depth", [
    False, pytest.param(True, marks=pytest.mark.slow)], ids=["one_layer", "full_depth"])
def test_8b_configs_lower_for_cuda_on_their_mesh(config, full_depth):
    """configs/llama3_8b.yaml (Llama-3.1-8B shapes, llama3 RoPE scaling),
    configs/qwen3_5_9b.yaml (Qwen3.5-9B's text model) and configs/gpt_oss_20b.yaml (sliding
    windows with sinks, 32 experts) on their 8-way tensor-parallel mesh at full
    width and sequence length; cut to one layer (one of each kind) unless `full_depth` (then the
    parameter count is the model's)."""
    cut, params = CUDA_CONFIGS[config]
    env = dict(os.environ, PYTHONPATH=str(WORKTREE))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "jtree.launch.lower_step", "--config", f"configs/{config}.yaml",
         "--platform", "cuda", "--devices", "8", *([] if full_depth else cut)],
        cwd=WORKTREE, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mesh data=1 x fsdp=1 x model=8" in proc.stdout, proc.stdout
    assert "all_reduce" in proc.stdout
    if full_depth:
        assert f"for cuda: {params} parameters" in proc.stdout, proc.stdout
