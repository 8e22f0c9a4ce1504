"""The speed section of `jtree.launch.device_check`: tree attention against dense attention given the same
mask, a Qwen3-0.6B-shaped train step in tree and baseline mode with its MFU, and the GDN scans."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jtree.kernels.gdn.delta_rule import tree_gated_delta_rule
from jtree.launch.bench.harness import Column, markdown_table
from jtree.launch.device_report import Report, dispatch, first_line, peak_flops
from jtree.layout.linearize import linearize


def dense_kernels(end: np.ndarray, heads: Any, platform: str
                  ) -> dict[str, tuple[Callable, Callable]]:
    """Dense attention given the tree mask as a [1, 1, S, S] boolean mask (built inside the jitted
    call from `end`, so no S x S constant is compiled in): jax's dense kernels here (cuDNN and XLA
    on a GPU, XLA elsewhere; the XLA one runs out of memory at long S and is reported so) and
    tokamax when installed."""
    from jtree.launch.bench.attention_gpu import _fwd_and_step

    end = jnp.asarray(end[0])
    scale = heads.dim ** -0.5

    def tree_mask() -> jax.Array:
        i = jnp.arange(end.shape[0])
        return ((i[None, :] <= i[:, None]) & (i[:, None] < end[None, :]))[None, None]

    def dense(impl: str) -> Callable:
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=tree_mask(),
                                                            scale=scale, implementation=impl)

    impls = ("cudnn", "xla") if platform == "gpu" else ("xla",)
    kernels = {f"dense_{impl}": _fwd_and_step(dense(impl)) for impl in impls}
    try:
        import tokamax
    except ImportError:
        return kernels
    kernels["dense_tokamax"] = _fwd_and_step(lambda q, k, v: tokamax.dot_product_attention(
        q, k, v, mask=tree_mask(), scale=scale))
    return kernels


def attention_speed(platform: str, quick: bool, repeats: int) -> list[dict[str, Any]]:
    from jtree.launch.bench.attention import Heads, packed_row
    from jtree.launch.bench.attention_gpu import (
        _inputs,
        attention_flops,
        time_kernels,
        tree_kernel,
        visible_pairs,
    )

    heads = Heads(16, 8, 128)  # Qwen3-0.6B's attention
    dtype = jnp.float32 if platform == "cpu" else jnp.bfloat16
    rows = []
    for s in (512,) if quick else (8192, 16384, 32768):
        for por in (0.5,) if quick else (0.5, 0.9):
            end, trees = packed_row(por, s, seed=s + int(100 * por))
            pairs = visible_pairs(end, sum(t.n_tree_tokens for t in trees))
            kernels = {**tree_kernel("auto", end), **dense_kernels(end, heads, platform)}
            seconds, failed = time_kernels(kernels, _inputs(s, heads, dtype), repeats)
            row: dict[str, Any] = {"S": s, "por": por, "pairs": pairs, "failed": failed,
                                   "tree_impl": dispatch.resolve_impl(
                                       "auto", platform, dtype=dtype, head_dim=heads.dim),
                                   "execution": "native"}
            for run, t in seconds.items():
                kind = run.rsplit("_", 1)[1]
                row[f"{run}_ms"] = 1e3 * t
                row[f"{run}_tflops"] = attention_flops(pairs, heads, kind == "step") / t / 1e12
            for kind in ("fwd", "step"):
                dense = [n for n in seconds if n.startswith("dense") and n.endswith(kind)]
                if dense and f"tree_{kind}" in seconds:
                    best_dense = min(seconds[n] for n in dense)
                    row[f"speedup_{kind}"] = best_dense / seconds[f"tree_{kind}"]
            row["tokamax"] = "not installed" if not any("tokamax" in n for n in kernels) else "ran"
            rows.append(row)
            print(f"  attention S {s} POR {por}: {row.get('speedup_step')}", flush=True)
    return rows


def step_speed(platform: str, quick: bool, repeats: int) -> dict[str, Any]:
    """Tree vs baseline train step of a Qwen3-0.6B-shaped random model (bf16, S 8192), through
    `jtree.launch.bench`'s trainer batches; tokens/s (flat: the baseline's tokens) and MFU."""
    from jtree.config.architectures import Qwen3Config
    from jtree.launch.bench.harness import alternate
    from jtree.launch.bench.step import StepLoop, make_step
    from jtree.launch.bench.workloads import AUTO_MIN_GAIN, SHAPES, prepare
    from jtree.layout.flop_model import FlopModel, choose_mode
    from jtree.trees.synthetic import por_forest

    if quick:
        cfg, seq_len, flat, path_len = SHAPES["tiny"], 256, 768, 96
    else:
        cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                          num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                          head_dim=128, tie_word_embeddings=True)
        # Baseline: 16k flat tokens in 2-3 rows (activations ~0.4 GiB per layer and row).
        seq_len, flat, path_len = 8192, 16384, 2048
    trees = por_forest(np.random.default_rng(5), flat, 0.7, path_len=path_len,
                       max_tree_tokens=seq_len, vocab_size=cfg.vocab_size)
    prep = {mode: prepare(trees, mode, seq_len) for mode in ("tree", "baseline")}
    fm = FlopModel.for_config(cfg)
    plans = {m: p.plan for m, p in prep.items()}
    choice = choose_mode(fm, trees, tree_tokens=plans["tree"].n_rows * plans["tree"].row_len,
                         baseline_tokens=plans["baseline"].n_rows * plans["baseline"].row_len,
                         min_gain=AUTO_MIN_GAIN)
    dtype = "float32" if platform == "cpu" else "bfloat16"
    step, state = make_step(cfg, "auto", dtype=dtype, scan_layers=not quick,
                            remat="none" if quick else "dots_no_batch")
    loop = StepLoop(state)
    runs = {mode: loop.run(step.lower(state, p.inputs).compile(), p.inputs)
            for mode, p in prep.items()}
    timings = alternate(runs, repeats)
    peak = peak_flops(jax.devices()[0].device_kind)
    flat_tokens = prep["baseline"].work.tokens
    result: dict[str, Any] = {"execution": "native", "dtype": dtype, "seq_len": seq_len,
                              "auto_mode": choice.mode, "auto_reason": choice.reason,
                              "speedup": timings.ratio("baseline", "tree")}
    for mode, p in prep.items():
        t = timings.median(mode)
        flops = fm.flops(p.work)
        result[mode] = {"ms": 1e3 * t, "rows": p.plan.n_rows, "row_len": p.plan.row_len,
                        "computed_tokens": p.work.tokens, "flat_tokens_per_s": flat_tokens / t,
                        "tflops": flops / t / 1e12,
                        "mfu": flops / t / peak if peak else "unknown"}
    return result


def gdn_speed(quick: bool, repeats: int) -> dict[str, Any]:
    """Forward+backward of the tree scan, parallel vs sequential, on Qwen3-Next's GDN shapes."""
    from jtree.launch.bench.harness import alternate
    from jtree.trees.synthetic import por_forest

    s, hk, hv, d, chunk = (512, 2, 4, 32, 64) if quick else (8192, 16, 32, 128, 64)
    trees = por_forest(np.random.default_rng(6), 3 * s, 0.7, path_len=s // 4,
                       max_tree_tokens=s, vocab_size=100)
    batch = linearize(trees, s, gdn_chunk_size=chunk)
    gdn = batch.inputs.gdn
    r = batch.shape[0]
    rng = np.random.default_rng(0)
    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    args = [jnp.asarray(rng.normal(size=(r, s, h, d)) / d ** 0.5, dtype) for h in (hk, hk, hv)]
    args += [jnp.asarray(-rng.uniform(0, 1, size=(r, s, hv)), dtype),
             jnp.asarray(rng.uniform(size=(r, s, hv)), dtype)]
    runs = {}
    for scan in ("sequential", "parallel"):
        def loss(*xs, scan=scan):
            o, _ = tree_gated_delta_rule(*xs, chunk_tokens=gdn.chunk_tokens,
                                         chunk_src=gdn.chunk_src, token_slot=gdn.token_slot,
                                         scan=scan)
            return jnp.sum(o.astype(jnp.float32))

        step = jax.jit(jax.grad(loss, argnums=range(5))).lower(*args).compile()
        runs[scan] = lambda step=step: step(*args)
    timings = alternate(runs, repeats)
    chunks = int((np.asarray(gdn.chunk_tokens) >= 0).any(-1).sum())
    return {"execution": "native", "rows": r, "S": s, "chunks": chunks,
            **{f"{scan}_ms": 1e3 * timings.median(scan) for scan in runs},
            "parallel_speedup": timings.ratio("sequential", "parallel")}


