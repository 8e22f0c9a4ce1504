"""Linear layers whose weight gradient runs in a C++ kernel on the CPU backend.

`linear_dot_general` is the product `nnx.Linear` calls (`dot_general=`): y = x W over x's last
axis. Its value and input gradient are XLA's; its weight gradient dW = x^T dy (the token axes
contracted) runs in `kernels/cpu/weight_grad.cc` when the program is lowered for CPU, and
is XLA's dot elsewhere (`jax.lax.platform_dependent`, so a program lowered for TPU or GPU from a
CPU host never holds the CPU custom call).

Why: XLA:CPU's matrix product wants the contracted axis of its left operand minor, so before every
weight gradient it writes the layer's input (or the fusion producing it) again transposed; the
kernel reads x in place. Float32 operands only (other dtypes, other contractions, and a machine
without a C++ compiler take XLA's dot). The kernel sums every dW element over the tokens in a
fixed order, so the result is bitwise the same on every call with the same thread count.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jtree.kernels.cpu import library as cpu_library
from jtree.kernels.varying_axes import varying_like

_TARGET = "jtree_weight_grad"
# The kernel pays from about this many multiply-adds (tokens x in x out) up: below it the
# transposed copy it saves is small and the custom call's fixed cost (its threads) is not, and
# XLA's dot runs (tiny models and tests keep XLA's program as it was).
MIN_MACS = 1 << 26


@functools.cache
def _registered() -> bool:
    """Register the kernel with XLA once per process; False when the library cannot be built."""
    if cpu_library.build_error() is not None:
        return False
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(cpu_library.library().JtreeWeightGrad),
                                platform="cpu")
    return True


def _xla_weight_grad(x: jax.Array, dy: jax.Array) -> jax.Array:
    return jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ())))


def _cpu_weight_grad(x: jax.Array, dy: jax.Array, threads: int) -> jax.Array:
    out = jax.ShapeDtypeStruct((x.shape[1], dy.shape[1]), jnp.float32)
    dw = jax.ffi.ffi_call(_TARGET, out, vmap_method="sequential")(x, dy, threads=threads)
    return varying_like(dw, x, dy)  # inside shard_map: per-device like the operands


def weight_grad(x: jax.Array, dy: jax.Array, threads: int | None = None) -> jax.Array:
    """dW [M, N] = x^T dy for x [T, M], dy [T, N] (float32): the C++ kernel (on `threads`
    threads, default the CPUs this process may use) where the program runs on CPU and the
    library builds, XLA's dot otherwise."""
    if not _registered():
        return _xla_weight_grad(x, dy)
    cpu = functools.partial(_cpu_weight_grad, threads=threads or cpu_library.default_threads())
    return jax.lax.platform_dependent(x, dy, cpu=cpu, default=_xla_weight_grad)


@jax.custom_vjp
def _linear(x: jax.Array, w: jax.Array) -> jax.Array:
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())))


def _linear_fwd(x, w):
    return _linear(x, w), (x, w)


def _linear_bwd(res, dy):
    x, w = res
    dx = jax.lax.dot_general(dy, w, (((dy.ndim - 1,), (1,)), ((), ())))
    dw = weight_grad(x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1]))
    return dx, dw


_linear.defvjp(_linear_fwd, _linear_bwd)


def linear_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
                       precision: Any = None, preferred_element_type: Any = None,
                       out_sharding: Any = None, *, min_macs: int = MIN_MACS) -> jax.Array:
    """`jax.lax.dot_general` for `nnx.Linear`: x [..., in] times a kernel [in, out] in float32,
    of at least `min_macs` multiply-adds, takes `_linear` (the C++ weight gradient on CPU);
    anything else is XLA's `dot_general`."""
    linear = (((lhs.ndim - 1,), (0,)), ((), ()))
    if (dimension_numbers != linear or rhs.ndim != 2 or lhs.size * rhs.shape[1] < min_macs
            or precision is not None
            or out_sharding is not None or lhs.dtype != jnp.float32
            or rhs.dtype != jnp.float32
            or preferred_element_type not in (None, jnp.float32)):
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type,
                                   out_sharding=out_sharding)
    # Both operands vary over the same mesh axes inside the custom VJP (as XLA's dot would cast
    # them); the casts outside it give the gradients their sums over the axes an operand did not
    # vary over.
    return _linear(varying_like(lhs, rhs), varying_like(rhs, lhs))
