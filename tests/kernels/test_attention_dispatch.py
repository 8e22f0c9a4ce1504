"""`tree_attention` dispatch: what `auto` picks (on a GPU by device kind and operands; on CPU the
C++ kernel when it builds, else `xla`, logged), validation of a host `end`, padding of S."""

import dataclasses
import importlib
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtree.kernels import TreeMask, tree_attention
from jtree.kernels.tree_attention import _auto_on_cpu, gpu_impl, resolve_impl
from jtree.launch.lower_step import export_attention_impl
from tests.attention_cases import qkv, tree_end

LOGGER = "jtree.kernels.tree_attention"


@pytest.fixture
def fresh_auto_choice():
    """`auto` on CPU decides once per process: forget the decision before and after a test."""
    _auto_on_cpu.cache_clear()
    yield
    _auto_on_cpu.cache_clear()


H100 = "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("device_kind, dtype, head_dim, impl", [
    (H100, jnp.bfloat16, 128, "pallas_mosaic_gpu"),
    (H100, jnp.float16, 64, "pallas_mosaic_gpu"),
    ("NVIDIA H200", jnp.bfloat16, 64, "pallas_mosaic_gpu"),
    ("NVIDIA GH200 480GB", jnp.float16, 128, "pallas_mosaic_gpu"),
    ("NVIDIA H20", jnp.bfloat16, 128, "pallas_mosaic_gpu"),
    (H100, jnp.float32, 128, "pallas_triton"),  # wgmma has no fp32 operands
    (H100, jnp.bfloat16, 256, "pallas_triton"),  # the Mosaic backward does not fit shared memory
    # neither Hopper nor Blackwell: the jax-triton kernel, off Pallas' deprecated Triton backend
    ("NVIDIA A100-SXM4-80GB", jnp.bfloat16, 128, "triton_lang"),  # no wgmma before Hopper
    ("NVIDIA L40S", jnp.float16, 64, "triton_lang"),
    ("NVIDIA GeForce RTX 4090", jnp.float32, 256, "triton_lang"),
    ("NVIDIA A100-SXM4-80GB", jnp.bfloat16, 192, "triton_lang"),  # MLA (Dv 128 below)
    ("NVIDIA GeForce RTX 5090", jnp.bfloat16, 128, "triton_lang"),  # sm_120: no tcgen05
    ("NVIDIA B200", jnp.bfloat16, 128, "mosaic_gpu_blackwell"),  # tcgen05, forward + backward
    ("NVIDIA B200", jnp.float32, 128, "pallas_triton"),  # tcgen05 has no fp32 operands
])
def test_gpu_rule(device_kind, dtype, head_dim, impl):
    """What `auto` runs on each GPU (the table in docs/kernels.md): never the `xla` fallback."""
    assert gpu_impl(device_kind, dtype, head_dim, 128 if head_dim == 192 else None) == impl


def test_the_runtimes_compute_capability_reaches_only_triton_lang(monkeypatch):
    """A model's `attend` passes `runtime.gpu_compute_capability` down to the kernel that jax-triton
    compiles while lowering (a host without a GPU has none to ask); the kernels XLA compiles
    never see it. `triton_lang`'s registry entry is replaced by a recorder (no jax-triton here)."""
    from jtree.config.runtime import RuntimeConfig
    from jtree.models.attention import attend

    dispatch = importlib.import_module("jtree.kernels.tree_attention")  # the module

    seen = []

    def record(q, k, v, end, **options):
        seen.append(options.get("compute_capability"))
        return jnp.zeros((*q.shape[:3], v.shape[3]), q.dtype)

    entry = dispatch._IMPLS["triton_lang"]
    monkeypatch.setitem(dispatch._IMPLS, "triton_lang", entry._replace(run=record))
    q, k, v = qkv(1, 1, 64, 2, 1, 16)
    mask = TreeMask(jnp.arange(1, 65, dtype=jnp.int32)[None])
    attend(q, k, v, mask, None, RuntimeConfig(attention_impl="triton_lang",
                                              gpu_compute_capability=90))
    attend(q[:, 32:], k, v, dataclasses.replace(mask, query_offset=jnp.int32(32)), None,
           RuntimeConfig(attention_impl="triton_lang", gpu_compute_capability=80))
    assert seen == [90, 80]
    out = attend(q, k, v, mask, None, RuntimeConfig(attention_impl="xla",
                                                    gpu_compute_capability=80))
    assert out.shape == q.shape
    with pytest.raises(ValueError, match="gpu_compute_capability: '8.0'"):
        RuntimeConfig(gpu_compute_capability="8.0")


def test_auto_per_backend():
    """A soft-cap never changes the GPU choice (both GPU kernels take it, and a prefix)."""
    assert resolve_impl("auto", "tpu", dtype=jnp.float32, head_dim=128) == "pallas_tpu"
    for softcap in (None, 30.0):
        assert resolve_impl("auto", "gpu", dtype=jnp.bfloat16, head_dim=128, softcap=softcap,
                            device_kind=H100) == "pallas_mosaic_gpu"
    with pytest.raises(ValueError, match="needs the target's device_kind"):
        resolve_impl("auto", "gpu", dtype=jnp.bfloat16, head_dim=128)  # this host has no GPU
    with pytest.raises(ValueError, match="needs the operands' dtype and head_dim"):
        resolve_impl("auto", "gpu", device_kind=H100)