SPEED_COLUMNS = (
    Column("S", "S"), Column("POR", "por"), Column("tree impl", "tree_impl"),
    Column("tree fwd TFLOP/s", "tree_fwd_tflops", "{:.3g}"),
    Column("tree f+b TFLOP/s", "tree_step_tflops", "{:.3g}"),
    Column("speedup fwd", "speedup_fwd", "{:.2f}"), Column("speedup f+b", "speedup_step", "{:.2f}"),
    Column("tokamax", "tokamax"),
    Column("failed", "failed", cell=lambda r: "; ".join(f"{k}: {v[:80]}" for k, v in
                                                      r["failed"].items()) or "-"),
)


STEP_COLUMNS = (
    Column("mode", "mode"), Column("ms", "ms", "{:.1f}"), Column("rows", "rows"),
    Column("row length", "row_len"), Column("computed tokens", "computed_tokens"),
    Column("flat tokens/s", "flat_tokens_per_s", "{:.4g}"), Column("TFLOP/s", "tflops", "{:.3g}"),
    Column("MFU", "mfu", cell=lambda r: r["mfu"] if isinstance(r["mfu"], str)
           else f"{r['mfu']:.1%}"),
)


def speed(report: Report, args: Any) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for name, fn in (("attention", lambda: attention_speed(report.platform, args.quick,
                                                         args.repeats)),
                     ("train_step", lambda: step_speed(report.platform, args.quick, args.repeats)),
                     ("gdn", lambda: gdn_speed(args.quick, args.repeats))):
        try:
            result[name] = fn()
        except Exception as error:  # one failed part leaves the others
            traceback.print_exc()
            result[name] = {"error": first_line(error)}
    report.md.append("## speed (native)\n\nattention: TFLOP/s over visible pairs; speedup = best "
                     "dense time given the tree mask / tree time\n")
    if isinstance(result["attention"], list):
        report.md.append(markdown_table(result["attention"], SPEED_COLUMNS))
    step = result["train_step"]
    if "error" in step:
        report.md.append(f"\ntrain step: {step['error']}\n")
    else:
        report.md += [f"\ntrain step ({step['dtype']}, S {step['seq_len']}): tree speedup "
                      f"{step['speedup']:.2f}x; `run.mode=auto` picks {step['auto_mode']} "
                      f"({step['auto_reason']})\n",
                      markdown_table([{"mode": m, **step[m]} for m in ("tree", "baseline")],
                                     STEP_COLUMNS)]
    gdn = result["gdn"]
    report.md.append("\nGDN tree scan, forward+backward: " + (gdn.get("error") or (
        f"S {gdn['S']}, {gdn['chunks']} chunks: sequential {gdn['sequential_ms']:.1f} ms, "
        f"parallel {gdn['parallel_ms']:.1f} ms ({gdn['parallel_speedup']:.2f}x)")) + "\n")
    return result
