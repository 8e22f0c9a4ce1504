"""`auto` by measurement: which of the available attention implementations is faster for a class
of shapes, timed once on the device at hand.

On CPU two implementations run the same block-sparse schedule: the multi-threaded C++ `cpu`
kernel and the plain-XLA `xla` block loop. Which one is faster depends on the shape (the C++
kernel's register-tiled GEMMs pay off at head_dim 64 and above and with many work items; at head
dim 32 with several rows the XLA loop can win), so `auto` times both on a representative call of
the call's shape class and keeps the faster (`jtree.kernels.tree_attention.resolve_impl`).

- `ShapeClass`: backend, dtype, head_dim, q and kv heads, rows and S rounded up to powers of two;
  the measured call is that class's representative (`rows x S`, with rows cut so that it holds
  at most `MAX_TOKENS` tokens) on a synthetic tree mask (`synthetic_end`).
- `pick_fastest`: the smallest time wins; equal times go to the earlier candidate in the given
  order (deterministic).
- `measure`: fwd + bwd of each candidate, one warm-up call (compiles) then the median of
  `repeats` calls.

The cache is the caller's (`tree_attention` keeps one decision per shape class for the process:
the same shape class always runs the same kernel within a run).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

MAX_TOKENS = 4096  # rows x S of the measured call, at most (keeps a calibration to a second or two)
MIN_TOKENS = 4096  # calls with fewer tokens keep the static rule: a calibration would cost more
REPEATS = 3


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class ShapeClass:
    """The shapes one measurement decides for."""

    backend: str
    dtype: str
    head_dim: int
    q_heads: int
    kv_heads: int
    rows: int  # a power of two >= the call's rows
    seq: int  # a power of two >= the call's S (at least 64)

    @classmethod
    def of(cls, backend: str, dtype: Any, rows: int, seq: int, q_heads: int, kv_heads: int,
           head_dim: int) -> ShapeClass:
        return cls(backend, jnp.dtype(dtype).name, int(head_dim), int(q_heads), int(kv_heads),
                   _pow2(rows), max(64, _pow2(seq)))

    def representative(self) -> tuple[int, int]:
        """(rows, S) of the measured call: the class's rows x S, rows halved while it holds more
        than `MAX_TOKENS` tokens, then S halved (at least 64)."""
        rows, seq = self.rows, self.seq
        while rows > 1 and rows * seq > MAX_TOKENS:
            rows //= 2
        while seq > 64 and rows * seq > MAX_TOKENS:
            seq //= 2
        return rows, seq

    def describe(self) -> str:
        return (f"head_dim {self.head_dim}, {self.q_heads}/{self.kv_heads} q/kv heads, rows <= "
                f"{self.rows} x S <= {self.seq}, {self.dtype}, {self.backend}")


def pick_fastest(timings: Mapping[str, float], order: Sequence[str]) -> str:
    """The candidate of `order` with the smallest time in `timings` (seconds); equal times go to
    the one earlier in `order`. Candidates missing from `timings` are never picked."""
    timed = [name for name in order if name in timings]
    if not timed:
        raise ValueError(f"pick_fastest: no timings for any of {list(order)}")
    return min(timed, key=lambda name: (timings[name], order.index(name)))


def synthetic_end(rows: int, seq: int) -> np.ndarray:
    """[rows, seq] `end` of one tree per row: a shared prefix of an eighth of the row, then seven
    branches (chains) of an eighth each (POR 0.75 over its 7 paths, about a sixth of the causal
    square's pairs); query i sees key j iff j <= i < end[j]."""
    eighth = max(1, seq // 8)
    j = np.arange(seq)
    branch_end = np.minimum(seq, (j // eighth + 1) * eighth)
    end = np.where(j < eighth, seq, branch_end).astype(np.int32)
    end[-1] = seq
    return np.broadcast_to(end, (rows, seq)).copy()


def measure(shape: ShapeClass, candidates: Sequence[str],
            run: Callable[[str, jax.Array, jax.Array, jax.Array, np.ndarray], jax.Array],
            repeats: int = REPEATS) -> dict[str, float]:
    """Median seconds of fwd + bwd of `run(impl, q, k, v, end)` for every candidate at the
    class's representative shape (random operands, `synthetic_end`), outside any trace."""
    rows, seq = shape.representative()
    dtype = jnp.dtype(shape.dtype)
    with jax.ensure_compile_time_eval():
        keys = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(keys[0], (rows, seq, shape.q_heads, shape.head_dim), dtype)
        k = jax.random.normal(keys[1], (rows, seq, shape.kv_heads, shape.head_dim), dtype)
        v = jax.random.normal(keys[2], (rows, seq, shape.kv_heads, shape.head_dim), dtype)
        end = synthetic_end(rows, seq)
        times = {}
        for name in candidates:
            def loss(q, k, v, name=name):
                return jnp.sum(run(name, q, k, v, end).astype(jnp.float32) ** 2)

            grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            jax.block_until_ready(grad(q, k, v))  # compiles
            samples = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(grad(q, k, v))
                samples.append(time.perf_counter() - t0)
            times[name] = float(np.median(samples))
    return times
