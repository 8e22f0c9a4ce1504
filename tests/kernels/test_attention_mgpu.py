"""Mosaic GPU (Hopper) tree-attention kernels, checked without a GPU.

- Numerics: the three kernels (forward, dQ, dK/dV) run end to end in the Mosaic GPU interpreter
  with race detection on (in a child process with a hard timeout, see launch/bench/mgpu_interpret.py),
  through `tree_attention` (which pads the lengths), at the kernels' default blocks unless a test
  says otherwise, and are compared with the dense reference. Inputs are bfloat16 or float16 (what
  wgmma multiplies); the reference runs in float32 on the same values. Tolerance: max abs error
  <= BF16_TOL x the largest reference magnitude (bf16 keeps 8 significant bits, f16 11; the
  kernels round P, dS and the outputs to the input dtype once each).
- Prefix calls (a part attending to cached prefix keys): the own queries' outputs and dq, and dk,
  dv of every key, against the square reference of the whole layout.
- Lowering: `jax.export` for `cuda` runs the real Pallas -> Mosaic GPU lowering (SMEM limits, TMA
  rules, unsupported primitives) at a realistic size, with and without a prefix.
- Errors for what the kernels cannot honour.
"""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtree.kernels import TreeMask, tree_attention
from jtree.kernels.attention.mgpu import SEQ_MULTIPLE, attention_mgpu
from jtree.kernels.attention.reference import attention_reference
from jtree.kernels.block_tables import EMPTY, FULL, PARTIAL, classify_blocks
from jtree.layout.linearize import linearize
from jtree.trees.tree import TrajectoryTree
from tests.run_util import WORKTREE
from tests.strategies import random_forest

BF16_TOL = 1e-2
INTERPRETER_TIMEOUT_S = 900


