"""Run the Mosaic GPU tree-attention kernels forward + backward in the Mosaic GPU interpreter (CPU).

    python -m jtree.launch.bench.mgpu_interpret    # random trees: errors vs the f32 reference, bf16 and f16;
                                       # writes bench_out/mgpu_interpret.json and .md (--out);
                                       # --quick: float16 with a prefix only
    python -m jtree.launch.bench.mgpu_interpret IN.npz OUT.npz   # one run on given inputs (used by the tests)

IN holds q, k, v, d_out (float32 holding values of `dtype`), end of the whole layout, and scalars
dtype, softcap (nan for none), block_kv (0: the kernel's default) and prefix P: the first P tokens
are cached prefix keys (`prefix_k`, `prefix_v`, `mask.prefix_end`) and only the others are queries
(0: no prefix, every token a query); optionally `window` (0: none) with `positions` (the path
position of every token of the layout) and `sinks` [Hq]. OUT holds, as float32, out and dq of the queries, dk and dv of
every key ([prefix | own]), `dsinks` with sinks, and `races` (race detection result). The kernels run through
`tree_attention(impl="pallas_mosaic_gpu")`, which pads the lengths as in training.

Run it as its own process, for three reasons:
- The interpreter runs each simulated warpgroup as its own XLA CPU computation, and they block on
  each other's barriers. XLA's CPU client runs computations on a thread pool sized to the cores;
  on a 2-core machine the outer computation plus 3 warpgroups can leave one warpgroup without a
  thread, and everything deadlocks. PJRT_NPROC (read when the CPU client is created, so before any
  jax computation in the process) enlarges the pool.
- A warpgroup that raises leaves the others blocked forever: a child process can be killed.
- The interpreter keeps global state; a fresh process starts clean.
The interpreter is a private jax API (`jax._src.pallas.mosaic_gpu.interpret`), used only here.
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Sequence

os.environ.setdefault("PJRT_NPROC", "16")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call  # noqa: E402
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # noqa: E402

from jtree.kernels import TreeMask, tree_attention  # noqa: E402
from jtree.launch.bench.harness import (  # noqa: E402
    DEFAULT_OUT,
    Column,
    Output,
    markdown_table,
    run_info,
)
from jtree.layout.linearize import linearize  # noqa: E402
from jtree.trees.tree import TrajectoryTree  # noqa: E402

OUTPUTS = ("out", "dq", "dk", "dv")
COLUMNS = (Column("dtype", "dtype"), Column("prefix", "prefix"),
           *(Column(n, n, "{:.2e}") for n in OUTPUTS),
           Column("races", "races"))


def value_and_grads(impl: str, q, k, v, end, d_out, *, prefix: int = 0,
                    softcap: float | None = None, window: int | None = None, positions=None,
                    sinks=None, **options) -> list[jax.Array]:
    """[out, dq, dk, dv] (float32) of `tree_attention(impl=impl)` on the layout q, k, v, end
    [rows, P + S, ...] with output cotangent `d_out`: with `prefix` P > 0, keys [:P] are cached
    prefix keys and only [P:] are queries (out, dq, d_out are theirs; dk, dv cover every key).
    `window` with `positions` [rows, P + S]: the sliding window; with `sinks` [Hq] their
    gradient is appended."""
    p = prefix

    def attend(q_own, k_own, v_own, prefix_k, prefix_v, sk):
        mask = (TreeMask(end[:, p:], end[:, :p], positions=positions, window=window) if p else
                TreeMask(end, positions=positions, window=window))
        kv = dict(prefix_k=prefix_k, prefix_v=prefix_v) if p else {}
        return tree_attention(q_own, k_own, v_own, mask, impl=impl, softcap=softcap, **kv,
                              sinks=sk, **options).astype(jnp.float32)

    out, pull = jax.vjp(attend, q[:, p:], k[:, p:], v[:, p:], k[:, :p], v[:, :p], sinks)
    dq, dk, dv, dpk, dpv, dsk = pull(d_out[:, p:])
    dq, dk, dv, dpk, dpv = (g.astype(jnp.float32) for g in (dq, dk, dv, dpk, dpv))
    grads = [out, dq, jnp.concatenate([dpk, dk], 1), jnp.concatenate([dpv, dv], 1)]
    return grads if sinks is None else grads + [dsk]


def run(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The kernels' [out, dq, dk, dv] in the interpreter (race detection on) and `races`."""
    dtype = jnp.dtype(str(inputs["dtype"]))
    q, k, v = (jnp.asarray(inputs[n], dtype) for n in "qkv")
    softcap = None if np.isnan(inputs["softcap"]) else float(inputs["softcap"])
    options = dict(interpret=InterpretGPUParams(detect_races=True))
    if int(inputs["block_kv"]):
        options["block_kv"] = int(inputs["block_kv"])
    window = int(inputs.get("window", 0)) or None
    positions = jnp.asarray(inputs["positions"], jnp.int32) if window else None
    sinks = jnp.asarray(inputs["sinks"], jnp.float32) if "sinks" in inputs else None
    run_kernels = jax.jit(functools.partial(value_and_grads, "pallas_mosaic_gpu",
                                            prefix=int(inputs["prefix"]), softcap=softcap,
                                            window=window, **options))
    results = run_kernels(q, k, v, jnp.asarray(inputs["end"], jnp.int32),
                          jnp.asarray(inputs["d_out"]), positions=positions, sinks=sinks)
    arrays = {n: np.asarray(x) for n, x in zip(OUTPUTS + ("dsinks",), results)}
    arrays["races"] = np.asarray(interpret_pallas_call.get_races().races_found)
    return arrays


