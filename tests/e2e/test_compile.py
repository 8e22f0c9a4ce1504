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


def compile_step(target, *overrides, aot=AOT, json_path=None):
    env = dict(os.environ, PYTHONPATH=str(WORKTREE), JTREE_AOT_DIR=str(aot))
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "jtree.launch.compile", "--config", "configs/tiny.yaml",
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


def test_triton_step_compiles_for_a100(tmp_path):
    """`auto` on an A100 is the Pallas Triton kernel: inside the sharded step it lowers and XLA:GPU
    compiles it (a float32 config; Triton is also what `auto` runs for float32 on Hopper)."""
    needs("cuda")
    out = tmp_path / "a100.json"
    proc = compile_step("gpu-a100x8", *SMALL, json_path=out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["attention_impl"] == "pallas_triton", report
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


def test_auto_resolves_mla_configs_on_their_value_head_dim():
    """`auto` for a target resolves on q/k and value head dims: DeepSeek-V3's MLA (192 / 128)
    on Hopper goes to the Pallas Triton kernel, not the Mosaic GPU kernel that refuses it; a
    plain config on Hopper still gets the Mosaic kernel. Needs no plugin."""
    from jtree.launch.compile import TARGETS, target_overrides

    def impl(config: str, *overrides: str) -> str:
        out = target_overrides(config, ["runtime.attention_impl=auto", *overrides],
                               TARGETS["gpu-h100x8"], "NVIDIA H100 80GB HBM3")
        return next(o for o in reversed(out) if o.startswith("runtime.attention_impl="))

    # hidden_size / heads = 128, a head dim the Mosaic kernel takes: only MLA's own dims say no
    assert impl("configs/deepseek_v3_671b.yaml", "model.hidden_size=1024",
                "model.num_attention_heads=8", "model.num_key_value_heads=8") == (
        "runtime.attention_impl=pallas_triton")
    assert impl("configs/tiny.yaml", "runtime.dtype=bfloat16", "model.head_dim=128") == (
        "runtime.attention_impl=pallas_mosaic_gpu")


def test_the_h200_configs_have_targets_of_their_device_count():
    """Each H200 config's mesh names as many devices as the target its header names (the
    `jtree.launch.compile` target it is compiled for, deviceless). Needs no plugin."""
    from jtree.config import load_config
    from jtree.launch.compile import TARGETS
    from jtree.launch.memory_plan import mesh_devices

    for config, target in [("nemotron3_nano_30b_a3b", "gpu-h200x8"),
                           ("kimi_linear_48b", "gpu-h200x16"),
                           ("deepseek_v3_671b", "gpu-h200x512"), ("kimi_k2", "gpu-h200x512")]:
        mesh = load_config(f"configs/{config}.yaml").mesh
        assert mesh_devices(mesh) == TARGETS[target].device_count, config
