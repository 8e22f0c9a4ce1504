"""Context-parallel work balance: `python -m jtree.launch.bench.context`.

Long synthetic agent trees (about 128k tokens each, one row each) are split over the `context`
devices of the config (configs/long_tree_cp8.yaml: 8) two ways: the balanced split of
`jtree.layout.context_rows` (contiguous DFS pieces with equal attention work, gaps at the slice ends)
and the even token split (the ordinary row cut into c equal slices). For each device it reports
the attention work (non-empty (query block, key block) pairs of the block tables at the 64-token
kernel block, over the query blocks that hold a real token) and the real tokens, max / mean over
the devices (the work is that of the kernels' block tables with the mask's real queries: a query
block of a gap runs only its own key block; also the max / mean without skipping them, where
each such block sees the keys its gap interrupts), and the bytes each device receives per step:

- K/V all-gather: every attention layer gathers the other devices' K and V slices, (c - 1) L
  tokens x KV heads x head dim x 2 (K and V) x dtype bytes, and its backward returns as many dK /
  dV bytes (the model's attention layers and dtype from the config; no remat recompute counted);
- K/V needed: the same for only the key blocks some real local query sees (what a gather that
  skips unseen blocks would send);
- halo: the hidden states a device's first tokens are scored by that live on another device,
  all-gathered at one capacity H (the most any device exports): (c - 1) H x hidden x dtype bytes,
  forward and backward.

The ideal is the even split's slice length: the balanced split's gathers grow with its largest
piece, L / L_even. Planning only (host numpy); it runs on this CPU whatever the config's target.

Writes bench_out/bench_context.json, .md and .png (`jtree.launch.bench.harness`; `--out` picks the
folder). `--quick`: one tree of about 1k tokens, a smoke run.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jtree.config import load_config
from jtree.kernels.block_tables import EMPTY, classify_blocks
from jtree.launch.bench.harness import (
    Column,
    Output,
    bench_parser,
    figure,
    markdown_table,
    run_info,
)
from jtree.layout.context_rows import even_split, slice_length, slice_work
from jtree.layout.linearize import linearize
from jtree.layout.microbatches import unit_counts
from jtree.layout.planner import ROW_ALIGN, LayoutConfig, plan_rows, plan_step, row_length_ladder
from jtree.parallel.context import halo_capacity
from jtree.trees.synthetic import AgentShape, agent_rollout_group

# About 128k tokens per tree (100-150k over seeds 0-3): a long shared prompt, 12 turns of
# assistant + tool segments, up to 10 rollouts branching at turns.
LONG_TREE = AgentShape(vocab_size=151936, system_len=6000, task_len=2000, turns=12,
                       assistant_len=450, tool_len=700, rollouts=10, branch_prob=0.5,
                       think_len=300)
QUICK_TREE = AgentShape(vocab_size=512, system_len=200, task_len=50, turns=2, assistant_len=40,
                        tool_len=60, rollouts=3, branch_prob=0.5, think_len=20)  # ~1k tokens
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

SUMMARY_COLUMNS = (
    Column("tree", "seed"), Column("tokens", "tree_tokens"), Column("split", "split"),
    Column("L", "slice_len"), Column("max/mean blocks", "blocks_ratio", "{:.3f}"),
    Column("max/mean tokens", "tokens_ratio", "{:.3f}"),
    Column("max/mean if gaps not skipped", "gaps_ratio", "{:.3f}"),
    Column("K/V gather MB/dev", "kv_gather_mb", "{:.0f}"),
    Column("K/V needed MB/dev (max)", "kv_needed_mb", "{:.0f}"),
    Column("halo H", "halo"), Column("halo MB/dev", "halo_mb", "{:.2f}"),
    Column("gathers / even", "gather_vs_even", "{:.2f}"),
)
DEVICE_COLUMNS = (
    Column("device", "device"),
    Column("balanced blocks", "balanced_blocks"), Column("balanced tokens", "balanced_tokens"),
    Column("even blocks", "even_blocks"), Column("even tokens", "even_tokens"),
)


def needed_key_blocks(end: np.ndarray, valid: np.ndarray, context: int) -> np.ndarray:
    """[c] key blocks of other devices that some real query block of each device sees."""
    nonempty = classify_blocks(end[None], ROW_ALIGN, ROW_ALIGN)[0] != EMPTY
    live = valid.reshape(-1, ROW_ALIGN).any(-1)
    per = len(live) // context
    owner = np.arange(len(live)) // per
    out = np.zeros(context, np.int64)
    for k in range(context):
        seen = nonempty[(owner == k) & live].any(axis=0)
        out[k] = int((seen & (owner != k)).sum())
    return out


def measure_row(end: np.ndarray, valid: np.ndarray, pred: np.ndarray, context: int,
                model: dict[str, int]) -> dict[str, Any]:
    """Work, tokens and exchanged bytes per device of one laid-out row."""
    work = slice_work(end, valid, context, block=ROW_ALIGN)
    blocks = work.kernel_blocks
    # Every query block taken as real: the tables of a kernel that does not skip the gaps.
    unskipped = slice_work(end, np.ones_like(valid), context, block=ROW_ALIGN).blocks
    slice_len = len(end) // context
    kv_token = model["kv_heads"] * model["head_dim"] * 2 * model["bytes"]  # K and V
    per_layer = 2 * model["attention_layers"]  # forward gather + backward reduce-scatter
    h = halo_capacity(pred[None], context)  # the halo slots the step allocates per device
    return {
        "slice_len": slice_len, "blocks": blocks, "tokens": work.tokens,
        "gap_blocks": work.gap_blocks,
        "blocks_ratio": float(blocks.max() / blocks.mean()),
        "gaps_ratio": float(unskipped.max() / unskipped.mean()),
        "tokens_ratio": float(work.tokens.max() / work.tokens.mean()),
        "kv_gather_mb": (context - 1) * slice_len * kv_token * per_layer / 2**20,
        "kv_needed_mb": float(needed_key_blocks(end, valid, context).max()) * ROW_ALIGN
        * kv_token * per_layer / 2**20,
        "halo": h, "halo_mb": (context - 1) * h * model["hidden"] * model["bytes"] * 2 / 2**20,
    }


def layouts(tree, context: int, seq_len: int, row_lengths: tuple[int, ...] | None
            ) -> dict[str, Any]:
    """One tree in one row, laid out by the planner (balanced at its default slack, and at
    slack 0) and split evenly by tokens (the ordinary row, L = its tokens / c, rounded up)."""
    out = {}
    for name, slack in (("balanced", LayoutConfig.context_slack), ("balanced, slack 0", 0.0)):
        config = LayoutConfig(seq_len, context=context, row_lengths=row_lengths,
                              context_slack=slack)
        plan = plan_step([tree.n_tree_tokens], config, **unit_counts([tree], None, context))
        out[name] = linearize([tree], plan.row_len, plan=plan.placements[0])
    row_len = context * slice_length([even_split(tree.n_tree_tokens, context, block=ROW_ALIGN)],
                                     ROW_ALIGN)
    out["even"] = linearize([tree], row_len, plan=plan_rows([tree.n_tree_tokens], row_len))
    return out


def model_sizes(cfg) -> dict[str, int]:
    """What the exchanged bytes depend on, from a `TrainConfig`."""
    m = cfg.model.config
    return {"kv_heads": m.num_key_value_heads, "head_dim": m.head_dim, "hidden": m.hidden_size,
            "attention_layers": sum(k.mixer == "attention" for k in m.decoder().layers),
            "bytes": DTYPE_BYTES[cfg.runtime.dtype]}


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, repeats=None,
                          quick="one tree of ~1k tokens (a smoke run; fits configs/tiny.yaml)")
    parser.add_argument("--config", default="configs/long_tree_cp8.yaml",
                        help="the run config: model (bytes), data.seq_len, mesh.context")
    parser.add_argument("--context", type=int, default=None,
                        help="context-parallel devices (default: the config's mesh.context)")
    parser.add_argument("--seeds", type=int, default=4, help="trees (one row each)")
    args = parser.parse_args(argv)
    cfg = load_config(args.config)
    context = args.context or cfg.mesh.context
    seq_len = cfg.data.seq_len
    row_lengths = (None if cfg.data.row_steps_per_octave is None
                   else row_length_ladder(seq_len, cfg.data.row_steps_per_octave))
    model = model_sizes(cfg)
    shape, seeds = (QUICK_TREE, 1) if args.quick else (LONG_TREE, args.seeds)
    summary, devices = [], []
    for seed in range(seeds):
        tree = agent_rollout_group(np.random.default_rng(seed), shape)
        measured = {}
        for name, batch in layouts(tree, context, seq_len, row_lengths).items():
            x = batch.inputs
            measured[name] = measure_row(x.mask.end[0], x.valid[0], x.pred[0], context, model)
            summary.append({"seed": seed, "tree_tokens": tree.n_tree_tokens, "split": name,
                            **measured[name]})
        for row in summary[-len(measured):]:
            row["gather_vs_even"] = row["slice_len"] / measured["even"]["slice_len"]
        if seed == 0:
            devices = [{"device": k, **{f"{n}_{f}": int(measured[n][f][k])
                                        for n in ("balanced", "even")
                                        for f in ("blocks", "tokens")}}
                       for k in range(context)]
    worst = max(r["blocks_ratio"] for r in summary if r["split"] == "balanced")
    worst_even = max(r["blocks_ratio"] for r in summary if r["split"] == "even")
    table = (f"Context {context}, row capacity {seq_len}, block {ROW_ALIGN}; worst balanced "
             f"max/mean attention blocks {worst:.3f} (even token split: {worst_even:.3f})\n\n"
             + markdown_table(summary, SUMMARY_COLUMNS) + "\n\nPer device, tree 0:\n\n"
             + markdown_table(devices, DEVICE_COLUMNS))
    print(table)
    fig, axes = figure(2, (12, 4))
    x = np.arange(context)
    for ax, field, title in ((axes[0], "blocks", "attention blocks"),
                             (axes[1], "tokens", "real tokens")):
        ax.bar(x - 0.2, [d[f"balanced_{field}"] for d in devices], 0.4, label="balanced")
        ax.bar(x + 0.2, [d[f"even_{field}"] for d in devices], 0.4, label="even tokens")
        ax.set_xlabel("context device")
        for split, color in (("balanced", "C0"), ("even", "C1")):
            ax.axhline(np.mean([d[f"{split}_{field}"] for d in devices]), color=color, lw=0.8,
                       ls="--")
        ax.set_title(f"{title} per device (tree 0, {summary[0]['tree_tokens']} tokens; "
                     "dashed: mean)")
        ax.legend()
    report = {**run_info(args), "context": context, "seq_len": seq_len, "model": model,
              "summary": summary, "devices": devices, "worst_balanced_ratio": worst,
              "worst_even_ratio": worst_even}
    Output.from_args(args, "bench_context").write(report, table=table, fig=fig)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
