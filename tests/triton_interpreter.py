"""Runs the `triton_lang` kernels in Triton's CPU interpreter, in a process of its own:

    TRITON_INTERPRET=1 python tests/triton_interpreter.py IN.pkl OUT.pkl

Triton decides at `triton.jit` time whether a function is compiled or interpreted, for its own
library functions (tl.zeros, tl.sigmoid, ...) as much as for the kernels, so the interpreter needs
the variable set before triton is first imported: a pytest process that has imported triton
already cannot switch. This process imports no jax: the kernels module is loaded from its file.

IN.pkl holds a list of calls, each a dict: the kernels module's file, the operands' dtype name,
numpy arrays q, k, v, do (float32, cast to the dtype here), end, q_pos, q_path, k_path and the
block lists, and per kernel (forward, dq, dkv) its grid and constants (`triton_lang.launch_specs`).
OUT.pkl gets, per call, out, dq, dk, dv in float32: the forward, delta = rowsum(dO * O) in float32
(as `triton_lang` computes it) and the two backward kernels.
"""

from __future__ import annotations

import importlib.util
import pickle
import sys

import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter


def _dot_upcasting_bf16(create_dot):
    """The interpreter's `tl.dot` with bfloat16 operands first widened to float32 (exactly; the
    GPU's tensor cores multiply bf16 exactly and accumulate in float32): the interpreter keeps
    bfloat16 as its uint16 bits and would multiply those."""
    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = (interpreter.TensorHandle(self.cast_impl(x, tl.float32).data, tl.float32)
                if x.dtype.scalar == tl.bfloat16 else x for x in (a, b))
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
    return dot


def _load(path: str):
    spec = importlib.util.spec_from_file_location("triton_lang_kernels_interpreted", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(call: dict) -> dict[str, np.ndarray]:
    kernels = _load(call["kernels_file"])
    dtype = getattr(torch, call["dtype"])
    t = {name: torch.from_numpy(np.ascontiguousarray(x)) for name, x in call["arrays"].items()}
    for name in ("q", "k", "v", "do"):
        t[name] = t[name].to(dtype)
    (fwd_grid, fwd), (dq_grid, dq_constants), (dkv_grid, dkv) = (
        call["specs"][n] for n in ("forward", "dq", "dkv"))
    rows, sq, hq, _ = t["q"].shape
    shared = [t[n] for n in ("q_pos", "q", "k", "v", "end", "q_path", "k_path")]
    out = torch.empty((rows, sq, hq, t["v"].shape[3]), dtype=dtype)
    lse = torch.empty((rows, hq, sq), dtype=torch.float32)
    kernels.forward_kernel[fwd_grid](t["kv_blocks"], t["kv_count"], *shared, out, lse, **fwd)
    delta = torch.einsum("rshd,rshd->rhs", t["do"].float(), out.float()).contiguous()
    dq, dk, dv = (torch.empty_like(t[n]) for n in ("q", "k", "v"))
    kernels.dq_kernel[dq_grid](t["kv_blocks"], t["kv_count"], *shared, t["do"], lse, delta, dq,
                               **dq_constants)
    kernels.dkv_kernel[dkv_grid](t["q_blocks"], t["q_count"], *shared, t["do"], lse, delta, dk,
                                 dv, **dkv)
    return {name: x.float().numpy() for name, x in dict(out=out, dq=dq, dk=dk, dv=dv).items()}


if __name__ == "__main__":
    interpreter.InterpreterBuilder.create_dot = _dot_upcasting_bf16(
        interpreter.InterpreterBuilder.create_dot)
    with open(sys.argv[1], "rb") as f:
        calls = pickle.load(f)
    results = [run(call) for call in calls]
    with open(sys.argv[2], "wb") as f:
        pickle.dump(results, f)
