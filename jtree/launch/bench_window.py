"""Benchmark of sliding-window tree attention on a long agent tree (CPU; not a test).

One agent-rollout tree of about S tokens (POR about 0.6, paths thousands of tokens deep) in one
row: forward + backward of one attention layer with a sliding window of W path tokens against the
same layer with full attention, side by side in one process (alternating runs, medians), for the
`cpu` and `xla` kernels. Reports the non-empty (computed) blocks of the block tables, their
fraction of the full-attention blocks, and the step times.

Writes bench_out/bench_window.json and .md (`jtree.launch.harness`; `--out` picks the folder).

    PYTHONPATH=. python -m jtree.launch.bench_window              # S = 8192, W = 128, 1024
    PYTHONPATH=. python -m jtree.launch.bench_window --quick      # S = 2048
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jtree.kernels import TreeMask, tree_attention
from jtree.kernels.attention_xla import default_blocks
from jtree.kernels.block_tables import EMPTY, classify_blocks
from jtree.launch.bench_attention import Heads, _inputs, shape_for, time_side_by_side
from jtree.launch.harness import Column, Output, bench_parser, markdown_table, run_info
from jtree.layout.linearize import linearize
from jtree.trees.synthetic import agent_rollout_group


def long_tree_row(s: int, seed: int = 0, por: float = 0.6) -> tuple[np.ndarray, np.ndarray, dict]:
    """(`end`, `pos`) [1, s] of one agent-rollout tree of at most s tokens, and its stats."""
    shape = shape_for(por, int(0.8 * s))
    rng = np.random.default_rng(seed)
    for _ in range(64):
        tree = agent_rollout_group(rng, shape)
        if tree.n_tree_tokens <= s:
            break
    else:
        raise RuntimeError(f"no tree of at most {s} tokens drawn")
    inputs = linearize([tree], s, n_rows=1).inputs
    stats = tree.stats()
    return (np.asarray(inputs.mask.end, np.int32), np.asarray(inputs.pos, np.int32),
            {"por": stats.por, "tree_tokens": stats.n_tree_tokens, "paths": stats.n_paths})


@functools.lru_cache(maxsize=None)
def _step(impl: str, window: int | None):
    def f(q, k, v, end, pos, cot):
        mask = TreeMask(end, positions=pos, window=window)
        out, vjp = jax.vjp(lambda q, k, v: tree_attention(q, k, v, mask, impl=impl), q, k, v)
        return vjp(cot)

    return jax.jit(f)


def bench(s: int, windows: list[int], heads: Heads, repeats: int, impls: list[str]) -> list[dict]:
    end, pos, stats = long_tree_row(s)
    block = default_blocks(s)[0]
    q, k, v, cot = _inputs(s, heads)
    args = (q, k, v, jnp.asarray(end), jnp.asarray(pos), cot)
    runs = {(impl, w): (_step(impl, w), args) for impl in impls for w in (None, *windows)}
    timing = time_side_by_side(runs, repeats)
    full_blocks = int((classify_blocks(end, block, block) != EMPTY).sum())
    rows = []
    for w in (None, *windows):
        blocks = int((classify_blocks(end, block, block, window=w, key_pos=pos) != EMPTY).sum())
        row = {"S": s, "window": "full" if w is None else w, "max_depth": int(pos.max()) + 1,
               **stats, "block": block, "blocks": blocks, "blocks_over_full": blocks / full_blocks}
        for impl in impls:
            row[f"{impl}_ms"] = timing[(impl, w)]["ms"]
            row[f"{impl}_over_full"] = timing[(impl, w)]["ms"] / timing[(impl, None)]["ms"]
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = bench_parser(__doc__, repeats=5, quick="S = 2048, 3 repeats")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--window", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--heads", type=int, nargs=3, default=[8, 1, 64],
                        metavar=("Q_HEADS", "KV_HEADS", "HEAD_DIM"))
    parser.add_argument("--impl", nargs="+", default=["cpu", "xla"])
    args = parser.parse_args(argv)
    if args.quick:
        args.seq_len, args.repeats = 2048, 3
    heads = Heads(*args.heads)
    print(f"backend {jax.default_backend()}, heads q={heads.q} kv={heads.kv} dim={heads.dim}, "
          f"float32, fwd+bwd, medians of {args.repeats} alternating runs")
    rows = bench(args.seq_len, args.window, heads, args.repeats, args.impl)
    columns = [Column("S", "S"), Column("POR", "por", "{:.2f}"), Column("paths", "paths"),
               Column("depth", "max_depth"), Column("W", "window"), Column("blocks", "blocks"),
               Column("/full", "blocks_over_full", "{:.3f}")]
    for impl in args.impl:
        columns += [Column(f"{impl} ms", f"{impl}_ms", "{:.1f}"),
                    Column(f"{impl} /full", f"{impl}_over_full", "{:.2f}")]
    table = markdown_table(rows, columns)
    print(table)
    written = Output.from_args(args, "bench_window").write(
        {**run_info(args), "heads": vars(heads) if hasattr(heads, "__dict__") else list(heads),
         "rows": rows}, table=table)
    print(f"wrote {', '.join(map(str, written))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
