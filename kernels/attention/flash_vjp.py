"""The custom VJP that flash-style attention kernels share, and attention sinks on top of it.

A kernel that computes attention blockwise returns its output and the row-wise log-sum-exp of the
scores; its backward pass recomputes the probabilities from those two and needs nothing else.
`flash_vjp` turns such a (forward, backward) pair into a differentiable attention function:
it saves the inputs, the output and the log-sum-exp, and gives the integer inputs (the tree mask's
`end`, query positions, block tables) no cotangent. `jax.grad` does not go through a
`pallas_call` or an FFI call, so every such kernel needs one.

Attention sinks (one learned logit s_h per query head, an extra term exp(s_h) in every softmax
denominator that carries no value) need no change inside a kernel. From the kernel's sink-free
output O' and log-sum-exp L', the sink's softmax is

    L = logaddexp(L', s_h),    O = O' exp(L' - L),

and the backward kernels, given L and O, recompute the sink-including probabilities
P_ij = exp(S_ij - L_i) and delta_i = dO_i . O_i = sum_j P_ij dP_ij (the sink has no value, so its
dP is 0): their dq, dk, dv are already the sink model's. The sink's own gradient is

    d s_h = sum_i p_sink_i (0 - delta_i) = -sum over queries i of head h of exp(s_h - L_i) delta_i,

an O(S) sum over the residuals (padding queries have dO = 0 and add nothing). Inside `shard_map`
it is summed over the mesh axes the data varies over and the sinks do not.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jtree.kernels.flat_tokens import last_axis_dot
from jtree.kernels.varying_axes import summed_like


def flash_vjp(forward: Callable[..., tuple[jax.Array, jax.Array]],
              backward: Callable[..., tuple[jax.Array, jax.Array, jax.Array]],
              n_inputs: int, *, lse_rows: Callable[..., jax.Array] | None = None,
              rows_lse: Callable[..., jax.Array] | None = None) -> Callable[..., jax.Array]:
    """`attention(q, k, v, *tables, static, sinks=None)` differentiable in q, k, v (and sinks).

    `forward(q, k, v, *tables, static) -> (out, lse)`; `backward(static, q, k, v, *tables, out,
    lse, d_out) -> (dq, dk, dv)`. `n_inputs` counts q, k, v and the tables; `static` (hashable:
    block sizes, scale, soft-cap) follows them and is not differentiated. Sinks [Hq] need the
    kernel's lse layout: `lse_rows(lse, static, q) -> [rows, Sq, Hq]` float32 natural-log
    log-sum-exp and `rows_lse(x, static, q, lse)`, its inverse (x back to lse's layout)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(n_inputs,))
    def attention(*args: Any) -> jax.Array:
        return forward(*args)[0]

    def attention_fwd(*args: Any) -> tuple[jax.Array, tuple]:
        out, lse = forward(*args)
        return out, (*args[:n_inputs], out, lse)

    def attention_bwd(static: Any, residuals: tuple, d_out: jax.Array) -> tuple:
        *inputs, out, lse = residuals
        dq, dk, dv = backward(static, *inputs, out, lse, d_out)
        return (dq, dk, dv, *(None,) * (n_inputs - 3))

    attention.defvjp(attention_fwd, attention_bwd)

    def sink_forward(*args: Any) -> tuple:
        *inputs, sinks, static = args
        q = inputs[0]
        out, lse = forward(*inputs, static)
        free = lse_rows(lse, static, q)  # [rows, Sq, Hq]
        total = jnp.logaddexp(free, jnp.asarray(sinks, jnp.float32))
        out = (out.astype(jnp.float32) * jnp.exp(free - total)[..., None]).astype(out.dtype)
        return out, rows_lse(total, static, q, lse), total

    @functools.partial(jax.custom_vjp, nondiff_argnums=(n_inputs + 1,))
    def with_sinks(*args: Any) -> jax.Array:
        return sink_forward(*args)[0]

    def with_sinks_fwd(*args: Any) -> tuple[jax.Array, tuple]:
        out, lse, total = sink_forward(*args)
        return out, (*args[:n_inputs + 1], out, lse, total)

    def with_sinks_bwd(static: Any, residuals: tuple, d_out: jax.Array) -> tuple:
        *inputs, sinks, out, lse, total = residuals
        dq, dk, dv = backward(static, *inputs, out, lse, d_out)
        delta = last_axis_dot(d_out.astype(jnp.float32), out.astype(jnp.float32))
        p_sink = jnp.exp(jnp.asarray(sinks, jnp.float32) - total)
        d_sinks = -(p_sink * delta).sum(axis=(0, 1)).astype(sinks.dtype)
        # Inside shard_map the sinks (a replicated parameter) are invariant over the data axes.
        d_sinks = summed_like(d_sinks, sinks)
        return (dq, dk, dv, *(None,) * (n_inputs - 3), d_sinks)

    with_sinks.defvjp(with_sinks_fwd, with_sinks_bwd)

    def call(*args: Any, sinks: jax.Array | None = None) -> jax.Array:
        if sinks is None:
            return attention(*args)
        if lse_rows is None:
            raise ValueError("attention sinks: this kernel does not expose its log-sum-exp layout")
        return with_sinks(*args[:n_inputs], sinks, args[n_inputs])

    return call
