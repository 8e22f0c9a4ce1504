"""The Blackwell (sm_100) tree-attention kernels (`impl="mosaic_gpu_blackwell"`): forward, dQ
and dK/dV, checked without a GPU.

The kernels themselves cannot execute here: the Mosaic GPU interpreter of jax 0.10.2 allocates
only GMEM, SMEM and register refs (TMEM raises "Unsupported memory space: tmem") and has no rule
for tcgen05_mma or the TMEM loads and stores. What runs:
- Everything around the kernels, through `tree_attention` and its custom VJP: padding, the
  stacked `end` / `q_pos` tiles, the block lists (forward: 128 x 128; dQ: 128 queries x 64 keys;
  dK/dV: the transposed lists, 128 keys x 64 queries), the base-2 log-sum-exp residual, delta,
  the sinks and their gradient. `forward_call`, `dq_call` and `dkv_call` are replaced by numpy
  models of their contracts written here from the rule (for every listed block, the pairs of
  its positions; the element mask only where the block is PARTIAL; nothing else; P recomputed
  from the lse the forward returned), so a block missing from a list, a block wrongly called
  FULL, a misplaced position tile or a wrong lse layout or scale fails against the dense
  reference and its jax gradients.
- The lowering for CUDA (`jax.export`), which runs Pallas' Mosaic GPU lowering of the kernels.
- MLA (q/k head dim 192, v 128): the same models at Dk != Dv, forward and backward.
- The refusals: dtypes, head dims, context parallelism.
- `auto`'s rule for Blackwell device kinds.
- With `make aot-plugins`: the production compiler (XLA:GPU, Mosaic GPU's NVVM pipeline, ptxas)
  compiles forward + backward for sm_100a (a B200) deviceless; skipped without the plugin.
The kernel bodies' numerics (the tcgen05 products, the online softmax, the recomputed P and dS,
the mask inside the kernels, the TMEM accumulation over a list) are checked only on a Blackwell
GPU, by `python -m jtree.launch.device_check`.
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
from jtree.kernels.attention.mgpu_blackwell_backward import (
    DKV_BLOCK_KV,
    DKV_BLOCK_Q,
    DQ_BLOCK_KV,
    DQ_BLOCK_Q,
)
from jtree.kernels.attention.mgpu_blackwell_forward import BLOCK_Q, forward_block_kv
from jtree.kernels.attention.reference import attention_reference
from jtree.kernels.block_tables import PARTIAL
from tests.attention_cases import qkv
from tests.run_util import WORKTREE
from tests.window_cases import deep_end_pos, oracle_attention, oracle_mask, window_mask

IMPL = "mosaic_gpu_blackwell"
dispatch = importlib.import_module("jtree.kernels.tree_attention")  # the module, not the function
BF16_REL = 2.0 ** -7  # two bf16 roundings (the output, and the oracle's inputs are the same)


def _positions(end, q_pos, window):
    """(key ends, key paths, query positions, query paths) of the kernels' stacked tiles."""
    if window is None:
        return end, None, q_pos, None
    return end[:, 0], end[:, 1], q_pos[:, 0], q_pos[:, 1]


def _computed(table, count, r, cta, own, other_block, n_other, visible):
    """[own, n_other] bool: the pairs CTA `cta` of row `r` computes. Its list's blocks of
    `other_block` positions whole, the element mask `visible(own, others)` only on PARTIAL
    ones, nothing outside the list."""
    seen = np.zeros((own.stop - own.start, n_other), bool)
    blocks, kinds = table[r, cta].reshape(2, -1)[:, :count[r, cta]]
    for b, kind in zip(blocks, kinds):
        others = slice(b * other_block, (b + 1) * other_block)
        seen[:, others] = True if kind != PARTIAL else visible(own, others)
    return seen


def _visible(r, ends, kpath, qpos, qpath, window, keys_first=False):
    """visible(queries, keys) -> [queries, keys] bool, the rule (j <= i < end[j], the window);
    with `keys_first`, visible(keys, queries) -> [keys, queries]."""
    def visible(queries, keys):
        i, j = qpos[r, queries][:, None], np.arange(keys.start, keys.stop)[None]
        vis = (j <= i) & (i < ends[r, keys][None])
        if window is not None:
            vis &= qpath[r, queries][:, None] - kpath[r, keys][None] < window
        return vis
    return (lambda keys, queries: visible(queries, keys).T) if keys_first else visible


