"""GPU benchmark of tree attention against dense causal attention on the same shapes (not a test).

For agent-rollout trees of POR 0.3 / 0.6 / 0.9 packed into one row of S tokens (as
`bench_attention` packs them), with q, k, v of the same [1, S, heads, head_dim] shape:
- block efficiency, computed on the host from `end` (runs anywhere): the useful (visible) query-key
  pairs over the pairs inside the blocks a block-sparse kernel computes (its non-empty blocks, at
  `--blocks`), for the tree mask and for the causal mask of the same S;
- on a GPU only: forward and forward+backward time of the tree kernel (`--impl`, default `auto`:
  the Mosaic kernel on Hopper, the Triton kernel elsewhere, see docs/kernels.md) and of every dense
  causal kernel of the installed jax that runs these shapes: cuDNN flash attention
  (`jax.nn.dot_product_attention(implementation="cudnn", is_causal=True)`), jax's Pallas Triton
  flash attention (`pallas.ops.gpu.attention.mha`, causal) and jax's Pallas Hopper FA3 kernel
  (`pallas.ops.gpu.attention_mgpu`, causal forward only: it has no causal backward). Timed in
  alternating rounds (`jtree.launch.bench.harness.alternate`), medians. Each is reported as achieved
  TFLOP/s over its visible pairs: 4 x head_dim x q_heads flops per pair forward, 3.5 times that
  forward+backward (FlashAttention's count: the backward does 2.5 times the forward's matmuls);
  `best causal` is the fastest causal kernel that ran.
Without a GPU, only the block-efficiency part runs, and the output says that timings need a GPU.

Writes bench_out/bench_attention_gpu.json and .md (`--out` picks the folder).

    python -m jtree.launch.bench.attention_gpu            # S 4k..32k, bf16, 32 q / 8 kv heads, D 128
    python -m jtree.launch.bench.attention_gpu --quick    # S <= 8192, 3 repeats
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jtree.kernels import TreeMask, tree_attention
from jtree.kernels.block_tables import EMPTY, classify_blocks
from jtree.launch.bench.attention import Heads, causal_end, packed_row
from jtree.launch.bench.harness import (
    Column,
    Output,
    alternate,
    bench_parser,
    markdown_table,
    run_info,
)

BACKWARD_FLOP_RATIO = 2.5  # backward matmul flops per forward flop (FlashAttention's count)


# ----------------------------------------------------------------------------- pair counts


def visible_pairs(end: np.ndarray, tokens: int) -> int:
    """Query-key pairs the mask lets the first `tokens` tokens (the real ones) of each row see:
    key j is seen by the queries j .. end[j] - 1."""
    return int((end[:, :tokens] - np.arange(tokens)).sum())


def computed_pairs(end: np.ndarray, block_q: int, block_kv: int) -> int:
    """Pairs inside the non-empty (q-block, kv-block) blocks: what a block-sparse kernel computes
    (S padded to the blocks with tokens that see only themselves)."""
    s = end.shape[1]
    padded = -(-s // np.lcm(block_q, block_kv)) * int(np.lcm(block_q, block_kv))
    tail = np.broadcast_to(np.arange(s + 1, padded + 1, dtype=end.dtype), (end.shape[0], padded - s))
    classes = classify_blocks(np.concatenate([end, tail], axis=1), block_q, block_kv)
    return int((classes != EMPTY).sum()) * block_q * block_kv


def attention_flops(pairs: int, heads: Heads, backward: bool) -> float:
    forward = 4.0 * pairs * heads.dim * heads.q
    return forward * (1.0 + BACKWARD_FLOP_RATIO) if backward else forward


# ----------------------------------------------------------------------------- kernels


def _fwd_and_step(attend: Callable[..., jax.Array]) -> tuple[Callable, Callable]:
    """Jitted forward and forward+backward (vjp with a given output cotangent) of `attend(q, k, v)`."""

    def step(q, k, v, cot):
        _, pull = jax.vjp(attend, q, k, v)
        return pull(cot)

    return jax.jit(attend), jax.jit(step)


def tree_kernel(impl: str, end: np.ndarray) -> dict[str, tuple[Callable, Callable]]:
    attend = lambda q, k, v: tree_attention(q, k, v, TreeMask(end), impl=impl)
    return {"tree": _fwd_and_step(attend)}


def causal_kernels(heads: Heads) -> dict[str, tuple[Callable, Callable | None]]:
    """The dense causal kernels of the installed jax, name -> (forward, forward+backward or None
    where the kernel has no causal backward)."""
    from jax.experimental.pallas.ops.gpu import attention as triton_flash
    from jax.experimental.pallas.ops.gpu import attention_mgpu as fa3

    scale = heads.dim ** -0.5
    group = heads.q // heads.kv
    expand = lambda x: jnp.repeat(x, group, axis=2)  # jax's Pallas Triton kernel has no GQA

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                            implementation="cudnn")

    def triton(q, k, v):
        return triton_flash.mha(q, expand(k), expand(v), None, sm_scale=scale, causal=True)

    def hopper_fa3(q, k, v):  # GQA; no softmax scale of its own, so q is scaled first
        config = fa3.TuningConfig(block_q=128, block_kv=128, max_concurrent_steps=2, causal=True)
        return fa3.attention(q * jnp.asarray(scale, q.dtype), k, v, config)

    kernels = {"cudnn": _fwd_and_step(cudnn), "pallas_triton_flash": _fwd_and_step(triton)}
    kernels["pallas_hopper_fa3"] = (jax.jit(hopper_fa3), None)
    return kernels


def _inputs(s: int, heads: Heads, dtype: Any, seed: int = 0) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(seed)
    shape = lambda h: (1, s, h, heads.dim)
    return tuple(jnp.asarray(rng.normal(size=shape(h)), dtype)
                 for h in (heads.q, heads.kv, heads.kv, heads.q))


def time_kernels(kernels: dict[str, tuple[Callable, Callable | None]], inputs: tuple,
                 repeats: int) -> tuple[dict[str, float], dict[str, str]]:
    """Median seconds of every kernel's forward (`NAME_fwd`) and forward+backward (`NAME_step`),
    timed side by side; kernels that fail to compile or run are left out, with the reason."""
    q, k, v, cot = inputs
    runs, failed = {}, {}
    for name, (fwd, step) in kernels.items():
        for kind, fn, args in (("fwd", fwd, (q, k, v)), ("step", step, (q, k, v, cot))):
            if fn is None:
                continue
            try:
                compiled = fn.lower(*args).compile()
                jax.block_until_ready(compiled(*args))
            except Exception as error:  # a kernel this GPU, jax or shape does not support
                failed[f"{name}_{kind}"] = f"{type(error).__name__}: {str(error)[:200]}"
                continue
            runs[f"{name}_{kind}"] = functools.partial(compiled, *args)
    timings = alternate(runs, repeats) if runs else None
    return ({name: timings.median(name) for name in runs} if timings else {}), failed


# ----------------------------------------------------------------------------- one case


def bench_case(por: float, s: int, heads: Heads, args: Any, on_gpu: bool) -> dict[str, Any]:
    end, trees = packed_row(por, s, seed=int(por * 100) + s)
    tokens = sum(t.n_tree_tokens for t in trees)
    causal = causal_end(s, s)
    pairs = {"tree": visible_pairs(end, tokens), "causal": visible_pairs(causal, s)}
    row: dict[str, Any] = {
        "por_target": por, "S": s, "trees": len(trees), "tokens": tokens,
        "tree_pairs": pairs["tree"], "causal_pairs": pairs["causal"],
        "tree_block_efficiency": pairs["tree"] / computed_pairs(end, *args.blocks),
        "causal_block_efficiency": pairs["causal"] / computed_pairs(causal, *args.blocks),
    }
    if not on_gpu:
        return row
    dtype = jnp.dtype(args.dtype)
    kernels = {**tree_kernel(args.impl, end), **causal_kernels(heads)}
    seconds, failed = time_kernels(kernels, _inputs(s, heads, dtype), args.repeats)
    row["failed"] = failed
    for run, t in seconds.items():
        name, kind = run.rsplit("_", 1)
        flops = attention_flops(pairs["tree" if name == "tree" else "causal"], heads,
                                backward=kind == "step")
        row[f"{run}_ms"], row[f"{run}_tflops"] = 1e3 * t, flops / t / 1e12
    for kind in ("fwd", "step"):
        causal_runs = [r for r in seconds if r != f"tree_{kind}" and r.endswith(f"_{kind}")]
        if causal_runs:
            best = max(causal_runs, key=lambda r: row[f"{r}_tflops"])
            row[f"best_causal_{kind}"] = best.rsplit("_", 1)[0]
            row[f"best_causal_{kind}_ms"] = row[f"{best}_ms"]
            row[f"best_causal_{kind}_tflops"] = row[f"{best}_tflops"]
    return row


EFFICIENCY_COLUMNS = (
    Column("POR", "por_target", "{:.1f}"), Column("S", "S"), Column("trees", "trees"),
    Column("tokens", "tokens"), Column("tree pairs", "tree_pairs", "{:.3g}"),
    Column("causal pairs", "causal_pairs", "{:.3g}"),
    Column("tree block eff.", "tree_block_efficiency", "{:.3f}"),
    Column("causal block eff.", "causal_block_efficiency", "{:.3f}"),
)
TIMING_COLUMNS = EFFICIENCY_COLUMNS[:2] + (
    Column("tree fwd ms", "tree_fwd_ms", "{:.2f}"),
    Column("tree fwd TFLOP/s", "tree_fwd_tflops", "{:.0f}"),
    Column("best causal fwd", "best_causal_fwd"),
    Column("causal fwd ms", "best_causal_fwd_ms", "{:.2f}"),
    Column("causal fwd TFLOP/s", "best_causal_fwd_tflops", "{:.0f}"),
    Column("tree f+b ms", "tree_step_ms", "{:.2f}"),
    Column("tree f+b TFLOP/s", "tree_step_tflops", "{:.0f}"),
    Column("best causal f+b", "best_causal_step"),
    Column("causal f+b ms", "best_causal_step_ms", "{:.2f}"),
    Column("causal f+b TFLOP/s", "best_causal_step_tflops", "{:.0f}"),
)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, repeats=10, quick="S <= 8192, 3 repeats")
    parser.add_argument("--por", type=float, nargs="+", default=[0.3, 0.6, 0.9])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128],
                        metavar=("Q_HEADS", "KV_HEADS", "HEAD_DIM"))
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--impl", default="auto", help="the tree kernel (default: auto)")
    parser.add_argument("--blocks", type=int, nargs=2, default=[128, 128],
                        metavar=("BLOCK_Q", "BLOCK_KV"), help="blocks of the efficiency count")
    args = parser.parse_args(argv)
    if args.quick:
        args.seq_lens = [s for s in args.seq_lens if s <= 8192] or args.seq_lens[:1]
        args.repeats = 3
    heads = Heads(*args.heads)
    on_gpu = jax.default_backend() == "gpu"
    device = jax.devices()[0].device_kind
    note = (f"timed on {device}" if on_gpu else
            f"backend {jax.default_backend()}: block efficiency only, timings need a GPU")
    print(f"{note}; heads q={heads.q} kv={heads.kv} dim={heads.dim}, {args.dtype}, blocks "
          f"{args.blocks[0]}x{args.blocks[1]}")
    rows = []
    for s in args.seq_lens:
        for por in args.por:
            rows.append(bench_case(por, s, heads, args, on_gpu))
            print(f"  done POR {por} S {s}", flush=True)
    table = (f"{note}\n\nblock efficiency (useful pairs / pairs in non-empty "
             f"{args.blocks[0]}x{args.blocks[1]} blocks):\n\n"
             + markdown_table(rows, EFFICIENCY_COLUMNS))
    if on_gpu:
        table += ("\n\nachieved TFLOP/s over visible pairs (medians; f+b: forward+backward):\n\n"
                  + markdown_table(rows, TIMING_COLUMNS))
        for row in rows:
            for run, why in row["failed"].items():
                table += f"\n- S {row['S']} POR {row['por_target']}: {run} did not run ({why})"
    print(table)
    written = Output.from_args(args, "bench_attention_gpu").write(
        {**run_info(args), "device": device, "timed": on_gpu, "heads": vars(heads),
         "cases": rows}, table=table)
    print(f"wrote {', '.join(map(str, written))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
