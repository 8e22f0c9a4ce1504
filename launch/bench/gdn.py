"""Benchmark: one Gated DeltaNet layer, forward + backward, on trees vs on every path separately,
with the sequential and the parallel tree scan.

`python -m jtree.launch.bench.gdn [--out bench_out] [--paths 16] [--path-len 512] [--quick]`

For each target POR, builds a tree of `--paths` rollouts of `--path-len` tokens that share
prefixes on two levels (a common prompt, then pairs of rollouts sharing a turn), sized so that
POR = 1 - tree tokens / flat tokens hits the target (POR 0: no sharing, one root per rollout). The
tree mode runs the layer on the DFS layout with chunk routing; the baseline runs the same layer on
the paths packed one per row (each a plain sequence). Each layout runs with both scans
(`RuntimeConfig.gdn_scan` "sequential" and "parallel"), so four variants, alternating in one
process. Both differentiate a weighted sum of the outputs with respect to the layer's parameters
and inputs. Reports median step times, the tree's speedups (per-round ratios against the faster
per-path variant: of the tree with the scan `gdn_scan: auto` picks on this platform, the headline,
and of each tree scan; and the parallel against the sequential tree scan). The headline comes with a
95% bootstrap interval over the rounds and a verdict (faster, parity: the interval holds 1, or
slower), next to the interval of a control: the per-path step run twice in every round, which does
the same work as itself, so its interval is this machine's noise. Also XLA's compiled temp
memory of the step, and the bytes the backward pass keeps (jax.vjp residuals), which grow with the
number of chunks, not chunks x nodes. Writes bench_out/bench_gdn.json, .md and .png
(`jtree.launch.bench.harness`; `--out` picks the folder).
"""

from __future__ import annotations

import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jtree.config.architectures import Qwen3NextConfig
from jtree.config.runtime import RuntimeConfig
from jtree.kernels.gdn.delta_rule import pick_scan
from jtree.launch.bench.harness import (
    Column,
    CompiledMemory,
    Output,
    alternate,
    bench_parser,
    figure,
    markdown_table,
    run_info,
)
from jtree.layout.baseline import linearize_baseline
from jtree.layout.linearize import TreeBatch, linearize
from jtree.models.gated_deltanet import GatedDeltaNet, gdn_routing
from jtree.trees.tree import TrajectoryTree


def por_tree(rng: np.random.Generator, n_paths: int, path_len: int, por: float) -> TrajectoryTree:
    """`n_paths` sequences of `path_len` tokens: a prompt of P tokens shared by all, then a turn of
    Q tokens shared by pairs, then a private tail. Then flat - tree tokens = (n - 1) P + (n / 2) Q.
    For por >= 0.25, Q = (L - P) / 2 and P is chosen so that 1 - tree / flat = por; below, P = 0
    and Q = 2 L por (POR 0: n unrelated sequences, one root each)."""
    n, big_l = n_paths, path_len
    if por < 0.25:
        p, q = 0, int(round(2 * big_l * por))
    else:
        p = int(round((por - 0.25) * n * big_l / (0.75 * n - 1)))
        q = (big_l - p) // 2
    if not 0 <= p < big_l or por < 0:
        raise ValueError(f"por={por}: needs a prompt of {p} tokens; use 0 <= por < (n-1)/n")
    prompt = rng.integers(1, 1000, size=p)
    # Without a prompt, what follows it starts with a distinct token per branch, so that the
    # branches share nothing by chance.
    firsts = iter(rng.permutation(np.arange(1, 1000)))

    def fresh(size: int) -> np.ndarray:
        x = rng.integers(1, 1000, size=size)
        if p == 0 and size:
            x[0] = next(firsts)
        return x

    seqs = []
    for _ in range(n // 2):
        turn = fresh(q)
        for _ in range(2):
            tail = fresh(big_l - p - q) if q == 0 else rng.integers(1, 1000, size=big_l - p - q)
            seqs.append(np.concatenate([prompt, turn, tail]))
    return TrajectoryTree.from_sequences(seqs)


def make_step(graphdef, batch: TreeBatch, embed: jax.Array, kernel: int):
    inputs = jax.tree_util.tree_map(jnp.asarray, batch.inputs)
    weight = jnp.asarray(inputs.valid, jnp.float32) * jnp.asarray(inputs.path_count, jnp.float32)

    def loss(params, emb):
        layer = nnx.merge(graphdef, params)
        x = emb[inputs.tokens]
        routing = gdn_routing(inputs.pred, inputs.gdn, kernel)
        out, _ = layer(x, routing)  # (output, cache for a continuation)
        return jnp.sum(weight[..., None] * out * x)

    step = jax.jit(jax.grad(loss, argnums=(0, 1)))

    def residual_bytes(params) -> int:
        _, vjp_fn = jax.vjp(jax.jit(loss), params, embed)
        return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(vjp_fn))

    return step, residual_bytes


SCANS = ("sequential", "parallel")
COLUMNS = (
    Column("POR", "por", "{:.2f}"), Column("tree seq ms", "tree_sequential_ms"),
    Column("tree par ms", "tree_parallel_ms"), Column("paths seq ms", "paths_sequential_ms"),
    Column("paths par ms", "paths_parallel_ms"),
    Column("tree (auto scan) vs best paths", "speedup", "{}x"),
    Column("95% interval", "speedup_interval", "{0[0]:.3f}-{0[1]:.3f}"),
    Column("verdict", "verdict"),
    Column("paths vs itself, 95%", "control_interval", "{0[0]:.3f}-{0[1]:.3f}"),
    Column("tree seq vs best paths", "sequential_tree_speedup", "{}x"),
    Column("tree par vs best paths", "parallel_tree_speedup", "{}x"),
    Column("tree par vs tree seq", "scan_speedup", "{}x"), Column("bound", "token_bound", "{}x"),
    Column("tree / paths temp MiB", "temp_mib"), Column("tree / paths resid MiB", "residual_mib"),
    Column("tree chunks", "tree_chunks"), Column("max depth (chunks)", "tree_depth"),
)