def _inputs(end, q_heads, kv_heads, head_dim, seed=0, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    rows, seq = end.shape
    q, k, v = (jnp.asarray(rng.normal(size=(rows, seq, h, head_dim)), dtype)
               for h in (q_heads, kv_heads, kv_heads))
    d_out = jnp.asarray(rng.normal(size=(rows, seq, q_heads, head_dim)), jnp.float32)
    return q, k, v, d_out


def _kernel(tmp_path, q, k, v, end, d_out, *, softcap=None, block_kv=0, prefix=0):
    """[out, dq, dk, dv] of the Mosaic GPU kernels run in the interpreter (float32 numpy);
    `block_kv` 0 is the kernel's default, `prefix` P > 0 makes tokens [:P] cached prefix keys."""
    source, target = tmp_path / "in.npz", tmp_path / "out.npz"
    np.savez(source, q=np.asarray(q, np.float32), k=np.asarray(k, np.float32),
             v=np.asarray(v, np.float32), d_out=np.asarray(d_out), end=np.asarray(end),
             dtype=str(q.dtype), softcap=np.nan if softcap is None else softcap,
             block_kv=block_kv, prefix=prefix)
    env = dict(os.environ, PYTHONPATH=str(WORKTREE))
    run = subprocess.run([sys.executable, "-m", "jtree.launch.bench.mgpu_interpret", str(source), str(target)],
                         cwd=WORKTREE, env=env, capture_output=True, text=True,
                         timeout=INTERPRETER_TIMEOUT_S)
    assert run.returncode == 0, f"interpreter run failed:\n{run.stderr[-5000:]}"
    with np.load(target) as result:
        assert not result["races"], "the Mosaic GPU interpreter detected a data race"
        return [result[n] for n in ("out", "dq", "dk", "dv")]


def _reference(q, k, v, end, d_out, *, softcap=None, prefix=0):
    """[out, dq, dk, dv] of the dense reference in float32 on the same (bf16/f16) values, on the
    square layout: with a prefix P, only queries [P:] count (their outputs, dq and cotangents)."""
    attend = lambda q, k, v: attention_reference(q, k, v, end, scale=q.shape[-1] ** -0.5,
                                                 softcap=softcap)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    out, pull = jax.vjp(attend, *f32)
    dq, dk, dv = pull(d_out.at[:, :prefix].set(0.0))
    return [np.asarray(x) for x in (out[:, prefix:], dq[:, prefix:], dk, dv)]


def _assert_close(got, want, names=("out", "dq", "dk", "dv")):
    for name, g, w in zip(names, got, want):
        err, size = np.abs(g - w).max(), np.abs(w).max()
        assert err <= BF16_TOL * size, f"{name}: max abs error {err:.3g} > {BF16_TOL} x {size:.3g}"


def _branching_trees_end():
    """Two branching trees in one 128-token row, then padding."""
    rng = np.random.default_rng(1)
    trees = [
        TrajectoryTree.from_nodes(  # 3 levels, siblings, a path ending at an internal node
            parents=[-1, 0, 0, 1, 1, 2], segments=[rng.integers(0, 50, n).tolist()
                                                    for n in (20, 9, 14, 6, 11, 7)],
            path_nodes=[3, 4, 5, 1]),
        TrajectoryTree.from_sequences([[7] * 5 + [1] * 20, [7] * 5 + [2] * 9, [7] * 5]),
    ]
    return jnp.asarray(linearize(trees, SEQ_MULTIPLE).inputs.mask.end)


# Slow-marked to keep the default suite's interpreter time down (the prefix and empty-block tests
# below run the interpreter by default); the slow `mgpu_interpret` run
# (tests/e2e/test_entry_points.py) covers GQA too, with and without a prefix.
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_gqa_head_pairs_forward_backward_in_interpreter(tmp_path, dtype):
    """GQA group 2: each CTA holds the same 64 positions of two q heads (head packing); the dK/dV
    kernel sums both heads of the group. Production defaults: block_kv 128, both wgmma dtypes."""
    end = _branching_trees_end()
    q, k, v, d_out = _inputs(end, q_heads=2, kv_heads=1, head_dim=64, dtype=dtype)
    _assert_close(_kernel(tmp_path, q, k, v, end, d_out), _reference(q, k, v, end, d_out))


@pytest.mark.slow
def test_prefix_calls_forward_backward_in_interpreter(tmp_path):
    """A redundancy-free part: the first 70 tokens are cached prefix keys (the first tree's prompt
    and part of its branches), the rest queries; Sq and Skv are padded separately (58 -> 128
    queries, 128 keys), so the q-blocks sit at key positions P + i (`q_pos`). Soft-cap on."""
    end = _branching_trees_end()
    q, k, v, d_out = _inputs(end, q_heads=2, kv_heads=1, head_dim=64, seed=4)
    _assert_close(_kernel(tmp_path, q, k, v, end, d_out, softcap=20.0, prefix=70),
                  _reference(q, k, v, end, d_out, softcap=20.0, prefix=70))


def test_empty_blocks_are_never_read_and_full_blocks_unmasked(tmp_path):
    """A shared 64-token prefix, a 64-token branch A, and a 128-token branch B with children.

    For B's queries the prefix is a FULL block and A an EMPTY one. A's q, k, v are NaN: wgmma
    turns any fetched NaN into NaN outputs (0 * NaN), so B's outputs and gradients are finite and
    exact only if every kernel skips A's blocks for B (forward and dQ: kv-block 1 of q-block 1;
    dK/dV: B's kv-block never lists A's q-blocks). Soft-cap on, one q head per CTA.
    """
    segments = [[3] * 64, [4] * 64, [5] * 32, [6] * 40, [7] * 56]
    tree = TrajectoryTree.from_nodes(parents=[-1, 0, 0, 2, 2], segments=segments)
    end = jnp.asarray(linearize([tree], 256).inputs.mask.end)
    want_end = np.concatenate([np.full(64, 256), np.full(64, 128), np.full(32, 256),
                               np.full(40, 200), np.full(56, 256)])
    np.testing.assert_array_equal(np.asarray(end)[0], want_end)
    # Forward and dQ lists (q-blocks of 128, kv-blocks of 64): B's q-block sees the prefix
    # fully and A not at. dK/dV lists (kv-blocks of 128, q-blocks of 64): B's keys are not seen
    # by the prefix's nor A's queries.
    np.testing.assert_array_equal(classify_blocks(np.asarray(end), 128, 64)[0, 1],
                                  [FULL, EMPTY, PARTIAL, PARTIAL])
    np.testing.assert_array_equal(classify_blocks(np.asarray(end), 64, 128)[0, :, 1],
                                  [EMPTY, EMPTY, PARTIAL, PARTIAL])
    branch_a, branch_b = slice(64, 128), slice(128, 256)

    q, k, v, d_out = _inputs(end, q_heads=1, kv_heads=1, head_dim=64, seed=2)
    poison = lambda x: x.at[:, branch_a].set(jnp.nan)
    got = _kernel(tmp_path, poison(q), poison(k), poison(v), end, d_out, softcap=20.0,
                  block_kv=64)
    want = _reference(q, k, v, end, d_out, softcap=20.0)  # B's results ignore A's values
    for g in got:
        assert np.isfinite(g[:, branch_b]).all()
    _assert_close([g[:, branch_b] for g in got], [w[:, branch_b] for w in want])


@pytest.mark.slow
@pytest.mark.parametrize("q_heads, kv_heads, head_dim, seq, softcap", [
    # Odd group: one head per CTA, dK/dV loops over 3 heads. (Head pairs are the GQA test's
    # above and the `mgpu_interpret` run's, head_dim 128 the lowering tests'.)
    (3, 1, 64, 190, 30.0),
])
def test_random_forests_in_interpreter(tmp_path, q_heads, kv_heads, head_dim, seq, softcap):
    """Random multi-level trees (a shared prompt, siblings, paths ending at internal nodes,
    duplicates) in two or more rows, padding tails; every block kind occurs. (The interpreter's
    time grows with rows x blocks^2: two trees in rows of S 190 suffice.)"""
    rng = np.random.default_rng(seq)
    trees = []
    for _ in range(2):
        forest = random_forest(rng, max_nodes=12, max_seg=24, roots=1, with_rl=False)
        segments = [rng.integers(0, 64, 60).tolist()] + forest["segments"][1:]  # the prompt
        trees.append(TrajectoryTree.from_nodes(forest["parents"], segments,
                                               path_nodes=forest["path_nodes"]))
    end = jnp.asarray(linearize(trees, seq).inputs.mask.end)
    assert end.shape[0] >= 2 and (np.diff(np.asarray(end), axis=1) < 0).any()  # rows, branches
    pad_end = np.arange(seq + 1, seq + 1 + -seq % SEQ_MULTIPLE)  # as attention_mgpu pads
    padded = np.concatenate(
        [np.asarray(end), np.broadcast_to(pad_end, (end.shape[0], pad_end.size))], axis=1)
    assert set(np.unique(classify_blocks(padded, 64, 64))) == {EMPTY, PARTIAL, FULL}
    q, k, v, d_out = _inputs(end, q_heads, kv_heads, head_dim, seed=3)
    _assert_close(_kernel(tmp_path, q, k, v, end, d_out, softcap=softcap),
                  _reference(q, k, v, end, d_out, softcap=softcap))


def _export(fn, *shapes):
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args)
    return re.findall(r"custom_call @(\w+)", exported.mlir_module())


