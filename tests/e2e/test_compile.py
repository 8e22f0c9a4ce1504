"""The sharded train step compiled by the production compilers (XLA:TPU from libtpu, XLA:GPU from
jax's CUDA plugin) on compile-only devices (`jtree.launch.compile`): configs/tiny.yaml cut to one
layer, one TPU and one GPU target; `jtree.launch.memory_plan --target` on the same path and
without the plugins. The compiler tests skip when `make aot-plugins` has not installed the plugins
into .aot/; nothing runs on a chip."""

import json
import os
import subprocess
import sys

import pytest

from tests.run_util import WORKTREE

AOT = WORKTREE / ".aot"
SMALL = ["data.seq_len=128", "model.num_hidden_layers=1"]


def compile_step(target, *overrides, aot=AOT, json_path=None, config="configs/tiny.yaml"):
    env = dict(os.environ, PYTHONPATH=str(WORKTREE), JTREE_AOT_DIR=str(aot))
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "jtree.launch.compile", "--config", config,
           "--target", target, *(["--json", str(json_path)] if json_path else []), *overrides]
    return subprocess.run(cmd, cwd=WORKTREE, env=env, capture_output=True, text=True,
                          timeout=300)


def needs(platform):
    from jtree.launch.aot_plugins import installed

    if installed(platform, AOT) is None:
        pytest.skip(f"the {platform} compiler is not in {AOT / platform}: run `make aot-plugins`")