def _check_random_trees(quick: bool = False) -> list[dict]:
    """Two branching trees with 60-token prompts in one 256-token row, GQA group 2, head_dim 64,
    at the kernel's default blocks; without a prefix, and with the first prompt as a prefix, in
    bfloat16 and float16 (`quick`: float16 with the prefix only, a quarter of the time)."""
    rng = np.random.default_rng(0)
    trees = []
    for lens in ((30, 40, 12, 0), (20, 30)):  # continuations of a shared prompt; 0: the prompt
        prompt = rng.integers(0, 50, 60).tolist()
        trees.append(TrajectoryTree.from_sequences(
            [prompt + rng.integers(0, 50, n).tolist() for n in lens]))
    end = linearize(trees, 256).inputs.mask.end
    rows = []
    for dtype in ("float16",) if quick else ("bfloat16", "float16"):
        for prefix in (60,) if quick else (0, 60):
            shape = lambda h: (*end.shape, h, 64)
            q, k, v = (np.asarray(jnp.asarray(rng.normal(size=shape(h)), dtype), np.float32)
                       for h in (2, 1, 1))
            d_out = rng.normal(size=shape(2)).astype(np.float32)
            got = run(dict(q=q, k=k, v=v, d_out=d_out, end=end, dtype=np.asarray(dtype),
                           softcap=np.asarray(np.nan), block_kv=np.asarray(0),
                           prefix=np.asarray(prefix)))
            want = value_and_grads("reference", q, k, v, jnp.asarray(end), d_out, prefix=prefix)
            row = {"dtype": dtype, "prefix": prefix, "races": bool(got["races"])}
            for name, w in zip(OUTPUTS, want):
                row[name] = float(np.abs(got[name] - np.asarray(w)).max() / np.abs(w).max())
            rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="?", help="IN.npz: run the kernels once on these inputs")
    parser.add_argument("outputs", nargs="?", help="OUT.npz: where that run's results go")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help=f"folder of mgpu_interpret.json and .md (default {DEFAULT_OUT})")
    parser.add_argument("--quick", action="store_true",
                        help="float16 with a cached prefix only (one of the four runs)")
    args = parser.parse_args(argv)
    if args.inputs is not None:
        if args.outputs is None:
            parser.error("give IN.npz and OUT.npz, or neither")
        with np.load(args.inputs) as data:
            np.savez(args.outputs, **run(dict(data)))
        return 0
    rows = _check_random_trees(args.quick)
    table = ("max abs error / max |reference|, Mosaic GPU interpreter vs f32 dense reference\n\n"
             + markdown_table(rows, COLUMNS))
    print(table)
    written = Output.from_args(args, "mgpu_interpret").write({**run_info(args), "rows": rows},
                                                             table=table)
    print(f"wrote {', '.join(map(str, written))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