@pytest.mark.parametrize("q_heads, kv_heads, head_dim, softcap", [
    (8, 2, 128, None),  # head pairs per CTA
    (4, 4, 128, 30.0),  # one head per CTA
    (2, 1, 64, None),
])
def test_lowers_for_cuda_forward_and_backward_at_8k(q_heads, kv_heads, head_dim, softcap):
    """The real Pallas -> Mosaic GPU lowering, through the public dispatch: one kernel forward,
    three for forward + backward (forward, dQ, dK/dV)."""
    rows, seq = 1, 8192
    shapes = [((rows, seq, q_heads, head_dim), jnp.bfloat16),
              ((rows, seq, kv_heads, head_dim), jnp.bfloat16),
              ((rows, seq, kv_heads, head_dim), jnp.bfloat16),
              ((rows, seq), jnp.int32)]
    attend = lambda q, k, v, e: tree_attention(q, k, v, TreeMask(e), impl="pallas_mosaic_gpu",
                                               softcap=softcap)
    assert _export(attend, *shapes) == ["mosaic_gpu_v2"]
    loss = lambda q, k, v, e: jnp.sum(attend(q, k, v, e).astype(jnp.float32) ** 2)
    assert _export(jax.grad(loss, argnums=(0, 1, 2)), *shapes) == ["mosaic_gpu_v2"] * 3


