"""Benchmark: compile time and program size of the training gradient against depth, with the
decoder layers scanned (`runtime.scan_layers: true`) and unrolled.

`python -m jtree.launch.bench.scan [--out bench_out] [--layers 2 8] [--arch qwen3 qwen3_next]
[--remat full] [--repeats 3] [--quick]`

For every architecture, depth and layout, the loss-and-gradient function of one tiny SFT batch
(hidden 64, the tiny config's other sizes) is lowered and compiled from scratch (a new `jax.jit`
each time, so nothing is cached); the variants are timed in alternating rounds
(`jtree.launch.bench.harness.alternate`). A Qwen3-Next depth is rounded up to whole 3 x Gated
DeltaNet + 1 x attention blocks. Reports the median compile seconds
(lowering included; wall and process CPU), the optimized program's size (characters of the
compiled HLO text) and, per layout, each depth's compile CPU time over the shallowest's: scanned
it stays near 1 (the body is compiled once whatever the depth; the bound issue 18 sets is 1.5 for
2 vs 8 layers), unrolled it grows with depth. Writes
bench_out/bench_scan.json and .md (`jtree.launch.bench.harness`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

from jtree.config.objective import Objective
from jtree.config.runtime import REMAT_POLICY_NAMES, RuntimeConfig
from jtree.launch.bench.harness import (
    Column,
    Output,
    alternate,
    bench_parser,
    markdown_table,
    run_info,
)
from jtree.layout.linearize import linearize
from jtree.models import architecture, create_model
from jtree.objectives.objective import objective_loss
from jtree.trees.synthetic import por_tree

SEQ_LEN, ROWS, GDN_CHUNK = 128, 2, 16
NEXT_BLOCK = ("linear_attention",) * 3 + ("full_attention",)


def model_config(arch: str, layers: int) -> Any:
    """A tiny config of `arch` with `layers` decoder layers (Qwen3-Next: whole blocks)."""
    size = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    if arch == "qwen3_next":
        size.update(layer_types=NEXT_BLOCK * (layers // len(NEXT_BLOCK)), num_experts=4,
                    num_experts_per_tok=2, moe_intermediate_size=32,
                    shared_expert_intermediate_size=32, linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
    return architecture(arch).config_class(**size)


def compile_fn(arch: str, layers: int, runtime: RuntimeConfig):
    """A call that lowers and compiles the loss gradient from scratch; returns the program."""
    model = nnx.eval_shape(lambda: create_model(arch, model_config(arch, layers), runtime))
    graphdef, params = nnx.split(model)
    trees = [por_tree(np.random.default_rng(i), SEQ_LEN, 4, 0.5, vocab_size=256)
             for i in range(ROWS)]
    batch = linearize(trees, SEQ_LEN, n_rows=ROWS, gdn_chunk_size=GDN_CHUNK,
                      gdn_chunks=SEQ_LEN).inputs

    def compile_once() -> str:
        def loss(p):
            return objective_loss(nnx.merge(graphdef, p), batch, Objective(kind="sft"))[0]

        return jax.jit(jax.grad(loss)).lower(params).compile().as_text()

    return compile_once


def main() -> None:
    ap = bench_parser(__doc__, repeats=3, quick="qwen3 only, 1 round")
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8],
                    help="depths to compile (default 2 8); a Qwen3-Next depth is rounded up to "
                         f"whole {len(NEXT_BLOCK)}-layer blocks")
    ap.add_argument("--arch", nargs="+", default=["qwen3", "qwen3_next"],
                    choices=["qwen3", "qwen3_moe", "qwen3_next"])
    ap.add_argument("--remat", default="full", choices=REMAT_POLICY_NAMES)
    args = ap.parse_args()
    if args.quick:
        args.arch, args.repeats = ["qwen3"], 1
    runs = {}
    for arch in args.arch:
        step = len(NEXT_BLOCK) if arch == "qwen3_next" else 1
        for layers in sorted({-(-n // step) * step for n in args.layers}):
            for scan in (True, False):
                runtime = RuntimeConfig(attention_impl="xla", remat=args.remat, scan_layers=scan)
                runs[(arch, layers, scan)] = compile_fn(arch, layers, runtime)
    # The warm-up round compiles too (nothing is cached): it gives the programs' text.
    timings = alternate({str(k): f for k, f in runs.items()}, args.repeats)
    rows = []
    for arch, layers, scan in runs:
        name = str((arch, layers, scan))
        rows.append(dict(arch=arch, layers=layers, scanned=scan,
                         compile_s=timings.median(name),
                         compile_cpu_s=float(np.median(timings.cpu[name])),
                         hlo_chars=len(timings.first_result[name])))
    for row in rows:  # CPU seconds: less sensitive than wall time to other jobs on the machine
        same = [r for r in rows if (r["arch"], r["scanned"]) == (row["arch"], row["scanned"])]
        shallow = min(same, key=lambda r: r["layers"])
        row["vs_shallowest"] = row["compile_cpu_s"] / shallow["compile_cpu_s"]
    columns = [Column("arch", "arch"), Column("layers", "layers"),
               Column("scanned", "scanned"), Column("compile (s)", "compile_s", "{:.2f}"),
               Column("compile CPU (s)", "compile_cpu_s", "{:.2f}"),
               Column("HLO chars", "hlo_chars", "{:,}"),
               Column("compile / shallowest", "vs_shallowest", "{:.2f}")]
    table = markdown_table(rows, columns)
    print(table)
    written = Output.from_args(args, "bench_scan").write(
        {**run_info(args), "results": rows}, table=table)
    print("wrote", ", ".join(map(str, written)))


if __name__ == "__main__":
    main()
