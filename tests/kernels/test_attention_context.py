"""Attention at a query offset (context parallelism, `TreeMask.query_offset`): each window of L
queries over the whole row's keys equals the same rows of the square call, forward and
gradients, for every implementation that declares it runs under context parallelism; the others
raise naming the implementation and `mesh.context`.

The offset is a traced argument, as inside the sharded step (`lax.axis_index('context') * L`).
The row's trees are random multi-level forests, so windows cut nodes and a query's ancestors lie
in earlier windows.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jtree.kernels import TreeMask, tree_attention
from tests.attention_cases import assert_elementwise_close, qkv, tree_end

S = 128


def windowed(impl: str, q, k, v, end, windows: int, **options):
    """(out, dq, dk, dv): the L = S / windows queries of every window at their offset, each over
    all keys, stacked back into [rows, S]; dk and dv summed over the windows (what the gather's
    transpose returns to the keys' owners)."""
    size = q.shape[1] // windows

    @jax.jit
    def one(q_local, k, v, end, offset, cot):
        def f(q_local, k, v):
            return tree_attention(q_local, k, v, TreeMask(end, query_offset=offset), impl=impl,
                                  **options)
        out, vjp = jax.vjp(f, q_local, k, v)
        return (out, *vjp(cot))

    cot = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), q.dtype)
    outs, dqs, dk, dv = [], [], 0.0, 0.0
    for w in range(windows):
        at = slice(w * size, (w + 1) * size)
        out, dq, dkw, dvw = one(q[:, at], k, v, jnp.asarray(end), jnp.int32(w * size),
                                cot[:, at])
        outs.append(out), dqs.append(dq)
        dk, dv = dk + dkw, dv + dvw
    return [jnp.concatenate(outs, 1), jnp.concatenate(dqs, 1), dk, dv], cot


@pytest.mark.parametrize("impl,windows", [
    ("xla", 4), ("cpu", 2), ("reference", 8),
    pytest.param("pallas_tpu", 2, marks=pytest.mark.slow)])  # its interpreter: ~8 s
def test_windows_equal_the_square_call(impl, windows):
    tpu = impl == "pallas_tpu"  # 128-wide blocks (the lane width), head_dim 64
    s = 2 * S if tpu else S
    end = tree_end(3, s, rows=2, padding_rows=0)
    q, k, v = qkv(0, 2, s, 4, 2, 64 if tpu else 16)
    options = {"interpret": True} if tpu else {}
    ctx = pltpu.force_tpu_interpret_mode() if impl == "pallas_tpu" else contextlib.nullcontext()
    with ctx:
        got, cot = windowed(impl, q, k, v, end, windows, **options)
    out, vjp = jax.vjp(lambda q, k, v: tree_attention(q, k, v, TreeMask(jnp.asarray(end)),
                                                       impl="reference"), q, k, v)
    want = [out, *vjp(cot)]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5,
                                   err_msg=f"{impl} {name}")
        assert_elementwise_close(a, b, jnp.float32, f"{impl} {name}")


@pytest.mark.parametrize("impl", ["pallas_mosaic_gpu", "pallas_triton"])
def test_impls_without_context_parallel_support_raise_by_name(impl):
    q, k, v = qkv(0, 1, 16, 2, 2, 8)
    mask = TreeMask(jnp.arange(1, 17, dtype=jnp.int32)[None], query_offset=jnp.int32(8))
    with pytest.raises(ValueError, match=rf"{impl}.*mesh\.context"):
        tree_attention(q[:, :8], k, v, mask, impl=impl)


def test_prefix_and_offset_do_not_combine():
    with pytest.raises(ValueError, match="prefix and a query offset"):
        TreeMask(np.ones((1, 4), np.int32), np.ones((1, 2), np.int32), query_offset=2)
