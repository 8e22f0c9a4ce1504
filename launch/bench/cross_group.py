"""Prefixes shared across groups on an agent workload: `python -m jtree.launch.bench.cross_group`.

Workload: one training step of `--groups` agent tasks (`jtree.trees.synthetic.agent_rollout_group`:
rollouts resampled at turn boundaries, parallel tool calls, think-mode branches), every rollout of
every task beginning with the same system prompt of `--system-len` tokens (default 4096: the
system prompt and tool schemas of an agent run). Each task is one group, its own tree, with its
own GRPO advantages.

Two variants of the same step, built by the trainer's step builder
(`jtree.training.step_builders.step_builder`, one data shard, `--micro-batches` micro-batches,
rows of at most `--seq-len` tokens fitted from a ladder of 8 lengths per octave):

- `within_groups` (`data.share_prefixes: within_groups`, the default): each group its own tree, so
  the system prompt is computed once per group;
- `across_groups` (`data.share_prefixes: across_groups`): the step's trees merged per micro-batch
  at their common prefixes (`jtree.layout.cross_group`), the system prompt computed once per
  micro-batch.

Timed: the PPO loss and gradients of a small dense Qwen3 (`jax.jit(make_grad_fn(...))`; the
optimizer update costs the same in both and is left out), alternating rounds in shuffled order
(`jtree.launch.bench.harness.alternate`); the speedup is the median over rounds of within / across time
in the same round, with a bootstrap interval (and the same from process CPU time, less sensitive to
other jobs on a shared machine). Also reported: the FLOP ideal (`jtree.layout.flop_model`: a
merged branch's queries still see every key of the prompt, so attention shrinks with the
prompt's own tokens only), POR within groups (the sharing the
per-group trees have) and across groups (the sharing of the merged trees), the tree tokens each
variant computes (a tree larger than a row is cut into capacity parts that each recompute their
prefix, so `--seq-len` should hold a merged tree), rows, and the two losses (which must agree:
the merge is exact).

Writes bench_out/bench_cross_group.json and .md (`--out` picks the folder).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

from jtree.config import DataConfig
from jtree.config.architectures import Qwen3Config
from jtree.config.objective import Objective
from jtree.config.runtime import RuntimeConfig
from jtree.launch.bench.harness import (
    Column,
    Output,
    add_attention_flag,
    add_host_malloc_flag,
    alternate,
    apply_host_malloc,
    bench_parser,
    markdown_table,
    run_info,
)
from jtree.layout.flop_model import FlopModel, ideal_speedup, tree_work
from jtree.models import CausalLM
from jtree.step.train_step import make_grad_fn
from jtree.training.step_builders import step_builder, step_indices
from jtree.training.utilization import dominant_shape, matmul_call, mfu_from_rounds, model_flops
from jtree.trees.synthetic import AgentShape, agent_rollout_group
from jtree.trees.tree import TrajectoryTree

OBJECTIVE = Objective(kind="ppo", normalization="seq_mean_token_mean")
VARIANTS = ("within_groups", "across_groups")


def agent_groups(n_groups: int, system_len: int, shape: AgentShape,
                 seed: int = 0) -> list[TrajectoryTree]:
    """`n_groups` agent tasks whose rollouts all begin with one common system prompt of
    `system_len` tokens (each task then has its own task prompt and rollouts)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(1, shape.vocab_size, size=system_len)
    return [agent_rollout_group(rng, shape, system=system) for _ in range(n_groups)]


def build(trees: list[TrajectoryTree], share: str, seq_len: int,
          micro_batches: int) -> tuple[dict[str, Any], list[TrajectoryTree]]:
    """One step of all `trees` as the trainer lays it out with `data.share_prefixes=share`, and
    the units it computes."""
    data = DataConfig(seq_len=seq_len, trees_per_step=len(trees), micro_batches=micro_batches,
                      row_steps_per_octave=8, share_prefixes=share)
    builder = step_builder(trees, data, "tree", normalization=OBJECTIVE.normalization,
                           n_shards=1, shards=(0,), steps=1)
    indices = step_indices(len(trees), len(trees), data.shuffle_seed)[0]
    return builder(indices), builder.step_units(indices).units