def test_absent_plugins_are_one_line_and_status_2(tmp_path):
    proc = compile_step("gpu-h100x8", aot=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout.count("\n") == 1 and "make aot-plugins" in proc.stdout, proc.stdout


def test_triton_lang_step_compiles_for_a100(tmp_path):
    """`auto` on an A100 is the jax-triton kernel: inside the sharded step Triton compiles its
    kernels for sm_80 while the step lowers (the target's compute capability passed down from
    the compile-only devices: this host has no GPU to ask) and XLA:GPU compiles the step around
    them (a float32 config)."""
    needs("cuda")
    out = tmp_path / "a100.json"
    proc = compile_step("gpu-a100x8", *SMALL, json_path=out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["attention_impl"] == "triton_lang", report
    assert "runtime.gpu_compute_capability=80" in report["overrides"], report
    assert report["device_kind"] == "NVIDIA A100-SXM4-80GB" and report["devices"] == 8
    assert report["memory"]["fits"] and report["memory"]["temp"] > 0, report["memory"]
    assert report["collectives"].get("all-reduce"), report  # the data-parallel gradient sum
    assert "fits 79.26 GiB" in proc.stdout, proc.stdout


def test_pallas_tpu_step_compiles_for_v5p(tmp_path):
    """`auto` on TPU is the Pallas TPU kernel (head_dim 64: its lane layout's smallest); XLA:TPU
    gives its cost analysis, optimal_seconds included."""
    needs("tpu")
    out = tmp_path / "v5p.json"
    proc = compile_step("tpu-v5p-8", *SMALL, "model.head_dim=64", json_path=out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["attention_impl"] == "pallas_tpu" and report["devices"] == 4, report
    assert report["memory"]["fits"], report["memory"]
    assert report["cost"]["flops"] > 0 and report["cost"]["optimal_seconds"] > 0, report["cost"]


@pytest.mark.slow
def test_a_refused_step_is_one_line_and_status_1():
    """The Pallas TPU kernel refuses tiny's head_dim of 32: reported with the reason, no trace."""
    needs("tpu")
    proc = compile_step("tpu-v5p-8", *SMALL)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.startswith("tpu-v5p-8: FAILED at lower: ValueError: pallas_tpu: head_dim=32")
    assert proc.stdout.count("\n") == 1, proc.stdout


def memory_plan(target, *overrides, aot=AOT, json_path=None):
    env = dict(os.environ, PYTHONPATH=str(WORKTREE), JTREE_AOT_DIR=str(aot))
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "jtree.launch.memory_plan", "--config", "configs/tiny.yaml",
           "--target", target, *(["--json", str(json_path)] if json_path else []), *overrides]
    return subprocess.run(cmd, cwd=WORKTREE, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_memory_plan_for_a_target_is_its_compilers(tmp_path):
    """`memory_plan --target` is `jtree.launch.compile`'s full-depth compile, exit 0 for a fit."""
    needs("cuda")
    out = tmp_path / "plan.json"
    proc = memory_plan("gpu-a100x8", *SMALL, json_path=out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "XLA:GPU" in proc.stdout and "fits 79.26 GiB" in proc.stdout, proc.stdout
    assert "falling back" not in proc.stdout
    assert json.loads(out.read_text())["memory"]["fits"]


def test_memory_plan_without_plugins_falls_back_to_the_cpu_estimate(tmp_path):
    """No plugins: one line saying so, then the XLA:CPU plan on the target's 4 devices and HBM."""
    proc = memory_plan("tpu-v5p-8", "runtime.attention_impl=xla", "data.seq_len=128",
                       "data.micro_batches=1", aot=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "make aot-plugins" in lines[0], proc.stdout
    assert lines[1].startswith("falling back to the XLA:CPU estimate on 4 host devices and "
                               "95.00 GiB"), proc.stdout
    assert "fitted from XLA:CPU compiles" in proc.stdout and "fits 95 GiB" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("target", ["gpu-h100x8", "gpu-b200x8"])
def test_triton_lang_step_compiles_for_hopper_and_blackwell(tmp_path, target):
    """The jax-triton kernel named in the step compiles for sm_90 and sm_100 too (bf16)."""
    needs("cuda")
    out = tmp_path / "step.json"
    proc = compile_step(target, *SMALL, "runtime.dtype=bfloat16",
                        "runtime.attention_impl=triton_lang", json_path=out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(out.read_text())["memory"]["fits"]


def test_gpu_targets_pass_their_compute_capability():
    """The compile-only device's compute capability ("8.0") becomes the runtime's
    `gpu_compute_capability` (80), which jax-triton compiles for while lowering; TPU targets get
    none. Needs no plugin."""
    from types import SimpleNamespace

    from jtree.config import load_config
    from jtree.launch.compile import TARGETS, target_overrides

    for target, kind, capability in (("gpu-a100x8", "NVIDIA A100-SXM4-80GB", "8.0"),
                                     ("gpu-h100x8", "NVIDIA H100 80GB HBM3", "9.0"),
                                     ("gpu-b200x8", "NVIDIA B200", "10.0")):
        device = SimpleNamespace(device_kind=kind, compute_capability=capability)
        out = target_overrides("configs/tiny.yaml", [], TARGETS[target], device)
        runtime = load_config("configs/tiny.yaml", out).runtime
        assert runtime.gpu_compute_capability == round(float(capability) * 10), out
        # XLA:GPU expands `ragged_dot` densely: the experts run the tile loop there
        assert runtime.expert_matmul == "tiled", out
    tpu = SimpleNamespace(device_kind="TPU v5")
    out = target_overrides("configs/tiny.yaml", [], TARGETS["tpu-v5p-8"], tpu)
    runtime = load_config("configs/tiny.yaml", out).runtime
    assert runtime.gpu_compute_capability is None and runtime.expert_matmul == "ragged_dot"


def test_auto_resolves_mla_configs_on_their_value_head_dim():
    """`auto` for a target resolves on q/k and value head dims: DeepSeek-V3's MLA (192 / 128)
    on Hopper goes to the Pallas Triton kernel, not the Mosaic GPU kernel that refuses it, and
    on Blackwell to the tcgen05 kernel, which runs it; a plain config on Hopper still gets the
    Mosaic kernel. Needs no plugin."""
    from types import SimpleNamespace

    from jtree.launch.compile import TARGETS, target_overrides

    h100 = SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0")
    b200 = SimpleNamespace(device_kind="NVIDIA B200", compute_capability="10.0")

    def impl(config: str, *overrides: str, target="gpu-h100x8", device=h100) -> str:
        out = target_overrides(config, ["runtime.attention_impl=auto", *overrides],
                               TARGETS[target], device)
        return next(o for o in reversed(out) if o.startswith("runtime.attention_impl="))

    # hidden_size / heads = 128, a head dim the Mosaic kernel takes: only MLA's own dims say no
    reduced = ("model.hidden_size=1024", "model.num_attention_heads=8",
               "model.num_key_value_heads=8")
    assert impl("configs/deepseek_v3_671b.yaml", *reduced) == (
        "runtime.attention_impl=pallas_triton")
    assert impl("configs/deepseek_v3_671b.yaml", *reduced, target="gpu-b200x8",
                device=b200) == "runtime.attention_impl=mosaic_gpu_blackwell"
    assert impl("configs/tiny.yaml", "runtime.dtype=bfloat16", "model.head_dim=128") == (
        "runtime.attention_impl=pallas_mosaic_gpu")


# DeepSeek-V3 at 2 layers (one dense, one MoE of 16 experts), hidden 1024, 8 heads of MLA's
# q/k 192 and v 128, sharded over model 8: one head and two experts per device.
REDUCED_DEEPSEEK_V3 = [
    "model.num_hidden_layers=2", "model.first_k_dense_replace=1", "model.hidden_size=1024",
    "model.intermediate_size=2048", "model.moe_intermediate_size=256",
    "model.num_attention_heads=8", "model.num_key_value_heads=8", "model.num_experts=16",
    "model.n_group=4", "model.topk_group=2", "model.num_experts_per_tok=4",
    "model.q_lora_rank=384", "model.kv_lora_rank=256", "mesh.fsdp=1", "mesh.model=8",
    "data.seq_len=4096", "data.micro_batches=1"]


@pytest.mark.slow
def test_reduced_deepseek_v3_step_compiles_for_blackwell_with_the_tcgen05_kernel(tmp_path):
    """MLA's train step for a B200: `auto` resolves to `mosaic_gpu_blackwell` (q/k 192, v 128)
    and XLA:GPU compiles the sharded step with its forward and backward kernels."""
    needs("cuda")
    out = tmp_path / "step.json"
    proc = compile_step("gpu-b200x8", *REDUCED_DEEPSEEK_V3, "runtime.attention_impl=auto",
                        json_path=out, config="configs/deepseek_v3_671b.yaml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["attention_impl"] == "mosaic_gpu_blackwell", report
    assert report["memory"]["fits"], report


def test_the_h200_configs_have_targets_of_their_device_count():
    """Each H200 config's mesh names as many devices as the target its header names (the
    `jtree.launch.compile` target it is compiled for, deviceless), and its header names that
    target as `(gpu-...)`, where it says what the compile found. Needs no plugin."""
    from jtree.config import load_config
    from jtree.launch.compile import TARGETS
    from jtree.launch.memory_plan import mesh_devices

    for config, target in [("nemotron3_nano_30b_a3b", "gpu-h200x8"),
                           ("kimi_linear_48b", "gpu-h200x16"),
                           ("deepseek_v3_671b", "gpu-h200x512"), ("kimi_k2", "gpu-h200x512")]:
        mesh = load_config(f"configs/{config}.yaml").mesh
        assert mesh_devices(mesh) == TARGETS[target].device_count, config
        header = "".join(line for line in open(f"configs/{config}.yaml")
                         if line.startswith("#"))
        assert f"({target})" in header, f"{config}: its comment does not name {target}"