def test_prefix_call_lowers_for_cuda_forward_and_backward():
    """A part of 8000 own tokens over 1000 cached prefix keys (Sq 8064, Skv 9088 once padded)."""
    p, s = 1000, 8000
    shapes = [((1, s, 8, 128), jnp.bfloat16), ((1, s, 2, 128), jnp.bfloat16),
              ((1, s, 2, 128), jnp.bfloat16), ((1, p, 2, 128), jnp.bfloat16),
              ((1, p, 2, 128), jnp.bfloat16), ((1, s), jnp.int32), ((1, p), jnp.int32)]
    attend = lambda q, k, v, pk, pv, e, pe: tree_attention(
        q, k, v, TreeMask(e, pe), impl="pallas_mosaic_gpu", prefix_k=pk, prefix_v=pv)
    assert _export(attend, *shapes) == ["mosaic_gpu_v2"]
    loss = lambda *a: jnp.sum(attend(*a).astype(jnp.float32) ** 2)
    assert _export(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), *shapes) == ["mosaic_gpu_v2"] * 3


def test_head_dim_256_lowers_forward_and_backward_raises_on_smem():
    shapes = [((1, 2048, 2, 256), jnp.bfloat16), ((1, 2048, 1, 256), jnp.bfloat16),
              ((1, 2048, 1, 256), jnp.bfloat16), ((1, 2048), jnp.int32)]
    attend = lambda q, k, v, e: attention_mgpu(q, k, v, e, scale=0.0625)
    assert _export(attend, *shapes) == ["mosaic_gpu_v2"]
    loss = lambda q, k, v, e: jnp.sum(attend(q, k, v, e).astype(jnp.float32))
    with pytest.raises(ValueError, match="dq kernel needs .* KiB of shared memory"):
        _export(jax.grad(loss, argnums=(0, 1, 2)), *shapes)


@pytest.mark.parametrize("dtype, head_dim, kw, match", [
    (jnp.float32, 64, {}, "must all be bfloat16 or float16 \\(wgmma operands\\)"),
    (jnp.bfloat16, 96, {}, "head_dim=96 must be a multiple of 64"),
    (jnp.bfloat16, 64, dict(block_kv=192), "block_kv=192: must be 64 or 128"),
    (jnp.bfloat16, 128, dict(stages=4), "forward kernel needs .* KiB of shared memory"),
])
def test_rejects_what_the_kernel_cannot_honour(dtype, head_dim, kw, match):
    x = jnp.zeros((1, 128, 2, head_dim), dtype)
    end = jnp.arange(1, 129, dtype=jnp.int32)[None]
    with pytest.raises(ValueError, match=match):
        attention_mgpu(x, x, x, end, scale=1.0, **kw)


def test_traces_forward_and_backward_inside_shard_map():
    """Inside `shard_map(check_vma=True)` (the sharded train step), the kernels' outputs must vary
    over the mesh axes their inputs vary over, or the custom_vjp rejects the cotangents."""
    mesh = jax.make_mesh((1, 1), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x = jnp.zeros((2, 128, 2, 64), jnp.bfloat16)
    end = jnp.full((2, 128), 128, jnp.int32)

    def loss(q, k, v, end):
        out = tree_attention(q, k, v, TreeMask(end), impl="pallas_mosaic_gpu")
        return jax.lax.psum(jnp.sum(out.astype(jnp.float32)), "data")

    spec = jax.sharding.PartitionSpec("data")
    step = jax.shard_map(jax.value_and_grad(loss, argnums=(0, 1, 2)), mesh=mesh,
                         in_specs=(spec,) * 4, out_specs=(jax.sharding.PartitionSpec(), (spec,) * 3))
    out_avals = jax.jit(step).trace(x, x, x, end).jaxpr.out_avals
    assert [a.shape for a in out_avals] == [(), x.shape, x.shape, x.shape]
