"""The Blackwell (sm_100) tree-attention forward (`impl="mosaic_gpu_blackwell"`), checked
without a GPU.

The kernel itself cannot execute here: the Mosaic GPU interpreter of jax 0.10.2 allocates only
GMEM, SMEM and register refs (TMEM raises "Unsupported memory space: tmem") and has no rule for
tcgen05_mma or the TMEM loads and stores. What runs:
- Everything around the kernel, through `tree_attention`: padding, the stacked `end` / `q_pos`
  tiles, the block lists (at the kernel's 128 x 128 blocks), the base-2 log-sum-exp layout and
  the sinks. `forward_call` is replaced by a numpy model of its contract written here from the
  rule (for every listed kv-block, the scores of its 128 keys; the element mask only where the
  block is PARTIAL; nothing else), so a block missing from a list, a block wrongly called FULL,
  a misplaced position tile or a wrong lse layout fails against the dense oracle.
- The lowering for CUDA (`jax.export`), which runs Pallas' Mosaic GPU lowering of the kernel.
- The refusals: dtypes, head dims, MLA, context parallelism, differentiation (no backward).
- `auto`'s rule for Blackwell device kinds.
- With `make aot-plugins`: the production compiler (XLA:GPU, Mosaic GPU's NVVM pipeline, ptxas)
  compiles the kernel for sm_100a (a B200) deviceless; skipped without the plugin.
The kernel body's numerics (the tcgen05 products, the online softmax, the mask inside the
kernel) are checked only on a Blackwell GPU, by `python -m jtree.launch.device_check`.
"""

import importlib
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtree.kernels import TreeMask, tree_attention
from jtree.kernels.attention import mgpu_blackwell
from jtree.kernels.attention.mgpu_blackwell_forward import BLOCK_KV, BLOCK_Q
from jtree.kernels.block_tables import PARTIAL
from tests.attention_cases import qkv
from tests.run_util import WORKTREE
from tests.window_cases import deep_end_pos, oracle_attention, oracle_mask, window_mask

IMPL = "mosaic_gpu_blackwell"
dispatch = importlib.import_module("jtree.kernels.tree_attention")  # the module, not the function
BF16_REL = 2.0 ** -7  # two bf16 roundings (the output, and the oracle's inputs are the same)


