"""The multi-threaded C++ `cpu` kernel equals the dense reference: forward and q/k/v gradients on
random branching forests (several trees per row, padding rows), GQA 1/2/4, head_dim 64 and 128,
S not a multiple of the block, differing and non-vector block sizes, rectangular (prefix) calls,
1 and 3 threads; float32 tolerance 2e-5. Repeated calls give bitwise the same output and gradients
(the backward sums dk/dv over threads in a fixed order)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtree.kernels import TreeMask, tree_attention
from tests.attention_cases import assert_elementwise_close, max_errors, qkv, tree_end

F32_TOL = 2e-5


@pytest.mark.parametrize("hq, hkv, d, s, blocks, threads", [
    (4, 4, 64, 200, (32, 32), 3),     # GQA 1, S padded 200 -> 224
    (4, 2, 64, 256, (32, 64), 2),     # GQA 2, q and kv blocks differ
    (8, 2, 128, 176, (64, 16), 1),    # GQA 4, head_dim 128, one thread
    (4, 1, 128, 256, (None, None), None),  # default blocks (64) and threads
    (2, 1, 24, 96, (24, 24), 2),      # widths that are not a multiple of 16 (scalar path)
])
def test_matches_reference(hq, hkv, d, s, blocks, threads):
    end = tree_end(seed=s + d, s=s, max_seg=20)
    q, k, v = qkv(0, end.shape[0], s, hq, hkv, d)
    options = {"block_q": blocks[0], "block_kv": blocks[1]}
    if threads is not None:
        options["threads"] = threads
    out_err, grad_errs = max_errors(end, q, k, v, impl="cpu", **options)
    assert out_err <= F32_TOL and max(grad_errs) <= F32_TOL, (out_err, grad_errs)


def test_repeated_calls_are_bitwise_identical():
    """More threads than cores, so that the threads' timing varies from call to call: it must not
    reach the gradients (dk/dv were once summed in the order the threads happened to take their
    items, and differed in the last bits between identical training runs)."""
    end = jnp.asarray(tree_end(seed=5, s=256, max_seg=40))
    q, k, v = qkv(0, end.shape[0], 256, 4, 2, 32)
    cot = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)

    @jax.jit
    def run(q, k, v, end, cot):
        out, vjp = jax.vjp(lambda q, k, v: tree_attention(q, k, v, TreeMask(end), impl="cpu",
                                                          block_q=16, block_kv=16, threads=8),
                           q, k, v)
        return (out, *vjp(cot))

    first = [np.asarray(x) for x in run(q, k, v, end, cot)]
    for _ in range(10):
        for name, a, b in zip(("out", "dq", "dk", "dv"), first, run(q, k, v, end, cot)):
            assert np.array_equal(a, np.asarray(b)), name


def test_host_end_and_bfloat16_inputs():
    end = tree_end(seed=3, s=128, rows=2)
    q, k, v = qkv(1, end.shape[0], 128, 2, 1, 64)
    out_err, grad_errs = max_errors(end, q, k, v, impl="cpu", jit_end=False, block_q=32,
                                    block_kv=32)
    assert out_err <= F32_TOL and max(grad_errs) <= F32_TOL, (out_err, grad_errs)
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    out = tree_attention(qb, kb, vb, TreeMask(jnp.asarray(end)), impl="cpu")
    want = tree_attention(qb, kb, vb, TreeMask(jnp.asarray(end)), impl="xla")
    assert out.dtype == jnp.bfloat16
    assert float(jnp.max(jnp.abs(out.astype(jnp.float32) - want.astype(jnp.float32)))) <= 3e-2
    assert_elementwise_close(out, want, jnp.bfloat16, "cpu bf16 out")


def test_prefix_matches_xla():
    """A part's own queries over [cached prefix keys | own keys] (the redundancy-free layout)."""
    rng = np.random.default_rng(4)
    end = tree_end(seed=9, s=192, rows=2, max_seg=16)
    p = 64  # the first 64 positions act as the prefix of the rest
    q, k, v = qkv(2, 2, 192, 4, 2, 64)
    args = dict(prefix_k=k[:, :p], prefix_v=v[:, :p])
    mask = TreeMask(jnp.asarray(end[:, p:]), jnp.asarray(end[:, :p]))
    cot = jnp.asarray(rng.normal(size=q[:, p:].shape), jnp.float32)

    def run(impl):
        def f(q, k, v):
            return tree_attention(q, k, v, mask, impl=impl, **args)
        out, vjp = jax.vjp(f, q[:, p:], k[:, p:], v[:, p:])
        return (out, *vjp(cot))

    for name, got, want in zip(("out", "dq", "dk", "dv"), run("cpu"), run("xla")):
        assert float(jnp.max(jnp.abs(got - want))) <= F32_TOL
        assert_elementwise_close(got, want, jnp.float32, f"cpu prefix {name}")


def test_rejects_softcap():
    q, k, v = qkv(0, 1, 64, 2, 1, 16)
    end = np.arange(1, 65, dtype=np.int32)[None]
    with pytest.raises(ValueError, match="softcap"):
        tree_attention(q, k, v, TreeMask(end), impl="cpu", softcap=30.0)
