"""Benchmark: one Gated DeltaNet layer, forward + backward, on trees vs on every path separately.

`PYTHONPATH=. python -m jtree.launch.bench_gdn [--out bench_out/gdn] [--paths 16] [--path-len 512]`

For each target POR, builds a tree of `--paths` rollouts of `--path-len` tokens that share
prefixes on two levels (a common prompt, then pairs of rollouts sharing a turn), sized so that
POR = 1 - tree tokens / flat tokens hits the target. The tree mode runs the layer on the DFS layout with
chunk routing; the baseline runs the same layer on the paths packed one per row (each a plain
sequence). Both differentiate a weighted sum of the outputs with respect to the layer's
parameters and inputs. Reports median step time (alternating runs in one process), XLA's
compiled temp memory of the step, and the bytes the backward pass keeps (jax.vjp residuals), which
grow with the number of chunks, not chunks x nodes. Writes results.json and gdn.png.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jtree.baseline import linearize_baseline
from jtree.linearize import TreeBatch, linearize
from jtree.models import Qwen3NextConfig
from jtree.models.gated_deltanet import GatedDeltaNet, gdn_routing
from jtree.tree import TrajectoryTree


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
        out = layer(x, gdn_routing(inputs, kernel))
        return jnp.sum(weight[..., None] * out * x)

    step = jax.jit(jax.grad(loss, argnums=(0, 1)))

    def residual_bytes(params) -> int:
        _, vjp_fn = jax.vjp(jax.jit(loss), params, embed)
        return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(vjp_fn))

    return step, residual_bytes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_out/gdn")
    ap.add_argument("--paths", type=int, default=16)
    ap.add_argument("--path-len", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--por", type=float, nargs="+", default=[0.3, 0.6, 0.9])
    args = ap.parse_args(argv)

    cfg = Qwen3NextConfig(hidden_size=256, linear_num_key_heads=2, linear_num_value_heads=4,
                          linear_key_head_dim=64, linear_value_head_dim=64)
    graphdef, params = nnx.split(GatedDeltaNet(cfg, rngs=nnx.Rngs(0)))
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
        steps = {}
        for name, batch in batches.items():
            step, residual_bytes = make_step(graphdef, batch, embed, cfg.linear_conv_kernel_dim)
            compiled = step.lower(params, embed).compile()
            mem = compiled.memory_analysis()
            jax.block_until_ready(step(params, embed))
            steps[name] = step
            row[f"{name}_shape"] = list(batch.shape)
            row[f"{name}_chunks"] = int(batch.inputs.gdn.chunk_src.shape[1] * batch.shape[0])
            row[f"{name}_temp_mib"] = round(mem.temp_size_in_bytes / 2**20, 2)
            row[f"{name}_residual_mib"] = round(residual_bytes(params) / 2**20, 2)
        times = {name: [] for name in steps}
        for _ in range(args.repeats):
            for name, step in steps.items():
                t0 = time.perf_counter()
                jax.block_until_ready(step(params, embed))
                times[name].append(time.perf_counter() - t0)
        for name in steps:
            row[f"{name}_ms"] = round(float(np.median(times[name])) * 1e3, 2)
        row["speedup"] = round(row["paths_ms"] / row["tree_ms"], 2)
        row["token_bound"] = round(row["flat_tokens"] / row["tree_tokens"], 2)
        row["temp_ratio"] = round(row["paths_temp_mib"] / max(row["tree_temp_mib"], 1e-9), 2)
        results.append(row)
        print(json.dumps(row))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    header = ("POR", "tree ms", "paths ms", "speedup", "bound", "tree temp MiB", "paths temp MiB",
              "tree resid MiB", "paths resid MiB", "tree chunks")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for r in results:
        print(f"| {r['por']:.2f} | {r['tree_ms']} | {r['paths_ms']} | {r['speedup']}x | "
              f"{r['token_bound']}x | {r['tree_temp_mib']} | {r['paths_temp_mib']} | "
              f"{r['tree_residual_mib']} | {r['paths_residual_mib']} | {r['tree_chunks']} |")
    _plot(results, out / "gdn.png")
    return 0


def _plot(results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    por = [r["por"] for r in results]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
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
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    raise SystemExit(main())
