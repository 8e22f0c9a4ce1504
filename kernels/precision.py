"""The dtype that norms, softmaxes, recurrences and matmul accumulations run in.

float32 for float32 and narrower operands (bfloat16, float16: accumulating in float32, as Hugging
Face does), float64 for float64 operands. A float64 run (`RuntimeConfig.dtype = "float64"`, with
`jax_enable_x64`) is the exact reference the tests' float32 error models measure against; with
this dtype it stays float64 end to end instead of dropping to float32 at every norm and matmul,
while a float32 or bfloat16 run traces the same program as with a fixed float32.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp


def accumulation_dtype(*dtypes: jnp.dtype) -> jnp.dtype:
    """float32, or float64 when one of `dtypes` is float64 (the promotion of them and float32)."""
    return functools.reduce(jnp.promote_types, dtypes, jnp.dtype(jnp.float32))
