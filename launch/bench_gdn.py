"""Benchmark: one Gated DeltaNet layer, forward + backward, on trees vs on every path separately.

`PYTHONPATH=. python -m jtree.launch.bench_gdn [--out bench_out] [--paths 16] [--path-len 512] [--quick]`

For each target POR, builds a tree of `--paths` rollouts of `--path-len` tokens that share
prefixes on two levels (a common prompt, then pairs of rollouts sharing a turn), sized so that
POR = 1 - tree tokens / flat tokens hits the target. The tree mode runs the layer on the DFS layout with
chunk routing; the baseline runs the same layer on the paths packed one per row (each a plain
sequence). Both differentiate a weighted sum of the outputs with respect to the layer's
parameters and inputs. Reports median step time (alternating runs in one process), XLA's
compiled temp memory of the step, and the bytes the backward pass keeps (jax.vjp residuals), which
grow with the number of chunks, not chunks x nodes. Writes bench_out/bench_gdn.json, .md and .png
(`jtree.launch.harness`; `--out` picks the folder).
"""

from __future__ import annotations

import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jtree.baseline import linearize_baseline
from jtree.linearize import TreeBatch, linearize
from jtree.models import Qwen3NextConfig, RuntimeConfig
from jtree.models.gated_deltanet import GatedDeltaNet, gdn_routing
from jtree.tree import TrajectoryTree
from jtree.launch.harness import (
    Column, CompiledMemory, Output, alternate, bench_parser, figure, markdown_table, run_info,
)


def por_tree(rng: np.random.Generator, n_paths: int, path_len: int, por: float) -> TrajectoryTree:
    """`n_paths` sequences of `path_len` tokens: a prompt of P tokens shared by all, then a turn of
    Q = (L - P) / 2 tokens shared by pairs, then a private tail. Then flat - tree tokens =
    (n - 1) P + (n / 2) Q, and P is chosen so that 1 - tree / flat = por."""
    n, big_l = n_paths, path_len
    p = int(round((por - 0.25) * n * big_l / (0.75 * n - 1)))
    if not 0 <= p < big_l:
        raise ValueError(f"por={por}: needs a prompt of {p} tokens; use 0.25 <= por < (n-1)/n")
    q = (big_l - p) // 2
    prompt = rng.integers(1, 1000, size=p)
    seqs = []
    for _ in range(n // 2):
        turn = rng.integers(1, 1000, size=q)
        for _ in range(2):
            seqs.append(np.concatenate([prompt, turn, rng.integers(1, 1000, size=big_l - p - q)]))
    return TrajectoryTree.from_sequences(seqs)


def make_step(graphdef, batch: TreeBatch, embed: jax.Array, kernel: int):
    inputs = jax.tree_util.tree_map(jnp.asarray, batch.inputs)
    weight = jnp.asarray(inputs.valid, jnp.float32) * jnp.asarray(inputs.path_count, jnp.float32)

    def loss(params, emb):
        layer = nnx.merge(graphdef, params)
        x = emb[inputs.tokens]
        gdn = inputs.gdn
        routing = gdn_routing(inputs.pred, gdn.chunk_tokens, gdn.chunk_src, gdn.token_slot,
                              gdn.export_slots, kernel)
        out, _ = layer(x, routing)  # (output, cache for a continuation)
        return jnp.sum(weight[..., None] * out * x)

    step = jax.jit(jax.grad(loss, argnums=(0, 1)))

    def residual_bytes(params) -> int:
        _, vjp_fn = jax.vjp(jax.jit(loss), params, embed)
        return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(vjp_fn))

    return step, residual_bytes


COLUMNS = (
    Column("POR", "por", "{:.2f}"), Column("tree ms", "tree_ms"), Column("paths ms", "paths_ms"),
    Column("speedup", "speedup", "{}x"), Column("bound", "token_bound", "{}x"),
    Column("tree temp MiB", "tree_temp_mib"), Column("paths temp MiB", "paths_temp_mib"),
    Column("tree resid MiB", "tree_residual_mib"),
    Column("paths resid MiB", "paths_residual_mib"), Column("tree chunks", "tree_chunks"),
)


