"""The custom VJP that flash-style attention kernels share.

A kernel that computes attention blockwise returns its output and the row-wise log-sum-exp of the
scores; its backward pass recomputes the probabilities from those two and needs nothing else.
`flash_vjp` turns such a (forward, backward) pair into a differentiable attention function:
it saves the inputs, the output and the log-sum-exp, and gives the integer inputs (the tree mask's
`end`, query positions, block tables) no cotangent. `jax.grad` does not go through a
`pallas_call` or an FFI call, so every such kernel needs one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax


def flash_vjp(forward: Callable[..., tuple[jax.Array, jax.Array]],
              backward: Callable[..., tuple[jax.Array, jax.Array, jax.Array]],
              n_inputs: int) -> Callable[..., jax.Array]:
    """`attention(q, k, v, *tables, static)` differentiable in q, k and v.

    `forward(q, k, v, *tables, static) -> (out, lse)`; `backward(static, q, k, v, *tables, out,
    lse, d_out) -> (dq, dk, dv)`. `n_inputs` counts q, k, v and the tables; `static` (hashable:
    block sizes, scale, soft-cap) follows them and is not differentiated."""

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
    return attention