def chain_depth(chunk_src: np.ndarray, n_initial: int = 1) -> int:
    """The longest chain of chunks (the parallel scan's rounds are ceil(log2) of it)."""
    depth = np.zeros(chunk_src.shape, np.int64)
    for c in range(chunk_src.shape[1]):  # a chunk's source precedes it
        src = chunk_src[:, c]
        up = np.maximum(src - n_initial, 0)
        depth[:, c] = 1 + np.where(src >= n_initial, depth[np.arange(len(src)), up], 0)
    return int(depth.max())


def main(argv=None) -> int:
    ap = bench_parser(__doc__, repeats=5, quick="4 paths of 64 tokens, POR 0.5, 1 repeat")
    ap.add_argument("--paths", type=int, default=16)
    ap.add_argument("--path-len", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--por", type=float, nargs="+", default=[0.0, 0.3, 0.5, 0.6, 0.9])
    args = ap.parse_args(argv)
    if args.quick:
        args.paths, args.path_len, args.por, args.repeats = 4, 64, [0.5], 1

    cfg = Qwen3NextConfig(hidden_size=256, linear_num_key_heads=2, linear_num_value_heads=4,
                          linear_key_head_dim=64, linear_value_head_dim=64)
    graphdefs = {}
    for scan in SCANS:
        graphdefs[scan], params = nnx.split(
            GatedDeltaNet(cfg, RuntimeConfig(gdn_scan=scan), rngs=nnx.Rngs(0)))
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
        runs, temp, resid = {}, {}, {}
        for layout, batch in batches.items():
            row[f"{layout}_shape"] = list(batch.shape)
            row[f"{layout}_chunks"] = int(batch.inputs.gdn.chunk_src.shape[1] * batch.shape[0])
            row[f"{layout}_depth"] = chain_depth(np.asarray(batch.inputs.gdn.chunk_src))
            for scan in SCANS:
                name = f"{layout}_{scan}"
                step, residual_bytes = make_step(graphdefs[scan], batch, embed,
                                                 cfg.linear_conv_kernel_dim)
                compiled = step.lower(params, embed).compile()
                runs[name] = lambda compiled=compiled: compiled(params, embed)
                temp[name] = round(CompiledMemory.of(compiled).temp_bytes / 2**20, 2)
                resid[name] = round(residual_bytes(params) / 2**20, 2)
        auto = pick_scan("auto", jax.default_backend())
        # The control: the per-path step with the auto scan once more, in every round. Its
        # ratio to itself shows how far two runs of the same work differ here.
        timings = alternate({**runs, "paths_control": runs[f"paths_{auto}"]}, args.repeats)
        for name in runs:
            row[f"{name}_ms"] = round(timings.median(name) * 1e3, 2)
        best_paths = min(("paths_sequential", "paths_parallel"), key=timings.median)
        row["best_paths"] = best_paths
        row["auto_scan"] = auto
        row["speedup"] = round(timings.ratio(best_paths, f"tree_{auto}"), 2)
        row["speedup_interval"] = [round(x, 3) for x in
                                   timings.ratio_interval(best_paths, f"tree_{auto}")]
        row["verdict"] = timings.compare(best_paths, f"tree_{auto}")
        row["control_interval"] = [round(x, 3) for x in
                                   timings.ratio_interval("paths_control", f"paths_{auto}")]
        for scan in SCANS:
            row[f"{scan}_tree_speedup"] = round(timings.ratio(best_paths, f"tree_{scan}"), 2)
        row["scan_speedup"] = round(timings.ratio("tree_sequential", "tree_parallel"), 2)
        row["token_bound"] = round(row["flat_tokens"] / row["tree_tokens"], 2)
        row["temp_mib_by_variant"], row["residual_mib_by_variant"] = temp, resid
        row["temp_mib"] = f"{temp[f'tree_{auto}']} / {temp[best_paths]}"
        row["residual_mib"] = f"{resid[f'tree_{auto}']} / {resid[best_paths]}"
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
    a.plot(por, [r["parallel_tree_speedup"] for r in results], "o-", label="tree, parallel scan")
    a.plot(por, [r["sequential_tree_speedup"] for r in results], "s-", label="tree, sequential scan")
    a.plot(por, [r["token_bound"] for r in results], "k--", label="token bound 1/(1-POR)")
    a.axhline(1.0, color="grey", lw=0.5)
    a.set_xlabel("POR")
    a.set_ylabel("best per-path time / tree time")
    a.legend()
    for name, marker in (("tree_parallel", "o-"), ("tree_sequential", "s-"),
                         ("paths_sequential", "^--"), ("paths_parallel", "v--")):
        b.plot(por, [r["temp_mib_by_variant"][name] for r in results], marker,
               label=name.replace("_", ", "))
    b.set_xlabel("POR")
    b.set_ylabel("XLA temp memory (MiB)")
    b.legend()
    fig.suptitle("Gated DeltaNet layer, forward + backward")
    return fig


if __name__ == "__main__":
    raise SystemExit(main())
