"""Sliding window along the path and attention sinks: every implementation against a dense
oracle written in the test (tests/window_cases.py), forward and gradients of q, k, v and the
sinks; the block tables skip the blocks outside every query's window (counted against numpy)."""

import numpy as np
import pytest

from jtree.kernels import TreeMask, tree_attention
from jtree.kernels.block_tables import EMPTY, FULL, classify_blocks
from tests.window_cases import (
    check_against_oracle,
    deep_end_pos,
    oracle_mask,
    path_depth,
    tree_end_pos,
)

SLOW = pytest.mark.slow


def _small(seed):
    """Rows of 96 tokens (blocks of 16 in the tests): long paths (35-50 tokens deep) branching at
    several levels for even seeds, bushy random forests (paths up to ~30) for odd ones."""
    if seed % 2:
        return tree_end_pos(seed, 96)
    return deep_end_pos(seed, 96, seg=(2, 12))


def test_positions_are_path_depths():
    for seed in (2, 3):
        end, pos = _small(seed)
        assert (pos == path_depth(end)).all()
    end, pos = _small(0)
    assert pos.max() > 40  # windows of 16 and 40 below: smaller than a path


# windows smaller than, equal to and larger than a block (16) and than a path (35-50)
@pytest.mark.parametrize("window, sinks", [
    (1, False), (16, True), (200, True),
    *(pytest.param(w, sk, marks=SLOW) for w, sk in ((1, True), (5, False), (5, True),
                                                    (16, False), (40, False), (40, True),
                                                    (200, False))),
])
def test_xla(window, sinks):
    end, pos = _small(window + sinks)
    check_against_oracle("xla", end, pos, window, sinks=sinks, block_q=16, block_kv=16)


@pytest.mark.parametrize("sinks", [True, pytest.param(False, marks=SLOW)])
def test_reference(sinks):
    end, pos = tree_end_pos(7, 80)
    check_against_oracle("reference", end, pos, 9, sinks=sinks)


def test_sinks_without_window():
    end, pos = tree_end_pos(11, 64)
    check_against_oracle("xla", end, pos, None, sinks=True, block_q=16, block_kv=32)