def _logits(s, scale, softcap):
    """(natural logits, d logit / d score) of raw scores."""
    if softcap is None:
        return s * scale, np.full_like(s, scale)
    tanh = np.tanh(s * scale / softcap)
    return softcap * tanh, scale * (1.0 - tanh * tanh)


def _callback(run, shapes, *args):
    return jax.pure_callback(
        lambda *a: tuple(x.astype(np.float32) for x in run(*(np.asarray(y) for y in a))),
        tuple(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes), *args)


def _modelled_forward(q, k, v, end, q_pos, table, count, *, stages, scale, softcap, window):
    """What `forward_call` computes from its inputs, in numpy float64: per 128-query block, the
    listed kv-blocks (of the kernel's `forward_block_kv` keys) only, the element mask only on
    PARTIAL ones. (O [.., Dv], base-2 lse)."""
    del stages
    block_kv = forward_block_kv(q.shape[3])
    out_shape = (*q.shape[:3], v.shape[3])

    def run(q, k, v, end, q_pos, table, count):
        q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
        rows, sq, hq, _ = q.shape
        skv, g = k.shape[1], hq // k.shape[2]
        ends, kpath, qpos, qpath = _positions(end, q_pos, window)
        out, lse = np.zeros(out_shape), np.zeros((rows, hq, sq))
        for r in range(rows):
            visible = _visible(r, ends, kpath, qpos, qpath, window)
            for qb in range(table.shape[1]):
                qs = slice(qb * BLOCK_Q, (qb + 1) * BLOCK_Q)
                seen = _computed(table, count, r, qb, qs, block_kv, skv, visible)
                for h in range(hq):
                    s = np.where(seen, _logits(q[r, qs, h] @ k[r, :, h // g].T, scale,
                                               softcap)[0], -np.inf)
                    m = s.max(axis=1, keepdims=True)
                    p = np.exp(s - m)
                    out[r, qs, h] = p @ v[r, :, h // g] / p.sum(axis=1, keepdims=True)
                    lse[r, h, qs] = (m[:, 0] + np.log(p.sum(axis=1))) / np.log(2.0)
        return out, lse

    out, lse = _callback(run, (out_shape, (q.shape[0], q.shape[2], q.shape[1])),
                         q, k, v, end, q_pos, table, count)
    return out.astype(q.dtype), lse


def _probabilities(s, seen, lse2, scale, softcap):
    """(P, d logit / d score) of raw scores `s` from the forward's base-2 lse (broadcast), zero
    where the kernel computes nothing: the backward kernels' recomputation."""
    logits, factor = _logits(s, scale, softcap)
    return np.where(seen, np.exp2(logits / np.log(2.0) - lse2), 0.0), factor


def _modelled_dq(q, do, lse, delta, k, v, end, q_pos, table, count, *, stages, scale, softcap,
                 window):
    """What `dq_call` computes: per 128-query block over its listed 64-key blocks,
    dQ = sum P (dP - delta) dlogit K with P = 2^(t - lse)."""
    del stages

    def run(q, do, lse, delta, k, v, end, q_pos, table, count):
        q, do, k, v = (np.asarray(x, np.float64) for x in (q, do, k, v))
        rows, _, hq, _ = q.shape
        g = hq // k.shape[2]
        ends, kpath, qpos, qpath = _positions(end, q_pos, window)
        dq = np.zeros_like(q)
        for r in range(rows):
            visible = _visible(r, ends, kpath, qpos, qpath, window)
            for qb in range(table.shape[1]):
                qs = slice(qb * DQ_BLOCK_Q, (qb + 1) * DQ_BLOCK_Q)
                seen = _computed(table, count, r, qb, qs, DQ_BLOCK_KV, k.shape[1], visible)
                for h in range(hq):
                    kk, vv = k[r, :, h // g], v[r, :, h // g]
                    p, factor = _probabilities(q[r, qs, h] @ kk.T, seen, lse[r, h, qs, None],
                                               scale, softcap)
                    ds = p * (do[r, qs, h] @ vv.T - delta[r, h, qs, None]) * factor
                    dq[r, qs, h] = ds @ kk
        return (dq,)

    (dq,) = _callback(run, (q.shape,), q, do, lse, delta, k, v, end, q_pos, table, count)
    return dq.astype(q.dtype)


def _modelled_dkv(q, do, lse, delta, k, v, end, q_pos, table, count, *, stages, scale, softcap,
                  window):
    """What `dkv_call` computes: per 128-key block over its listed 64-query blocks and every q
    head of the GQA group, dV = sum P^T dO and dK = sum dS^T Q."""
    del stages

    def run(q, do, lse, delta, k, v, end, q_pos, table, count):
        q, do, k, v = (np.asarray(x, np.float64) for x in (q, do, k, v))
        rows, sq, hq, _ = q.shape
        g = hq // k.shape[2]
        ends, kpath, qpos, qpath = _positions(end, q_pos, window)
        dk, dv = np.zeros_like(k), np.zeros_like(v)
        for r in range(rows):
            visible = _visible(r, ends, kpath, qpos, qpath, window, keys_first=True)
            for kb in range(table.shape[1]):
                ks = slice(kb * DKV_BLOCK_KV, (kb + 1) * DKV_BLOCK_KV)
                seen = _computed(table, count, r, kb, ks, DKV_BLOCK_Q, sq, visible)
                for h in range(hq):
                    kk, vv = k[r, ks, h // g], v[r, ks, h // g]
                    pt, factor = _probabilities(kk @ q[r, :, h].T, seen, lse[r, h, None],
                                                scale, softcap)
                    dv[r, ks, h // g] += pt @ do[r, :, h]
                    dst = pt * (vv @ do[r, :, h].T - delta[r, h, None]) * factor
                    dk[r, ks, h // g] += dst @ q[r, :, h]
        return dk, dv

    dk, dv = _callback(run, (k.shape, v.shape), q, do, lse, delta, k, v, end, q_pos, table,
                       count)
    return dk.astype(k.dtype), dv.astype(v.dtype)


@pytest.fixture
def modelled_kernel(monkeypatch):
    monkeypatch.setattr(mgpu_blackwell, "forward_call", _modelled_forward)
    monkeypatch.setattr(mgpu_blackwell, "dq_call", _modelled_dq)
    monkeypatch.setattr(mgpu_blackwell, "dkv_call", _modelled_dkv)


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


def _reference_grads(q, k, v, end, d_out, *, softcap=None, q_pos=None, window=None,
                     key_pos=None, sinks=None):
    """(out, dq, dk, dv[, dsinks]): jax.vjp of the dense reference in float32 (the keys' end
    `end` and positions `key_pos` cover every key; queries at key positions `q_pos`)."""
    f32 = lambda x: jnp.asarray(x, jnp.float32)

    def attend(q, k, v, *sk):
        return attention_reference(q, k, v, jnp.asarray(end), scale=q.shape[-1] ** -0.5,
                                   softcap=softcap, q_pos=q_pos, window=window,
                                   key_pos=key_pos, sinks=sk[0] if sk else None)

    args = (f32(q), f32(k), f32(v)) + (() if sinks is None else (sinks,))
    out, pull = jax.vjp(attend, *args)
    return (out, *pull(f32(d_out)))


@pytest.mark.parametrize("hq, hkv, d, dv, window, sinks, softcap, prefix", [
    (4, 1, 64, 64, None, False, None, 0),  # GQA 4
    (2, 2, 128, 128, 40, True, None, 0),  # window + sinks
    (4, 2, 64, 64, None, False, 20.0, 0),  # soft-cap
    (4, 2, 64, 64, 70, False, None, 130),  # a cached prefix (q_pos) with a window
    (4, 2, 192, 128, 40, True, None, 0),  # MLA (64-key forward blocks), GQA 2, window + sinks
    pytest.param(2, 2, 192, 128, 70, False, None, 130, marks=pytest.mark.slow),  # MLA + prefix
])
def test_backward_block_lists_through_tree_attention(modelled_kernel, hq, hkv, d, dv, window,
                                                     sinks, softcap, prefix):
    """Forward and backward at S = 300 (a deep, branching forest): the custom VJP, the delta
    and lse residuals, the transposed q lists and the kv lists at the backward's block sizes,
    read by the models of the kernels' contracts, give the dense reference's gradients (MLA:
    q, k of head dim d, v, out, dO of dv)."""
    s = 300
    end, pos = deep_end_pos(seed=d + hq + prefix, s=s, rows=2, trees=3, seg=(3, 24))
    q, k, v = qkv(hq + 7, 2, s, hq, hkv, d, jnp.bfloat16, dv=dv)
    d_out = qkv(hq + 8, 2, s - prefix, hq, hkv, dv, jnp.bfloat16)[0]
    sk = jnp.asarray(np.linspace(-1.0, 1.0, hq), jnp.float32) if sinks else None
    p = prefix

    def attend(q, k, v, *sk):
        cached = {"prefix_k": k[:, :p], "prefix_v": v[:, :p]} if p else {}
        return tree_attention(q, k[:, p:], v[:, p:], window_mask(end, pos, window, prefix=p),
                              impl=IMPL, softcap=softcap, sinks=sk[0] if sk else None, **cached)

    args = (q[:, p:], k, v) + (() if sk is None else (sk,))
    out, pull = jax.vjp(attend, *args)
    got = (out, *pull(d_out))
    q_pos = jnp.broadcast_to(jnp.arange(p, s), (2, s - p)) if p else None
    want = _reference_grads(q[:, p:], k, v, end, d_out, softcap=softcap, q_pos=q_pos,
                            window=window, key_pos=None if window is None else jnp.asarray(pos),
                            sinks=sk)
    for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        assert g.shape == w.shape, (name, g.shape, w.shape)
        _assert_close(g, w, name)


def _export(fn, *shapes):
    args = [jax.ShapeDtypeStruct(s, dt) for s, dt in shapes]
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args)
    return re.findall(r"custom_call @(\w+)", exported.mlir_module())


@pytest.mark.parametrize("head_dim, value_head_dim", [(64, 64), (128, 128), (192, 128)])
def test_lowers_for_cuda(head_dim, value_head_dim):
    """Pallas' Mosaic GPU lowering of the tcgen05 kernels, forward, dQ and dK/dV, through
    `tree_attention` (S padded), GQA 4, with a window and sinks (192 / 128: MLA)."""
    s, bf16, i32 = 1000, jnp.bfloat16, jnp.int32

    def loss(q, k, v, end, pos, sinks):
        out = tree_attention(q, k, v, TreeMask(end, positions=pos, window=128), impl=IMPL,
                             sinks=sinks)
        return out.astype(jnp.float32).sum()

    shapes = [((1, s, 8, head_dim), bf16), ((1, s, 2, head_dim), bf16),
              ((1, s, 2, value_head_dim), bf16), ((1, s), i32), ((1, s), i32),
              ((8,), jnp.float32)]
    assert _export(jax.grad(loss, argnums=(0, 1, 2, 5)), *shapes) == ["mosaic_gpu_v2"] * 3


@pytest.mark.parametrize("dims, smem_kib, tmem_columns", [
    ((64, 64), "114/82/82", "192/192/256"),
    ((128, 128), "194/146/146", "256/256/384"),
    # MLA, by hand: forward Q 48 + K ring 2 x 64 x 192 x 2 B = 48 + V ring 32 + P 128 x 64 x 2 B
    # = 16 + O 32 KiB, plus 2 KiB of lists, positions and lse; TMEM S 64 + O 128. dQ: Q 48 +
    # dO 32 + K ring 48 + V ring 32 + dS 16 (+2); S 64 + dP 64 + dQ 192. dK/dV: K 48 + V 32 +
    # Q ring 48 + dO ring 32 + P^T 16 (+2); S^T 64 + dP^T 64 + dK 192 + dV 128.
    ((192, 128), "178/178/178", "192/320/448"),
])
def test_each_kernel_fits_a_cta(dims, smem_kib, tmem_columns):
    """Forward / dQ / dK-dV buffers at S = 4096, bf16, two stages: what `compile_kernels`
    reports, within a CTA's 227 KiB of SMEM and 512 TMEM columns."""
    from jtree.launch.bench.compile_kernels import Case, kernel_resources

    got = kernel_resources(Case(IMPL, dims[0], "bfloat16", value_head_dim=dims[1]))
    assert got == {"smem_kib": smem_kib, "tmem_columns": tmem_columns}
    assert max(map(int, smem_kib.split("/"))) <= 227
    assert max(map(int, tmem_columns.split("/"))) <= 512


@pytest.mark.parametrize("dtype, hd, dv, match", [
    (jnp.float32, 64, 64, r"must all be bfloat16 or float16 \(tcgen05 operands\)"),
    (jnp.bfloat16, 256, 256, r"^mosaic_gpu_blackwell: head dims q/k 256, v 256: .* must be one "
                             r"of \(\(64, 64\), \(128, 128\), \(192, 128\)\)"),
    (jnp.float16, 96, 96, "head_dim=96 must be a multiple of 64"),
    (jnp.bfloat16, 128, 64, "^mosaic_gpu_blackwell: head dims q/k 128, v 64: "),  # other MLA dims
    (jnp.bfloat16, 192, 192, "^mosaic_gpu_blackwell: head dims q/k 192, v 192: "),
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


@pytest.mark.parametrize("head_dim, gqa, variant", [
    (64, 4, ""), (128, 4, ""),
    pytest.param(192, 1, "", marks=pytest.mark.slow),  # MLA: v's head dim 128
])
def test_compiles_for_sm100a_deviceless(tmp_path, head_dim, gqa, variant):
    """The production compiler compiles forward + backward (three kernels) for a B200 at
    S = 4096, bf16 (that case of `compile_kernels`' gpu-b200x8 sweep, in its worker)."""
    from jtree.launch.bench.compile_kernels import sweep
    from jtree.launch.compile import WORKER_ENV

    folder = _aot_cuda()
    index = sweep("gpu-b200x8").index(
        next(c for c in sweep("gpu-b200x8") if c.kernel == IMPL and c.head_dim == head_dim
             and c.gqa == gqa and c.variant == variant and c.backward))
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
    assert result["custom_calls"] == {"mosaic_gpu_v2": 3}, result


@pytest.mark.parametrize("device_kind", ["NVIDIA B200", "NVIDIA GB200", "NVIDIA B300 SXM6 AC"])
def test_auto_trains_on_blackwell_with_the_tcgen05_kernel(device_kind):
    """With its backward, `auto` picks this kernel on Blackwell for what it runs (training
    too, MLA's 192 / 128 included), and only that: fp32 and other head dims stay on the Triton
    kernel."""
    assert dispatch.gpu_impl(device_kind, jnp.bfloat16, 128) == IMPL
    assert dispatch.has_backward(IMPL)
    assert dispatch.gpu_impl(device_kind, jnp.bfloat16, 128) == IMPL
    assert dispatch.gpu_impl(device_kind, jnp.float16, 64) == IMPL
    assert dispatch.gpu_impl(device_kind, jnp.float32, 128) == "pallas_triton"
    assert dispatch.gpu_impl(device_kind, jnp.bfloat16, 256) == "pallas_triton"
    assert dispatch.gpu_impl(device_kind, jnp.bfloat16, 192, 128) == IMPL  # MLA
    assert dispatch.gpu_impl(device_kind, jnp.float16, 192, 128) == IMPL
    assert dispatch.gpu_impl(device_kind, jnp.float32, 192, 128) == "pallas_triton"
    assert dispatch.gpu_impl(device_kind, jnp.bfloat16, 192, 192) == "pallas_triton"
    assert dispatch.gpu_impl(device_kind, jnp.bfloat16, 128, 64) == "pallas_triton"
    assert dispatch.resolve_impl("auto", "gpu", dtype=jnp.bfloat16, head_dim=192,
                                 value_head_dim=128, device_kind=device_kind) == IMPL
    assert dispatch.gpu_impl("NVIDIA GeForce RTX 5090", jnp.bfloat16, 128) == "triton_lang"
    assert dispatch.gpu_impl("NVIDIA H100 80GB HBM3", jnp.bfloat16, 128) == "pallas_mosaic_gpu"
