"""Benchmark of sliding-window tree attention on a long agent tree (CPU; not a test).

One agent-rollout tree of about S tokens (POR about 0.6, paths thousands of tokens deep) in one
row: forward + backward of one attention layer with a sliding window of W path tokens against the
same layer with full attention, side by side in one process (alternating runs, medians), for the
`cpu` and `xla` kernels. Reports the non-empty (computed) blocks of the block tables, their
fraction of the full-attention blocks, and the step times.

`--model-window W`: also a whole train step (AdamW, SFT) of a gpt-oss model (`MODEL`: sliding and
full layers alternating, sinks, MoE) on the same tree laid out by the trainer's own builder,
against the same model with every layer full: the blocks its attention layers compute in all and
the step times, side by side.

Writes bench_out/bench_window.json and .md (`jtree.launch.bench.harness`; `--out` picks the folder).

    python -m jtree.launch.bench.window              # S = 8192, W = 128, 1024
    python -m jtree.launch.bench.window --quick      # S = 2048
    python -m jtree.launch.bench.window --model-window 128 --impl xla
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jtree.config.architectures import GptOssConfig
from jtree.config.runtime import RuntimeConfig
from jtree.kernels import TreeMask, tree_attention
from jtree.kernels.attention.xla import default_blocks
from jtree.kernels.block_tables import EMPTY, classify_blocks
from jtree.launch.bench.attention import Heads, _inputs, shape_for, time_side_by_side
from jtree.launch.bench.harness import (
    Column,
    Output,
    alternate,
    bench_parser,
    markdown_table,
    run_info,
)
from jtree.launch.bench.step import StepLoop, step_of
from jtree.launch.bench.workloads import prepare
from jtree.layout.linearize import linearize
from jtree.models import create_model
from jtree.trees.synthetic import agent_rollout_group
from jtree.trees.tree import TrajectoryTree

# The model of the step rows: gpt-oss's layer pattern, sinks and MoE at a size a CPU steps in
# seconds (head_dim 64 as released; 4 layers, 2 of them sliding).
MODEL = dict(vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=1, head_dim=64, num_experts=4,
             num_experts_per_tok=2)


def long_tree(s: int, seed: int = 0, por: float = 0.6) -> TrajectoryTree:
    """One agent-rollout tree of at most s tokens."""
    shape = shape_for(por, int(0.8 * s))
    rng = np.random.default_rng(seed)
    for _ in range(64):
        tree = agent_rollout_group(rng, shape)
        if tree.n_tree_tokens <= s:
            return tree
    raise RuntimeError(f"no tree of at most {s} tokens drawn")


def long_tree_row(s: int, seed: int = 0, por: float = 0.6) -> tuple[np.ndarray, np.ndarray, dict]:
    """(`end`, `pos`) [1, s] of `long_tree(s)` in one row, and its stats."""
    tree = long_tree(s, seed, por)
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


def model_rows(s: int, window: int, repeats: int, impl: str) -> list[dict]:
    """Train steps of `MODEL` with sliding layers of `window` and with every layer full, on
    `long_tree(s)` as the trainer lays it out: the blocks the attention layers compute in all
    (per layer from the row's block table, with the layer's window) and the step times."""
    tree = long_tree(s)
    prepared = prepare([tree], "tree", s)
    end, pos = prepared.end, np.asarray(prepared.inputs.pos)
    block = default_blocks(end.shape[-1])[0]

    # Non-empty blocks of one layer of each kind, over every micro-batch's rows.
    layer_blocks = {kind: sum(int((classify_blocks(e, block, block, window=w, key_pos=p)
                                   != EMPTY).sum()) for e, p in zip(end, pos))
                    for kind, w in (("full_attention", None), ("sliding_attention", window))}
    variants = {"full": ("full_attention",) * MODEL["num_hidden_layers"], f"W {window}": None}
    runs, computed = {}, {}
    for name, layer_types in variants.items():
        cfg = GptOssConfig(**MODEL, sliding_window=window, layer_types=layer_types)
        step, state = step_of(create_model("gpt_oss", cfg, RuntimeConfig(attention_impl=impl)))
        runs[name] = StepLoop(state).run(step, prepared.inputs)
        computed[name] = sum(layer_blocks[kind] for kind in cfg.layer_types)
    timings = alternate(runs, repeats)
    stats = tree.stats()
    return [{"model": name, "impl": impl, "S": int(end.shape[-1]), "por": stats.por,
             "tree_tokens": stats.n_tree_tokens, "layers": MODEL["num_hidden_layers"],
             "blocks": computed[name], "blocks_over_full": computed[name] / computed["full"],
             "step_s": timings.median(name),
             "step_over_full": timings.median(name) / timings.median("full")}
            for name in variants]


def main(argv=None) -> int:
    parser = bench_parser(__doc__, repeats=5, quick="S = 2048, 3 repeats")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--window", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--heads", type=int, nargs=3, default=[8, 1, 64],
                        metavar=("Q_HEADS", "KV_HEADS", "HEAD_DIM"))
    parser.add_argument("--impl", nargs="+", default=["cpu", "xla"])
    parser.add_argument("--model-window", type=int, default=None,
                        help="also time gpt-oss train steps with this window against full "
                             "attention (the first --impl)")
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
    steps = []
    if args.model_window is not None:
        steps = model_rows(args.seq_len, args.model_window, args.repeats, args.impl[0])
        table += "\n\n" + markdown_table(steps, [
            Column("model", "model"), Column("impl", "impl"), Column("S", "S"),
            Column("POR", "por", "{:.2f}"), Column("layers", "layers"),
            Column("blocks", "blocks"), Column("/full", "blocks_over_full", "{:.3f}"),
            Column("step s", "step_s", "{:.2f}"), Column("/full", "step_over_full", "{:.2f}")])
    print(table)
    written = Output.from_args(args, "bench_window").write(
        {**run_info(args), "heads": vars(heads) if hasattr(heads, "__dict__") else list(heads),
         "rows": rows, "model_steps": steps}, table=table)
    print(f"wrote {', '.join(map(str, written))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
