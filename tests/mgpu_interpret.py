"""Run the Mosaic GPU tree-attention kernels forward + backward in the Mosaic GPU interpreter.

Used by tests/test_attention_mgpu.py in a child process, for three reasons:
- The interpreter runs each simulated warpgroup as its own XLA CPU computation, and they block on
  each other's barriers. XLA's CPU client runs computations on a thread pool sized to the cores
  (2 here); with the outer computation and 3 warpgroups, a warpgroup may never get a thread and
  everything deadlocks. PJRT_NPROC (read when the CPU client is created) enlarges the pool.
- A warpgroup that raises leaves the others blocked forever: a child process can be killed.
- The interpreter keeps global state; a fresh process starts clean.

Usage: python -m tests.mgpu_interpret IN.npz OUT.npz. IN holds q, k, v, d_out (float32 holding
bf16 values), end, and scalars softcap (nan for none) and block_kv. OUT holds out, dq, dk, dv as
float32 and `races` (whether race detection found any).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("PJRT_NPROC", "16")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call  # noqa: E402
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # noqa: E402

from kernels.attention_mgpu import attention_mgpu  # noqa: E402


def run(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    q, k, v = (jnp.asarray(inputs[n], jnp.bfloat16) for n in "qkv")
    end = jnp.asarray(inputs["end"], jnp.int32)
    d_out = jnp.asarray(inputs["d_out"], jnp.float32)
    softcap = None if np.isnan(inputs["softcap"]) else float(inputs["softcap"])
    interpret = InterpretGPUParams(detect_races=True)

    def value_and_grads(q, k, v):
        out, pull = jax.vjp(
            lambda q, k, v: attention_mgpu(
                q, k, v, end, scale=q.shape[-1] ** -0.5, softcap=softcap,
                block_kv=int(inputs["block_kv"]), interpret=interpret).astype(jnp.float32),
            q, k, v)
        return (out, *pull(d_out))

    results = jax.jit(value_and_grads)(q, k, v)
    arrays = {n: np.asarray(x, np.float32) for n, x in zip(("out", "dq", "dk", "dv"), results)}
    arrays["races"] = np.asarray(interpret_pallas_call.get_races().races_found)
    return arrays


if __name__ == "__main__":
    source, target = sys.argv[1:]
    with np.load(source) as data:
        np.savez(target, **run(dict(data)))