def test_auto_on_cpu_runs_the_cpp_kernel_when_it_builds(fresh_auto_choice, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    for dtype in (jnp.float32, jnp.bfloat16):
        assert resolve_impl("auto", "cpu", dtype=dtype, head_dim=128) == "cpu"
    assert resolve_impl("auto") == "cpu"  # this machine's backend is CPU
    said = [r for r in caplog.records if r.name == LOGGER]
    assert len(said) == 1 and "'auto' runs the 'cpu' kernel" in said[0].getMessage()  # once
    # the same call, the same numbers: `auto` is the C++ kernel
    end = tree_end(seed=5, s=96, rows=2)
    q, k, v = qkv(2, end.shape[0], 96, 4, 2, 32)
    np.testing.assert_array_equal(tree_attention(q, k, v, TreeMask(end)),
                                  tree_attention(q, k, v, TreeMask(end), impl="cpu"))


def test_auto_on_cpu_with_a_softcap_runs_xla(fresh_auto_choice):
    """The C++ kernel has no soft-cap: `auto` must not pick a kernel that refuses the call."""
    assert resolve_impl("auto", "cpu", softcap=30.0) == "xla"
    end = tree_end(seed=6, s=64, rows=2)
    q, k, v = qkv(3, end.shape[0], 64, 2, 1, 16)
    np.testing.assert_allclose(tree_attention(q, k, v, TreeMask(end), softcap=5.0),
                               tree_attention(q, k, v, TreeMask(end), impl="reference", softcap=5.0),
                               atol=1e-6)


FAKE_CXX = """#!/bin/sh
if [ "$1" = --version ]; then echo "fakec++ 1.0"; exit 0; fi
echo "fakec++: error: cannot compile today" >&2
exit 1
"""


@pytest.mark.parametrize("compiler", ["missing", "failing"])
def test_auto_on_cpu_falls_back_to_xla_with_a_log_line(compiler, fresh_auto_choice, tmp_path,
                                                       monkeypatch, caplog):
    """No compiler (CXX names nothing) or a build that fails: `auto` runs `xla` and says why."""
    cxx = tmp_path / "c++"
    if compiler == "failing":
        cxx.write_text(FAKE_CXX)
        cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("JTREE_KERNEL_CACHE", str(tmp_path / "cache"))
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert resolve_impl("auto", "cpu", dtype=jnp.float32, head_dim=64) == "xla"
    assert resolve_impl("auto", "cpu") == "xla"
    said = [r for r in caplog.records if r.name == LOGGER]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    why = {"missing": "needs a C++ compiler", "failing": "failed"}[compiler]
    assert "'auto' runs 'xla'" in said[0].getMessage() and why in said[0].getMessage()
    assert str(cxx) in said[0].getMessage() or compiler == "failing"


def test_lowering_resolves_auto_for_the_target_not_this_host(fresh_auto_choice):
    """On this CPU host `auto` is the C++ kernel, a CPU-only custom call: the TPU/GPU export uses
    `xla` (tests/e2e/test_lower.py checks the exported module), named impls stay as named."""
    assert resolve_impl("auto", "cpu") == "cpu"
    assert export_attention_impl("auto") == "xla"
    assert export_attention_impl("pallas_tpu") == "pallas_tpu"
    assert resolve_impl("auto", "tpu", dtype=jnp.bfloat16, head_dim=128) == "pallas_tpu"


@pytest.mark.parametrize("end, match", [
    ([[3, 1, 3]], "row 0, token 1 has end=1; need 1 < end <= S=3"),
    ([[4, 3, 3]], "row 0, token 0 has end=4; need 0 < end <= S=3"),
    ([[1.0, 2.0, 3.0]], "dtype float64 is not an integer type"),
])
def test_rejects_bad_host_end(end, match):
    q, k, v = qkv(0, 1, 3, 2, 1, 8)
    with pytest.raises(ValueError, match=match):
        tree_attention(q, k, v, TreeMask(np.asarray(end)), impl="xla")


def test_padding_tokens_are_invisible():
    """Padding S up to the block: a 3-token input with blocks of 8 equals the reference."""
    q, k, v = qkv(1, 1, 3, 2, 2, 8)
    end = np.array([[3, 2, 3]], np.int32)  # root 0, children 1 and 2
    got = jax.jit(lambda q, k, v: tree_attention(q, k, v, TreeMask(end), impl="xla", block_q=8,
                                                 block_kv=8))(q, k, v)
    want = tree_attention(q, k, v, TreeMask(jnp.asarray(end)), impl="reference")
    assert got.shape == q.shape
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_model_config_rejects_unknown_impl():
    from jtree.config.runtime import RuntimeConfig

    with pytest.raises(ValueError, match="attention_impl: 'flash' is not one of"):
        RuntimeConfig(attention_impl="flash")