def _count_blocks(end, pos, window, bq, bk, q_pos=None):
    """(non-empty, full) block counts from the element mask, by brute force in numpy."""
    m = oracle_mask(end, pos, window, q_pos)
    rows, sq, skv = m.shape
    blk = m.reshape(rows, sq // bq, bq, skv // bk, bk)
    return int(blk.any(axis=(2, 4)).sum()), int(blk.all(axis=(2, 4)).sum())


@pytest.mark.parametrize("window", [1, 8, 16, 33, None])
def test_block_tables_skip_outside_window(window):
    """A deep chain (one path of 256 tokens) and a branching forest: the tables keep every block
    with a visible pair, and on the chain exactly those (the window test is exact on a chain);
    FULL only where every pair is visible."""
    s, bq, bk = 256, 16, 16
    chain_end = np.full((1, s), s, np.int32)
    chain_pos = np.arange(s, dtype=np.int32)[None]
    classes = classify_blocks(chain_end, bq, bk, window=window, key_pos=chain_pos)
    nonempty, full = _count_blocks(chain_end, chain_pos, window, bq, bk)
    assert int((classes != EMPTY).sum()) == nonempty
    assert int((classes == FULL).sum()) == full
    if window is not None:
        dense = s // bq * (s // bq + 1) // 2
        assert nonempty < dense  # the window skipped blocks
    end, pos = tree_end_pos(5, s, rows=2, max_seg=30)
    classes = classify_blocks(end, bq, bk, window=window, key_pos=pos)
    m = oracle_mask(end, pos, window)
    blk = m.reshape(2, s // bq, bq, s // bk, bk)
    assert not (blk.any(axis=(2, 4)) & (classes == EMPTY)).any()  # never drops a visible pair
    assert not ((classes == FULL) & ~blk.all(axis=(2, 4))).any()  # FULL only if all visible


def test_window_needs_positions():
    with pytest.raises(ValueError, match="window"):
        TreeMask(np.array([[1]], np.int32), window=0)


def _split_forms(impl, window, sinks, **options):
    """The prefix (redundancy-free) and context-parallel (query offset) forms on one forest."""
    end, pos = deep_end_pos(21, 128, seg=(2, 16))
    check_against_oracle(impl, end, pos, window, sinks=sinks, prefix=40, **options)
    check_against_oracle(impl, end, pos, window, sinks=sinks, query_offset=64, n_queries=64,
                         **options)


@pytest.mark.parametrize("window", [24, pytest.param(3, marks=SLOW)])
def test_xla_prefix_and_query_offset(window):
    _split_forms("xla", window, True, block_q=16, block_kv=16)


@pytest.mark.parametrize("window, sinks", [
    (7, False), (16, True),
    pytest.param(1, True, marks=SLOW), pytest.param(40, True, marks=SLOW),
    pytest.param(300, True, marks=SLOW)])
def test_cpu(window, sinks):
    end, pos = _small(window + 1)
    check_against_oracle("cpu", end, pos, window, sinks=sinks, block_q=16, block_kv=16)


def test_cpu_prefix_and_query_offset():
    _split_forms("cpu", 10, True, block_q=16, block_kv=16)


@pytest.mark.parametrize("window, sinks", [
    (23, True), *(pytest.param(w, sk, marks=SLOW) for w, sk in ((1, True), (16, True),
                                                               (23, False), (500, True)))])
def test_triton_interpreted(window, sinks):
    end, pos = _small(window)
    check_against_oracle("pallas_triton", end, pos, window, sinks=sinks, block_q=16,
                         block_kv=16, interpret=True)


@SLOW
def test_triton_prefix():
    end, pos = deep_end_pos(21, 128, seg=(2, 16))
    check_against_oracle("pallas_triton", end, pos, 10, sinks=True, prefix=40, block_q=16,
                         block_kv=32, interpret=True)


def _lowered_cuda(impl, dtype, window, sinks, **options):
    """The StableHLO text of forward + backward (q, k, v, sinks) lowered for CUDA at S=4096."""
    import jax
    import jax.numpy as jnp
    rows, s, hq, hkv, d = 1, 4096, 8, 2, 128
    shapes = [jax.ShapeDtypeStruct((rows, s, h, d), dtype) for h in (hq, hkv, hkv)]
    shapes += [jax.ShapeDtypeStruct((rows, s), jnp.int32)] * 2
    shapes.append(jax.ShapeDtypeStruct((hq,), jnp.float32))

    def loss(q, k, v, e, p, sk):
        out = tree_attention(q, k, v, TreeMask(e, positions=p, window=window), impl=impl,
                             sinks=sk if sinks else None, **options)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    grad = jax.grad(loss, argnums=(0, 1, 2, 5))
    return jax.jit(grad).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


def test_triton_lowers_for_cuda():
    import jax.numpy as jnp
    text = _lowered_cuda("pallas_triton", jnp.bfloat16, 128, True)
    assert text.count("custom_call @__gpu$xla.gpu.triton") == 3


@pytest.mark.timeout(600)
@pytest.mark.parametrize("window, sinks", [
    (150, True), *(pytest.param(w, sk, marks=SLOW) for w, sk in ((1, True), (100, True),
                                                                (128, False), (700, True)))])
def test_tpu_interpreted(window, sinks):
    """Blocks of 128, paths 120-180 deep: windows below, at and above a block, below and above
    every path."""
    end, pos = deep_end_pos(window % 4, 384)
    assert pos.max() > 120
    check_against_oracle("pallas_tpu", end, pos, window, sinks=sinks, d=64, interpret=True)


@SLOW
@pytest.mark.timeout(600)
def test_tpu_prefix_and_query_offset():
    end, pos = deep_end_pos(5, 384)
    check_against_oracle("pallas_tpu", end, pos, 50, sinks=True, prefix=128, d=64,
                         interpret=True)
    check_against_oracle("pallas_tpu", end, pos, 50, sinks=True, query_offset=128,
                         n_queries=256, d=64, interpret=True)


@SLOW
@pytest.mark.timeout(600)
def test_tpu_interpreter_params(monkeypatch):
    """The TPU interpreter proper (simulated DMAs, race detection, two cores) with a window: the
    oracle's numbers and no races in the forward, dq and dkv launches."""
    from jax.experimental.pallas import tpu as pltpu

    from tests.attention_cases import recorded_tpu_races

    launches = recorded_tpu_races(monkeypatch)
    end, pos = deep_end_pos(1, 256, rows=1, trees=2, seg=(4, 30))
    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
    check_against_oracle("pallas_tpu", end, pos, 40, sinks=True, hq=2, hkv=1, d=64,
                         interpret=params)
    assert len(launches) == 3 and not any(r.races_found for r in launches)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_tpu_exports_with_window_and_sinks(dtype):
    """Forward + backward (q, k, v, sinks) lowers for TPU at S=8192: three Mosaic kernels."""
    import jax
    import jax.numpy as jnp
    rows, s, hq, hkv, d = 1, 8192, 8, 2, 128
    shapes = [jax.ShapeDtypeStruct((rows, s, h, d), jnp.dtype(dtype)) for h in (hq, hkv, hkv)]
    shapes += [jax.ShapeDtypeStruct((rows, s), jnp.int32)] * 2
    shapes.append(jax.ShapeDtypeStruct((hq,), jnp.float32))

    def loss(q, k, v, e, p, sk):
        out = tree_attention(q, k, v, TreeMask(e, positions=p, window=128), impl="pallas_tpu",
                             sinks=sk)
        return out.astype(jnp.float32).sum()

    exported = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 5))),
                                 platforms=["tpu"])(*shapes)
    assert exported.mlir_module().count("tpu_custom_call") == 3


