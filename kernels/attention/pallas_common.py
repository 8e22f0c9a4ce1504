"""What the Pallas attention kernels (TPU and Triton) share: the static config of one call and the
constants of their blockwise softmax."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

# The score of a masked pair: finite (so that exp(m_old - m_new) never sees inf - inf) and far
# below any real score, with room left for the running maximum's arithmetic.
MASKED = -0.7 * float(np.finfo(np.float32).max)
# `lax.dot_general` dimension numbers of 2-D blocks.
NT = (((1,), (1,)), ((), ()))  # contract the last dims: a @ b.T
NN = (((1,), (0,)), ((), ()))  # a @ b


class BlockConfig(NamedTuple):
    """Everything static about one call (hashable: it is a custom_vjp nondiff argument).
    `interpret`: False, True, or the backend's interpreter parameters; `num_warps` and
    `num_stages` are Triton's launch parameters (None on TPU)."""

    scale: float
    softcap: float | None
    block_q: int
    block_kv: int
    interpret: Any
    num_warps: int | None = None
    num_stages: int | None = None
    window: int | None = None  # sliding window along the path (None: none)