def _modelled_forward(q, k, v, end, q_pos, table, count, *, stages, scale, softcap, window):
    """What `forward_call` computes from its inputs, in numpy float64: per 128-query block, the
    listed kv-blocks only, the element mask only on PARTIAL ones. (O, base-2 lse)."""
    del stages

    def run(q, k, v, end, q_pos, table, count):
        q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
        rows, sq, hq, _ = q.shape
        skv, g = k.shape[1], hq // k.shape[2]
        ends, kpath = (end, None) if window is None else (end[:, 0], end[:, 1])
        qpos, qpath = (q_pos, None) if window is None else (q_pos[:, 0], q_pos[:, 1])
        out, lse = np.zeros_like(q), np.zeros((rows, hq, sq))
        for r in range(rows):
            for qb in range(table.shape[1]):
                blocks, kinds = table[r, qb].reshape(2, -1)[:, :count[r, qb]]
                qs = slice(qb * BLOCK_Q, (qb + 1) * BLOCK_Q)
                seen = np.zeros((BLOCK_Q, skv), bool)
                for b, kind in zip(blocks, kinds):
                    ks = slice(b * BLOCK_KV, (b + 1) * BLOCK_KV)
                    if kind != PARTIAL:
                        seen[:, ks] = True
                        continue
                    i, j = qpos[r, qs][:, None], np.arange(ks.start, ks.stop)[None]
                    vis = (j <= i) & (i < ends[r, ks][None])
                    if window is not None:
                        vis &= qpath[r, qs][:, None] - kpath[r, ks][None] < window
                    seen[:, ks] = vis
                for h in range(hq):
                    s = q[r, qs, h] @ k[r, :, h // g].T * scale
                    if softcap is not None:
                        s = softcap * np.tanh(s / softcap)
                    s = np.where(seen, s, -np.inf)
                    m = s.max(axis=1, keepdims=True)
                    p = np.exp(s - m)
                    out[r, qs, h] = p @ v[r, :, h // g] / p.sum(axis=1, keepdims=True)
                    lse[r, h, qs] = (m[:, 0] + np.log(p.sum(axis=1))) / np.log(2.0)
        return out.astype(np.float32), lse.astype(np.float32)

    shapes = (jax.ShapeDtypeStruct(q.shape, jnp.float32),
              jax.ShapeDtypeStruct((q.shape[0], q.shape[2], q.shape[1]), jnp.float32))
    out, lse = jax.pure_callback(run, shapes, q, k, v, end, q_pos, table, count)
    return out.astype(q.dtype), lse


@pytest.fixture
def modelled_kernel(monkeypatch):
    monkeypatch.setattr(mgpu_blackwell, "forward_call", _modelled_forward)


def _assert_close(got, want, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err, size = np.abs(got - want).max(), np.abs(want).max()
    assert err <= 2 * BF16_REL * size, f"{what}: max error {err:.3g} vs max |want| {size:.3g}"


@pytest.mark.parametrize("hq, hkv, d, window, sinks, softcap", [
    (4, 1, 64, None, False, None),  # GQA 4
    (2, 2, 128, 40, True, None),  # window + sinks
    (4, 2, 64, None, False, 20.0),  # soft-cap
])
def test_block_lists_and_layouts_through_tree_attention(modelled_kernel, hq, hkv, d, window,
                                                        sinks, softcap):
    """Square calls at S = 300 (padded to 384: three 128-query blocks): the kernel's inputs,
    read by the model of its contract, give the dense oracle's output."""
    end, pos = deep_end_pos(seed=d + hq, s=300, rows=2, trees=3, seg=(3, 24))
    q, k, v = qkv(hq, 2, 300, hq, hkv, d, jnp.bfloat16)
    s = jnp.asarray(np.linspace(-1.0, 1.0, hq), jnp.float32) if sinks else None
    got = tree_attention(q, k, v, window_mask(end, pos, window), impl=IMPL, sinks=s,
                         softcap=softcap)
    mask = oracle_mask(end, pos, window)
    if softcap is None:
        want = oracle_attention(q, k, v, mask, s)
    else:  # the oracle's scores through the soft-cap, written here
        scale = d ** -0.5
        kk = np.repeat(np.asarray(k, np.float64), hq // hkv, axis=2)
        vv = np.repeat(np.asarray(v, np.float64), hq // hkv, axis=2)
        sc = np.einsum("rihd,rjhd->rhij", np.asarray(q, np.float64), kk) * scale
        sc = np.where(mask[:, None], softcap * np.tanh(sc / softcap), -np.inf)
        p = np.exp(sc - sc.max(-1, keepdims=True))
        want = np.einsum("rhij,rjhd->rihd", p / p.sum(-1, keepdims=True), vv)
    _assert_close(got, want, "out")


def test_prefix_call_through_tree_attention(modelled_kernel):
    """A part's own queries over [cached prefix keys | own keys] (`q_pos`), with a window."""
    prefix, s = 130, 260
    end, pos = deep_end_pos(seed=11, s=s, rows=2, trees=2, seg=(3, 20))
    q, k, v = qkv(12, 2, s, 4, 2, 64, jnp.bfloat16)
    got = tree_attention(q[:, prefix:], k[:, prefix:], v[:, prefix:],
                         window_mask(end, pos, 70, prefix=prefix), impl=IMPL,
                         prefix_k=k[:, :prefix], prefix_v=v[:, :prefix])
    q_pos = np.broadcast_to(np.arange(prefix, s), (2, s - prefix))
    want = oracle_attention(q[:, prefix:], k, v, oracle_mask(end, pos, 70, q_pos))
    _assert_close(got, want, "prefix out")


def _export(fn, *shapes):
    args = [jax.ShapeDtypeStruct(s, dt) for s, dt in shapes]
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args)
    return re.findall(r"custom_call @(\w+)", exported.mlir_module())


@pytest.mark.parametrize("head_dim", [64, 128])
def test_lowers_for_cuda(head_dim):
    """Pallas' Mosaic GPU lowering of the tcgen05 kernel, through `tree_attention` (S padded),
    GQA 4, with a window and sinks."""
    s, bf16, i32 = 1000, jnp.bfloat16, jnp.int32

    def attend(q, k, v, end, pos, sinks):
        return tree_attention(q, k, v, TreeMask(end, positions=pos, window=128), impl=IMPL,
                              sinks=sinks)

    shapes = [((1, s, 8, head_dim), bf16), ((1, s, 2, head_dim), bf16),
              ((1, s, 2, head_dim), bf16), ((1, s), i32), ((1, s), i32), ((8,), jnp.float32)]
    assert _export(attend, *shapes) == ["mosaic_gpu_v2"]


def test_differentiating_raises_naming_the_impl():
    """No backward kernel: a gradient is refused at trace time, never computed by another kernel."""
    end = jnp.broadcast_to(jnp.arange(1, 129, dtype=jnp.int32), (1, 128))
    q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)

    def loss(q, k, v):
        return tree_attention(q, k, v, TreeMask(end), impl=IMPL).astype(jnp.float32).sum()

    with pytest.raises(ValueError, match="'mosaic_gpu_blackwell' has no backward kernel"):
        jax.jit(jax.grad(loss)).trace(q, q, q)


@pytest.mark.parametrize("dtype, hd, dv, match", [
    (jnp.float32, 64, 64, r"must all be bfloat16 or float16 \(tcgen05 operands\)"),
    (jnp.bfloat16, 256, 256, "head_dim 256 .* must be one of \\(64, 128\\)"),
    (jnp.float16, 96, 96, "head_dim=96 must be a multiple of 64"),
    (jnp.bfloat16, 128, 64, "'mosaic_gpu_blackwell': value head dim 64 != query/key head dim 128"),
])
def test_rejects_what_the_kernel_cannot_honour(dtype, hd, dv, match):
    end = jnp.broadcast_to(jnp.arange(1, 129, dtype=jnp.int32), (1, 128))
    q, k, v = qkv(0, 1, 128, 2, 1, hd, dtype, dv=dv)
    with pytest.raises(ValueError, match=match):
        tree_attention(q, k, v, TreeMask(end), impl=IMPL)


def test_rejects_context_parallelism_and_bad_direct_calls():
    end = jnp.broadcast_to(jnp.arange(1, 257, dtype=jnp.int32), (1, 256))
    q, k, v = qkv(0, 1, 256, 2, 1, 64, jnp.bfloat16)
    with pytest.raises(ValueError, match="'mosaic_gpu_blackwell' does not run under context"):
        tree_attention(q[:, :128], k, v, TreeMask(end, query_offset=jnp.int32(128)), impl=IMPL)
    with pytest.raises(ValueError, match="must be multiples of 128"):
        mgpu_blackwell.attention_blackwell(q[:, :200], k[:, :200], v[:, :200], end[:, :200],
                                           scale=0.1)
    with pytest.raises(ValueError, match="128 queries over 256 keys need q_pos"):
        mgpu_blackwell.attention_blackwell(q[:, :128], k, v, end, scale=0.1)


def _aot_cuda():
    from jtree.launch.aot_plugins import installed

    folder = installed("cuda", WORKTREE / ".aot")
    if folder is None:
        pytest.skip("jax's CUDA plugin is not in .aot/cuda: run `make aot-plugins`")
    return folder


def test_compiles_for_sm100a_deviceless(tmp_path):
    """The production compiler compiles the forward for a B200 at S = 4096, bf16, head_dim 128,
    GQA 4 (the first case of `compile_kernels`' gpu-b200x8 sweep, in its worker)."""
    from jtree.launch.bench.compile_kernels import sweep
    from jtree.launch.compile import WORKER_ENV

    folder = _aot_cuda()
    index = sweep("gpu-b200x8").index(
        next(c for c in sweep("gpu-b200x8") if c.kernel == IMPL and c.head_dim == 128
             and c.gqa == 4 and not c.variant))
    env = dict(os.environ, **{WORKER_ENV: "1"}, JAX_PLATFORMS="cpu",
               JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([str(folder), str(WORKTREE)]))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-m", "jtree.launch.bench.compile_kernels",
                           "--targets", "gpu-b200x8", "--out", str(tmp_path), "--cases",
                           str(index)], cwd=WORKTREE, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    (result,) = [json.loads(line) for line in
                 (tmp_path / "kernels_gpu-b200x8.jsonl").read_text().splitlines()]
    assert result["device_kind"] == "NVIDIA B200", result
    assert result["compiled"], result
    assert result["custom_calls"] == {"mosaic_gpu_v2": 1}, result


@pytest.mark.parametrize("device_kind", ["NVIDIA B200", "NVIDIA GB200", "NVIDIA B300 SXM6 AC"])
def test_auto_on_blackwell_follows_the_registry(monkeypatch, device_kind):
    """Forward only: `auto` keeps Blackwell on the Triton kernel, which trains. Given a backward
    (the registry entry's flag), `auto` would pick this kernel for what it runs, and only that."""
    assert dispatch.gpu_impl(device_kind, jnp.bfloat16, 128) == "pallas_triton"
    entry = dispatch._IMPLS[IMPL]
    monkeypatch.setitem(dispatch._IMPLS, IMPL, entry._replace(backward=True))
    assert dispatch.gpu_impl(device_kind, jnp.bfloat16, 128) == IMPL
    assert dispatch.gpu_impl(device_kind, jnp.float16, 64) == IMPL
    assert dispatch.gpu_impl(device_kind, jnp.float32, 128) == "pallas_triton"
    assert dispatch.gpu_impl(device_kind, jnp.bfloat16, 256) == "pallas_triton"
    assert dispatch.gpu_impl(device_kind, jnp.bfloat16, 192, 128) == "pallas_triton"  # MLA
    assert dispatch.gpu_impl("NVIDIA GeForce RTX 5090", jnp.bfloat16, 128) == "triton_lang"
    assert dispatch.gpu_impl("NVIDIA H100 80GB HBM3", jnp.bfloat16, 128) == "pallas_mosaic_gpu"