def _mgpu_interpreted(tmp_path, end, pos, window, *, prefix=0, seed=0, hq=4, hkv=2, d=64):
    """Run the Mosaic GPU kernels in the interpreter (a child process, jtree.launch.bench.mgpu_interpret)
    with window and sinks; compare with the dense oracle on the same bf16 values (relative to the
    largest oracle magnitude: the kernels round P, dS and the outputs to bf16)."""
    import os
    import subprocess
    import sys

    import jax
    import jax.numpy as jnp

    from tests.run_util import WORKTREE
    from tests.window_cases import oracle_attention, sink_gradient_scale

    rows, s = end.shape
    rng = np.random.default_rng(seed)
    bf = lambda *shape: np.asarray(jnp.asarray(rng.normal(size=shape), jnp.bfloat16), np.float32)
    q, k, v = bf(rows, s, hq, d), bf(rows, s, hkv, d), bf(rows, s, hkv, d)
    d_out = rng.normal(size=(rows, s, hq, d)).astype(np.float32)  # the layout's; [:, prefix:] used
    sinks = (rng.normal(size=hq) + 1).astype(np.float32)
    source, target = tmp_path / "in.npz", tmp_path / "out.npz"
    np.savez(source, q=q, k=k, v=v, d_out=d_out, end=end, dtype="bfloat16", softcap=np.nan,
             block_kv=0, prefix=prefix, window=window, positions=pos, sinks=sinks)
    env = dict(os.environ, PYTHONPATH=str(WORKTREE))
    run = subprocess.run([sys.executable, "-m", "jtree.launch.bench.mgpu_interpret", str(source),
                          str(target)], cwd=WORKTREE, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-5000:]
    with np.load(target) as result:
        assert not result["races"]
        got = [result[n] for n in ("out", "dq", "dk", "dv", "dsinks")]
    q_pos = np.broadcast_to(np.arange(prefix, s), (rows, s - prefix))
    mask = oracle_mask(end, pos, window, q_pos)
    out, vjp = jax.vjp(lambda q, k, v, sk: oracle_attention(q, k, v, mask, sk),
                       jnp.asarray(q[:, prefix:]), jnp.asarray(k), jnp.asarray(v),
                       jnp.asarray(sinks))
    want = [out, *vjp(jnp.asarray(d_out[:, prefix:]))]
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        w = np.asarray(w)
        err = np.abs(g - w).max() / np.abs(w).max()
        assert err <= 1e-2, (name, err)
    # The sinks' gradient is a signed sum over every query of p_sink * (dO . O), O rounded to
    # bf16: its error is relative to the sum of the terms' sizes, not to the (cancelled) result.
    terms = np.asarray(sink_gradient_scale(q[:, prefix:], k, v, mask, sinks, d_out[:, prefix:]))
    err = np.abs(got[4] - np.asarray(want[4])) / terms
    assert err.max() <= 1e-2, ("dsinks", err)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_mgpu_interpreted(tmp_path):
    """One row of 128 tokens (one forward block; dQ and dK/dV blocks of 64): two trees with
    paths up to 59 deep, window 20: forward, dQ, dK/dV and the sinks' gradient in the Mosaic GPU
    interpreter with race detection."""
    end, pos = deep_end_pos(3, 128, rows=1, trees=3, seg=(3, 14))
    assert pos.max() > 40
    _mgpu_interpreted(tmp_path, end, pos, 20, hq=2, hkv=1)