def main(argv=None) -> int:
    ap = bench_parser(__doc__, repeats=5, quick="4 paths of 64 tokens, POR 0.5, 1 repeat")
    ap.add_argument("--paths", type=int, default=16)
    ap.add_argument("--path-len", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--por", type=float, nargs="+", default=[0.3, 0.6, 0.9])
    args = ap.parse_args(argv)
    if args.quick:
        args.paths, args.path_len, args.por, args.repeats = 4, 64, [0.5], 1

    cfg = Qwen3NextConfig(hidden_size=256, linear_num_key_heads=2, linear_num_value_heads=4,
                          linear_key_head_dim=64, linear_value_head_dim=64)
    graphdef, params = nnx.split(GatedDeltaNet(cfg, RuntimeConfig(), rngs=nnx.Rngs(0)))
    embed = jax.random.normal(jax.random.key(0), (1000, cfg.hidden_size)) * 0.5
    rng = np.random.default_rng(0)
    results = []
    for por in args.por:
        tree = por_tree(rng, args.paths, args.path_len, por)
        n_tree = tree.n_tree_tokens
        tree_len = -(-n_tree // args.chunk) * args.chunk
        batches = {
            "tree": linearize([tree], tree_len, gdn_chunk_size=args.chunk),
            "paths": linearize_baseline([tree], args.path_len, gdn_chunk_size=args.chunk),
        }
        row = {"por": round(tree.stats().por, 4), "tree_tokens": n_tree,
               "flat_tokens": int(tree.stats().n_flat_tokens), "nodes": tree.n_nodes}
        runs = {}
        for name, batch in batches.items():
            step, residual_bytes = make_step(graphdef, batch, embed, cfg.linear_conv_kernel_dim)
            compiled = step.lower(params, embed).compile()
            runs[name] = lambda compiled=compiled: compiled(params, embed)
            row[f"{name}_shape"] = list(batch.shape)
            row[f"{name}_chunks"] = int(batch.inputs.gdn.chunk_src.shape[1] * batch.shape[0])
            row[f"{name}_temp_mib"] = round(CompiledMemory.of(compiled).temp_bytes / 2**20, 2)
            row[f"{name}_residual_mib"] = round(residual_bytes(params) / 2**20, 2)
        timings = alternate(runs, args.repeats)
        for name in runs:
            row[f"{name}_ms"] = round(timings.median(name) * 1e3, 2)
        row["speedup"] = round(timings.ratio("paths", "tree"), 2)
        row["token_bound"] = round(row["flat_tokens"] / row["tree_tokens"], 2)
        row["temp_ratio"] = round(row["paths_temp_mib"] / max(row["tree_temp_mib"], 1e-9), 2)
        results.append(row)
        print(json.dumps(row))

    table = markdown_table(results, COLUMNS)
    print(table)
    written = Output.from_args(args, "bench_gdn").write(
        {**run_info(args), "results": results}, table=table, fig=plot(results))
    print(f"wrote {', '.join(map(str, written))}")
    return 0


def plot(results: list[dict]) -> Any:
    por = [r["por"] for r in results]
    fig, (a, b) = figure(2, (9, 3.5))
    a.plot(por, [r["speedup"] for r in results], "o-", label="realized speedup")
    a.plot(por, [r["token_bound"] for r in results], "k--", label="token bound 1/(1-POR)")
    a.set_xlabel("POR")
    a.set_ylabel("paths time / tree time")
    a.legend()
    b.plot(por, [r["tree_temp_mib"] for r in results], "o-", label="tree")
    b.plot(por, [r["paths_temp_mib"] for r in results], "s-", label="per path")
    b.set_xlabel("POR")
    b.set_ylabel("XLA temp memory (MiB)")
    b.legend()
    fig.suptitle("Gated DeltaNet layer, forward + backward")
    return fig


if __name__ == "__main__":
    raise SystemExit(main())
