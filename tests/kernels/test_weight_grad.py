"""The C++ weight gradient of linear layers (`jtree.kernels.weight_grad`) against a float64 numpy
x^T dy, on shapes that are and are not multiples of the kernel's vector width and 64-blocks, with
more threads than cores; repeated calls bitwise equal; `linear_dot_general`'s gradients equal
XLA's autodiff of x @ w, on one device and inside `shard_map` on a data x model mesh (inputs
split over data, the kernel replicated or split over model); the custom call is in a program
lowered for CPU and absent from one lowered for TPU; other dtypes and small products keep XLA's
dot."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtree.kernels.weight_grad import MIN_MACS, linear_dot_general, weight_grad
from tests.run_util import WORKTREE, xla_flags

TARGET = "jtree_weight_grad"
LINEAR = (((2,), (0,)), ((), ()))


@pytest.mark.parametrize("t, m, n, threads", [
    (1000, 96, 160, 3),   # several 64-blocks and token chunks, more threads than cores
    (300, 130, 70, 2),    # partial blocks, 70 = 4 full vectors + 6 scalar columns
    (37, 5, 3, 1),        # smaller than one vector
    (1, 17, 33, None),    # one token
])
def test_equals_float64_product(t, m, n, threads):
    rng = np.random.default_rng(t + m + n)
    x = rng.standard_normal((t, m)).astype(np.float32)
    dy = rng.standard_normal((t, n)).astype(np.float32)
    run = jax.jit(lambda a, b: weight_grad(a, b, threads))
    got = np.asarray(run(x, dy))
    want = x.astype(np.float64).T @ dy.astype(np.float64)
    # a sum of t products: float32 rounding grows like sqrt(t) times the terms' size
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.sqrt(t) * 4)
    assert np.array_equal(np.asarray(run(x, dy)), got)  # the same order on every call


def _loss(dot):
    return lambda x, w: jnp.sum(jnp.sin(dot(x, w)) * jnp.arange(w.shape[1]))


def test_linear_gradients_equal_xla_autodiff():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 150, 40)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((40, 72)), jnp.float32)
    ours = jax.jit(jax.grad(_loss(lambda a, b: linear_dot_general(a, b, LINEAR, min_macs=0)),
                            (0, 1)))
    plain = jax.jit(jax.grad(_loss(jnp.matmul), (0, 1)))
    for a, b in zip(ours(x, w), plain(x, w)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert TARGET in ours.lower(x, w).as_text()


def test_other_platforms_dtypes_and_small_products_keep_xla_dot():
    x = jnp.ones((4, 8, 16), jnp.float32)
    w = jnp.ones((16, 32), jnp.float32)
    grad = jax.grad(_loss(lambda a, b: linear_dot_general(a, b, LINEAR, min_macs=0)), (0, 1))
    exported = jax.export.export(jax.jit(grad), platforms=["tpu"])(x, w)
    assert TARGET not in exported.mlir_module()
    bf16 = jax.jit(grad).lower(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)).as_text()
    assert TARGET not in bf16
    small = jax.grad(_loss(lambda a, b: linear_dot_general(a, b, LINEAR)), (0, 1))
    assert x.size * w.shape[1] < MIN_MACS and TARGET not in jax.jit(small).lower(x, w).as_text()


MESH_CHECK = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P
    from jtree.kernels.weight_grad import linear_dot_general

    mesh = jax.make_mesh((2, 2), ("data", "model"))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 64, 24)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((24, 32)), jnp.float32)
    linear = (((2,), (0,)), ((), ()))

    def loss(dot, w_spec):
        axes = ("data",) if w_spec == P() else ("data", "model")

        def local(x, w):  # this device's tokens; the kernel whole or this device's columns
            y = dot(x, w)
            return jax.lax.psum(jnp.sum(jnp.sin(y) * jnp.cos(y[..., :1])), axes)
        return jax.shard_map(local, mesh=mesh, in_specs=(P("data"), w_spec), out_specs=P())

    from jax.sharding import NamedSharding
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    for w_spec in (P(), P(None, "model")):
        w = jax.device_put(w, NamedSharding(mesh, w_spec))
        ours = loss(lambda a, b: linear_dot_general(a, b, linear, min_macs=0), w_spec)
        plain = loss(lambda a, b: jax.lax.dot_general(a, b, linear), w_spec)
        got = jax.jit(jax.grad(ours, (0, 1)))(x, w)
        want = jax.jit(jax.grad(plain, (0, 1)))(x, w)
        assert "jtree_weight_grad" in jax.jit(jax.grad(ours, (0, 1))).lower(x, w).as_text()
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    print("mesh ok")
""")


def test_gradients_inside_shard_map_equal_xla_autodiff():
    """Its own process with 4 host devices: the inputs vary over data, the kernel is replicated
    (its gradient summed over data) or split over model (the input's gradient summed over model,
    as XLA's dot would cast and sum them)."""
    env = {"XLA_FLAGS": xla_flags(4), "PYTHONPATH": str(WORKTREE)}
    proc = subprocess.run([sys.executable, "-c", MESH_CHECK], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)
    assert proc.returncode == 0 and "mesh ok" in proc.stdout, proc.stderr[-3000:]