@SLOW
@pytest.mark.timeout(900)
def test_mgpu_interpreted_two_blocks(tmp_path):
    """256 tokens (two forward blocks, so the tables skip blocks), paths up to 82 deep, window
    40."""
    end, pos = deep_end_pos(1, 256, rows=1, trees=2, seg=(4, 30))
    _mgpu_interpreted(tmp_path, end, pos, 40, hq=2, hkv=1)


@SLOW
@pytest.mark.timeout(900)
def test_mgpu_interpreted_prefix(tmp_path):
    """A part attending to 128 cached prefix keys (queries at key positions 128 + i), window 60
    below the paths' depth, GQA 2."""
    end, pos = deep_end_pos(2, 256, rows=1, trees=2, seg=(4, 40))
    _mgpu_interpreted(tmp_path, end, pos, 60, prefix=128)


def test_mgpu_lowers_for_cuda():
    import re

    text = _lowered_cuda("pallas_mosaic_gpu", __import__("jax.numpy").numpy.bfloat16, 256, True)
    assert re.findall(r"custom_call @(\w+)", text) == ["mosaic_gpu_v2"] * 3


def test_sinks_inside_shard_map():
    """Replicated sinks with per-device rows (shard_map, check_vma): the sinks' cotangent is
    summed over the data axis, values and gradients equal the unsharded call."""
    import jax
    import jax.numpy as jnp

    end, pos = _small(4)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 96, 4, 32)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, 96, 2, 32)), jnp.float32) for _ in range(2))
    sinks = jnp.asarray(rng.normal(size=4), jnp.float32)
    end, pos = jnp.asarray(end), jnp.asarray(pos)

    def loss(q, k, v, sk, e, p):
        out = tree_attention(q, k, v, TreeMask(e, positions=p, window=16), impl="xla", sinks=sk,
                             block_q=16, block_kv=16)
        return jnp.sum(out ** 2)

    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rows, rep = jax.sharding.PartitionSpec("data"), jax.sharding.PartitionSpec()
    sharded = jax.shard_map(lambda *a: jax.lax.psum(loss(*a), "data"), mesh=mesh,
                            in_specs=(rows, rows, rows, rep, rows, rows), out_specs=rep,
                            check_vma=True)
    got = jax.jit(jax.value_and_grad(sharded, argnums=(0, 1, 2, 3)))(q, k, v, sinks, end, pos)
    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, sinks, end, pos)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for a, b in zip(got[1], want[1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_window_is_static_and_positions_a_leaf():
    import jax

    end = np.array([[3, 3, 3]], np.int32)
    pos = np.array([[0, 1, 2]], np.int32)
    mask = TreeMask(end, positions=pos, window=2)
    leaves, treedef = jax.tree.flatten(mask)
    assert any(leaf is pos for leaf in leaves) and all(isinstance(x, np.ndarray) for x in leaves)
    assert jax.tree.unflatten(treedef, leaves).window == 2
    assert jax.jit(lambda m: m.positions.sum() + m.window)(mask) == 5
    assert jax.tree.map(lambda x: x, mask).window == 2