def measure(trees: list[TrajectoryTree], graphdef: Any, params: Any, flops: FlopModel, *,
            seq_len: int, micro_batches: int, repeats: int, cfg: Any) -> dict[str, Any]:
    """Both variants of one step on `trees`: layout, work, timings, losses, and MFU against a
    plain matmul at the merged step's dominant shape (`cfg`'s widths), timed in the same
    rounds."""
    grad_fn = jax.jit(make_grad_fn(graphdef, OBJECTIVE))
    built = {v: build(trees, v, seq_len, micro_batches) for v in VARIANTS}
    steps = {v: b[0] for v, b in built.items()}
    work = {v: tree_work(b[1])[0] for v, b in built.items()}
    inputs = {v: jax.device_put(s["inputs"]) for v, s in steps.items()}
    runs = {v: (lambda v=v: grad_fn(params, inputs[v])) for v in VARIANTS}
    matmul = dominant_shape(int(np.prod(inputs["across_groups"].tokens.shape)), cfg)
    runs["matmul"] = matmul_call(matmul)
    timings = alternate(runs, repeats)
    losses = {v: float(timings.first_result[v][0]) for v in VARIANTS}
    info = steps["across_groups"]["info"]
    flat, tree_tokens = int(info["n_flat_tokens"]), int(info["n_tree_tokens"])
    computed = {v: int(s["info"]["n_computed_tokens"]) for v, s in steps.items()}
    low, high = timings.ratio_interval("within_groups", "across_groups")
    return {
        "groups": len(trees), "paths": int(info["n_paths"]), "flat_tokens": flat,
        "tree_tokens_within": tree_tokens,
        "por_within": 1 - tree_tokens / flat,
        "tree_tokens_across": tree_tokens - int(info["n_merge_saved_tokens"]),
        "por_across": 1 - (tree_tokens - int(info["n_merge_saved_tokens"])) / flat,
        "computed_tokens": computed,
        "merge_saved_tokens": int(info["n_merge_saved_tokens"]),
        "rows": {v: list(s["inputs"].tokens.shape) for v, s in steps.items()},
        "ms": timings.medians_ms(), "first_step_s": timings.first_s, "times_s": timings.wall,
        "speedup": timings.ratio("within_groups", "across_groups"),
        "speedup_cpu_time": timings.ratio("within_groups", "across_groups", cpu=True),
        "speedup_interval": [low, high],
        "verdict": timings.compare("within_groups", "across_groups"),
        "token_bound": computed["within_groups"] / computed["across_groups"],
        "flop_ideal": ideal_speedup(flops, work["across_groups"], work["within_groups"]),
        "loss": losses, "repeats": timings.rounds,
        "matmul_shape": matmul.describe(), "matmul_flops_per_s": matmul.flops / timings.median(
            "matmul"),
        "mfu": {v: mfu_from_rounds(model_flops(flops, work[v]), timings.wall[v], matmul,
                                   timings.wall["matmul"]) for v in VARIANTS},
    }


COLUMNS = (
    Column("groups", "groups"), Column("paths", "paths"), Column("flat tokens", "flat_tokens"),
    Column("POR within groups", "por_within", "{:.3f}"),
    Column("POR across groups", "por_across", "{:.3f}"),
    Column("computed within / across", "",
           cell=lambda r: "{within_groups} / {across_groups}".format(**r["computed_tokens"])),
    Column("rows within / across", "", cell=lambda r: " / ".join(
        "x".join(map(str, r["rows"][v])) for v in VARIANTS)),
    Column("ms within / across", "", cell=lambda r: " / ".join(
        f"{r['ms'][v]:.0f}" for v in VARIANTS)),
    Column("speedup", "speedup", "{:.2f}"),
    Column("95% interval", "", cell=lambda r: "{:.2f}-{:.2f}".format(*r["speedup_interval"])),
    Column("speedup (CPU time)", "speedup_cpu_time", "{:.2f}"),
    Column("token bound", "token_bound", "{:.2f}"), Column("FLOP ideal", "flop_ideal", "{:.2f}"),
    Column("MFU within / across", "", cell=lambda r: " / ".join(
        f"{r['mfu'][v]:.1%}" for v in VARIANTS)),
)


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(__doc__, repeats=5, quick="3 groups behind a 256-token system prompt, "
                      "a one-layer model of width 32, rows of 4096, one timed round")
    ap.add_argument("--groups", type=int, default=8, help="agent tasks (groups) in the step")
    ap.add_argument("--system-len", type=int, default=4096,
                    help="tokens of the system prompt common to every group")
    ap.add_argument("--rollouts", type=int, default=4, help="rollouts per group")
    ap.add_argument("--seq-len", type=int, default=16384, help="the longest row (data.seq_len)")
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    add_attention_flag(ap)
    add_host_malloc_flag(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.groups, args.system_len, args.seq_len = 3, 256, 4096
        args.hidden, args.layers, args.repeats = 32, 1, 1
    kept = apply_host_malloc(args)
    shape = AgentShape(vocab_size=512, task_len=40, turns=3, assistant_len=48, tool_len=40,
                       rollouts=args.rollouts, think_len=24)
    trees = agent_groups(args.groups, args.system_len, shape)
    cfg = Qwen3Config(vocab_size=shape.vocab_size, hidden_size=args.hidden,
                      intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4,
                      tie_word_embeddings=False)
    graphdef, params = nnx.split(CausalLM(cfg, RuntimeConfig(attention_impl=args.attention),
                                          rngs=nnx.Rngs(0)))
    row = measure(trees, graphdef, params, FlopModel.for_config(cfg), seq_len=args.seq_len,
                  micro_batches=args.micro_batches, repeats=args.repeats, cfg=cfg)
    losses = list(row["loss"].values())
    if abs(losses[0] - losses[1]) > 1e-4 * max(abs(losses[0]), 1e-6):
        raise AssertionError(f"losses disagree: {row['loss']}")
    table = markdown_table([row], COLUMNS)
    print(table)
    report = {**run_info(args), "host_malloc_keeps_freed_memory": kept, "rows": [row]}
    written = Output.from_args(args, "bench_cross_group").write(report, table=table)
    print(f"wrote {', '.join(map(str, written))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
