"""The block-sparse `xla` implementation equals the dense reference: forward and q/k/v gradients
on random branching forests (several trees per row, padding rows), GQA 1/2/4, head_dim 64 and 128,
S not a multiple of the block, differing q and kv block sizes, soft-cap; float32 tolerance 2e-5."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jtree.kernels.attention.xla import schedule_work, tree_attention_xla
from jtree.kernels.block_tables import classify_blocks
from tests.attention_cases import max_errors, qkv, tree_end

F32_TOL = 2e-5


@pytest.mark.parametrize("hq, hkv, d, s, blocks, softcap, group", [
    (4, 4, 64, 200, (32, 32), None, 4),   # GQA 1, S padded 200 -> 224
    (4, 2, 64, 256, (32, 64), 20.0, 3),   # GQA 2, q and kv blocks differ, soft-cap
    (8, 2, 128, 176, (64, 16), None, 1),  # GQA 4, head_dim 128, S padded 176 -> 192
    (4, 1, 128, 256, (None, None), None, 4),  # default blocks (64)
])
def test_matches_reference(hq, hkv, d, s, blocks, softcap, group):
    end = tree_end(seed=s + d, s=s, max_seg=20)
    q, k, v = qkv(0, end.shape[0], s, hq, hkv, d)
    out_err, grad_errs = max_errors(end, q, k, v, impl="xla", softcap=softcap,
                                    block_q=blocks[0], block_kv=blocks[1], group=group)
    assert out_err <= F32_TOL and max(grad_errs) <= F32_TOL, (out_err, grad_errs)


@settings(max_examples=12)
@given(seed=st.integers(0, 2**31 - 1))
def test_random_forests_traced_end(seed):
    """Many forests through one compiled function (`end` traced, as inside the model)."""
    end = tree_end(seed, s=96, max_nodes=8, max_seg=8)
    q, k, v = qkv(seed % 7, end.shape[0], 96, 4, 2, 64)
    out_err, grad_errs = max_errors(end, q, k, v, impl="xla", block_q=16, block_kv=16, group=2)
    assert out_err <= F32_TOL and max(grad_errs) <= F32_TOL, (out_err, grad_errs)


def test_host_end():
    end = tree_end(seed=3, s=64, rows=2)
    q, k, v = qkv(1, end.shape[0], 64, 2, 1, 64)
    out_err, grad_errs = max_errors(end, q, k, v, impl="xla", jit_end=False, block_q=16,
                                    block_kv=16)
    assert out_err <= F32_TOL and max(grad_errs) <= F32_TOL, (out_err, grad_errs)


def test_bfloat16_deviation_is_small():
    """bf16 inputs, f32 accumulation: report-level closeness to the f32 reference, not equality."""
    end = tree_end(seed=5, s=128)
    q, k, v = qkv(2, end.shape[0], 128, 4, 2, 64, dtype=jnp.bfloat16)
    out_err, grad_errs = max_errors(end, q, k, v, impl="xla", block_q=32, block_kv=32)
    assert out_err <= 3e-2 and max(grad_errs) <= 6e-2, (out_err, grad_errs)


def test_work_equals_nonempty_blocks():
    """With group=1 the schedule computes exactly the non-empty block pairs; larger groups add
    only what their longest list costs the others."""
    end = tree_end(seed=11, s=512, rows=2, max_trees=30, max_seg=30)
    nonempty = int((classify_blocks(end, 32, 32) != 0).sum())
    assert schedule_work(end, block_q=32, block_kv=32, group=1) == (nonempty, nonempty)
    computed, listed = schedule_work(end, block_q=32, block_kv=32, group=4)
    assert listed == nonempty and nonempty <= computed < 1.5 * nonempty


def test_rejects_lengths_the_blocks_do_not_divide():
    q, k, v = qkv(0, 1, 100, 2, 1, 8)
    end = np.arange(1, 101, dtype=np.int32)[None]
    with pytest.raises(ValueError, match="S=100 must be a multiple of block_q=64"):
        tree_attention_xla(q, k, v, end, scale=1.0, block_q=64, block_kv=64)
