"""Sliding window along the path and attention sinks: every implementation against a dense
oracle written in the test (tests/window_cases.py), forward and gradients of q, k, v and the
sinks; the block tables skip the blocks outside every query's window (counted against numpy)."""

import numpy as np
import pytest

from jtree.kernels import TreeMask, tree_attention
from jtree.kernels.block_tables import EMPTY, FULL, classify_blocks
from tests.window_cases import check_against_oracle, oracle_mask, path_depth, tree_end_pos


def test_positions_are_path_depths():
    end, pos = tree_end_pos(3, 96)
    assert (pos == path_depth(end)).all()


# windows smaller than, equal to and larger than a block (16) and than a path (<= 96)
@pytest.mark.parametrize("window", [1, 5, 16, 40, 200])
@pytest.mark.parametrize("sinks", [False, True])
def test_xla(window, sinks):
    end, pos = tree_end_pos(window, 96)
    check_against_oracle("xla", end, pos, window, sinks=sinks, block_q=16, block_kv=16)


@pytest.mark.parametrize("sinks", [False, True])
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
    end, pos = tree_end_pos(21, 128, max_seg=20)
    check_against_oracle(impl, end, pos, window, sinks=sinks, prefix=40, **options)
    check_against_oracle(impl, end, pos, window, sinks=sinks, query_offset=64, n_queries=64,
                         **options)


@pytest.mark.parametrize("window", [3, 24])
def test_xla_prefix_and_query_offset(window):
    _split_forms("xla", window, True, block_q=16, block_kv=16)


@pytest.mark.parametrize("window, sinks", [(1, True), (7, False), (16, True), (300, True)])
def test_cpu(window, sinks):
    end, pos = tree_end_pos(window + 1, 96)
    check_against_oracle("cpu", end, pos, window, sinks=sinks, block_q=16, block_kv=16)


def test_cpu_prefix_and_query_offset():
    _split_forms("cpu", 10, True, block_q=16, block_kv=16)


@pytest.mark.parametrize("window, sinks", [(1, True), (16, True), (23, False), (500, True)])
def test_triton_interpreted(window, sinks):
    end, pos = tree_end_pos(window + 2, 96)
    check_against_oracle("pallas_triton", end, pos, window, sinks=sinks, block_q=16,
                         block_kv=16, interpret=True)


def test_triton_prefix():
    end, pos = tree_end_pos(21, 128, max_seg=20)
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
