"""Benchmark redundancy-free partitioning: `python -m jtree.launch.bench.redundancy_free`.

On agent-rollout trees 2-8x larger than the capacity C (rows of at most C tokens, one row per
device call or micro-batch), one SFT training step (loss and gradients) of a small dense Qwen3
three ways, measured side by side in one process (compile excluded, alternating rounds; a
speedup is the median over rounds of the baseline's time / the method's time in that round):

- `baseline`: every path a separate sequence, packed into rows of C tokens, micro-batches scanned;
- `duplicating`: the tree cut by the `jtree.partitioning.partition` heuristic, each part holding its whole
  prefix (N_computed > N_tree), parts packed into rows of C tokens, micro-batches scanned;
- `rfree`: `jtree.partitioning.redundancy_free` parts of at most C tokens over cached prefixes (N_computed == N_tree),
  each in a row fitted to its tokens (`jtree.partitioning.redundancy_free.layout.row_length`), run part by part
  (`RedundancyFreeStep`), the prefix backward from saved residuals;
- `rfree_recompute`: the same, recomputing a part's forward for its backward (less memory held
  while its children run, one more forward per part with children);
- `rfree_auto`: residuals for parts whose children are all leaf parts, recompute above.

Parts run in post-order (`jtree.partitioning.redundancy_free.schedule`). Memory, two measures of real buffer bytes (the
CPU backend has no device memory statistics):
- `peak_bytes`: the peak over the step's device calls of (bytes of every live jax.Array in the
  process at the call, `jax.live_arrays()`, + the called executable's temporary bytes from XLA's
  memory analysis); for the scanned steps that is one call. Comparable across all methods.
- `held_bytes` (rfree only): the peak of what the executor itself holds between calls (residuals,
  outputs, prefixes, cotangent accumulators; `RedundancyFreeStep.live`), without parameters,
  gradients and temporaries.
Also reports the first step's time (compiles included) and checks that the losses agree.

Utilization (`jtree.training.utilization`, as in `jtree.launch.bench`): each method's model FLOPs
(of the work it computes: every path for `baseline`, every part's whole prefix again for
`duplicating`, the tree once for the rfree methods), achieved FLOP/s and MFU against a plain
matmul timed in the same rounds as the methods, at the dominant shape of the tree's tokens (the
rfree step's, all its calls together; `dominant_shape`): one row of C tokens would be a matmul
small enough for dispatch to dominate, a ceiling below what the machine gives (`--quick`'s tiny
model is dispatch-bound whatever the shape: its MFU can read above 100%).

Bounds. The issue's target is the token bound N_flat / N_tree; the FLOP ideal (`jtree.layout.flop_model`, as
`jtree.launch.bench` reports it) is lower when attention matters, because sharing saves tokens but a
branch's queries still see every shared key (docs/design.md section 8). The model's MLP is 4x its
width by default (`--mlp-ratio`), the usual LLM proportion, so attention is ~10% of its FLOPs as
in a real model at these lengths; both bounds are printed.

Like `jtree.launch.bench`, it first makes glibc keep freed host memory (`jtree.training.host_allocator`; every
method's calls otherwise page-fault their temporaries again on each run).

Writes bench_out/bench_redundancy_free.json, .md and .png (`jtree.launch.bench.harness`; `--out` picks the folder).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

from jtree.config.architectures import Qwen3Config
from jtree.config.objective import Objective
from jtree.config.run import ROW_STEPS_PER_OCTAVE
from jtree.config.runtime import RuntimeConfig
from jtree.launch.bench.harness import (
    Column,
    CompiledMemory,
    Output,
    add_attention_flag,
    add_host_malloc_flag,
    alternate,
    apply_host_malloc,
    bench_parser,
    figure,
    markdown_table,
    run_info,
)
from jtree.layout.baseline import flatten_paths
from jtree.layout.coefficients import batch_normalizer
from jtree.layout.flop_model import FlopModel, ideal_speedup, tree_work
from jtree.layout.microbatches import build_microbatches
from jtree.models import CausalLM
from jtree.partitioning.partition import partition
from jtree.partitioning.redundancy_free.executor import RedundancyFreeStep
from jtree.partitioning.redundancy_free.layout import build_program
from jtree.step.train_step import make_grad_fn
from jtree.training.utilization import (
    device_peak,
    dominant_shape,
    matmul_call,
    model_flops,
    utilization_fields,
)
from jtree.trees.synthetic import AgentShape, agent_rollout_group
from jtree.trees.tree import TrajectoryTree

OBJECTIVE = Objective(kind="sft", normalization="seq_mean_token_mean")
RFREE_MODES = {"rfree": "residuals", "rfree_recompute": "recompute", "rfree_auto": "auto"}
NAMES = ("baseline", "duplicating", *RFREE_MODES)


def pick_tree(ratio: float, capacity: int, seed: int) -> TrajectoryTree:
    """An agent-rollout tree of about `ratio` x `capacity` tree tokens whose paths fit C."""
    best = None
    for rollouts in (4, 6, 8, 12, 16, 24, 32, 48, 64):
        for s in range(8):
            shape = AgentShape(system_len=50, task_len=20, turns=3, assistant_len=16,
                               tool_len=12, rollouts=rollouts, branch_prob=0.8, think_len=8,
                               parallel_tools=3)
            t = agent_rollout_group(np.random.default_rng(seed * 100 + s), shape)
            if t.path_lengths.max() > capacity:
                continue
            err = abs(t.n_tree_tokens / capacity - ratio)
            if best is None or err < best[0]:
                best = (err, t)
    return best[1]


def live_bytes() -> int:
    return sum(a.nbytes for a in jax.live_arrays())


def temp_bytes(fn, args) -> int:
    return CompiledMemory.of(fn.lower(*args).compile()).temp_bytes


class PeakProbe:
    """`on_call` hook of RedundancyFreeStep: peak of live bytes + the callee's temporaries."""

    def __init__(self):
        self.peak = 0
        self._temp: dict = {}

    def __call__(self, name, fn, args) -> None:
        temp = 0
        if fn is not None:
            key = (name, jax.tree_util.tree_structure(args),
                   tuple(getattr(x, "shape", None) for x in jax.tree_util.tree_leaves(args)))
            if key not in self._temp:
                self._temp[key] = temp_bytes(fn, args)
            temp = self._temp[key]
        self.peak = max(self.peak, live_bytes() + temp)


def bench_tree(tree: TrajectoryTree, capacity: int, graphdef, params, repeats: int,
               cfg: Qwen3Config, row_steps_per_octave: int = ROW_STEPS_PER_OCTAVE) -> dict:
    flops = FlopModel.for_config(cfg)
    norm = batch_normalizer([tree], OBJECTIVE.normalization)
    grad_fn = jax.jit(make_grad_fn(graphdef, OBJECTIVE))
    base = build_microbatches(flatten_paths([tree]), capacity, rows_per_microbatch=1,
                              normalization=OBJECTIVE.normalization, normalizer=norm).inputs()
    dup_parts = partition(tree, capacity).parts
    dup = build_microbatches(dup_parts, capacity, rows_per_microbatch=1,
                             normalization=OBJECTIVE.normalization, normalizer=norm).inputs()
    program = build_program([tree], capacity, normalization=OBJECTIVE.normalization,
                            normalizer=norm, row_steps_per_octave=row_steps_per_octave)
    steps = {name: RedundancyFreeStep(graphdef, OBJECTIVE, prefix_backward=mode)
             for name, mode in RFREE_MODES.items()}
    runs = {
        "baseline": lambda: grad_fn(params, base),
        "duplicating": lambda: grad_fn(params, dup),
        **{name: (lambda step=step: step(params, program)) for name, step in steps.items()},
    }
    matmul = dominant_shape(tree.n_tree_tokens, cfg)  # MFU's ceiling, timed in the same rounds
    runs["matmul"] = matmul_call(matmul)
    timings = alternate(runs, repeats)  # the warm-up round compiles: the first step's time
    losses = {name: float(timings.first_result[name][0]) for name in NAMES}
    memory, held = {}, {}
    for name, inputs in (("baseline", base), ("duplicating", dup)):
        memory[name] = live_bytes() + temp_bytes(grad_fn, (params, inputs))
    for name, step in steps.items():  # the timed steps, now probed (nothing compiles again)
        probe = PeakProbe()
        step.on_call = probe
        jax.block_until_ready(step(params, program))
        memory[name] = probe.peak
        held[name] = step.live.peak_bytes
    part_shapes = {tuple(v.shape for v in jax.tree_util.tree_leaves(p.inputs))
                   for p in program.parts}
    stats = tree.stats()
    tree_w, base_w = tree_work([tree])
    work = {"baseline": base_w, "duplicating": tree_work(dup_parts)[0],
            **{name: tree_w for name in RFREE_MODES}}
    peak = device_peak("float32")
    ms = {k: v for k, v in timings.medians_ms().items() if k in NAMES}
    return {
        "n_tree": stats.n_tree_tokens, "n_flat": stats.n_flat_tokens,
        "ratio": stats.n_tree_tokens / capacity, "paths": stats.n_paths,
        "n_computed": {"baseline": stats.n_flat_tokens,
                       "duplicating": int(sum(p.n_tree_tokens for p in dup_parts)),
                       **{name: program.n_computed for name in RFREE_MODES}},
        "calls": {"baseline": int(base.tokens.shape[0]),
                  "duplicating": int(dup.tokens.shape[0]),
                  **{name: len(program.parts) for name in RFREE_MODES}},
        "part_shapes": len(part_shapes), "prefix_lengths": sorted(
            {p.prefix_len for p in program.parts}),
        "ms": ms, "first_step_s": timings.first_s, "peak_bytes": memory, "held_bytes": held,
        "loss": losses,
        # Each run is paired with the baseline run of the same round (alternating runs see the
        # same load on a shared machine): the median of those ratios.
        "speedup_vs_baseline": {k: timings.ratio("baseline", k) for k in ms if k != "baseline"},
        "times_s": timings.wall,
        "matmul_shape": matmul.describe(),
        "matmul_flops_per_s": matmul.flops / timings.median("matmul"),
        "utilization": {k: v for name in NAMES for k, v in utilization_fields(
            name, model_flops(flops, work[name]), timings.wall[name], matmul,
            timings.wall["matmul"], peak).items()},
        "token_bound": stats.n_flat_tokens / stats.n_tree_tokens,
        "flop_ideal": ideal_speedup(flops, tree_w, base_w),
        "row_slots": {"baseline": int(base.tokens.size), "duplicating": int(dup.tokens.size),
                      "rfree": int(sum(p.inputs.tokens.size for p in program.parts))},
    }


def _per_method(header: str, cell: Any, names: tuple[str, ...] = NAMES) -> Column:
    """One column of `a/b/c` values, one per method in `names`."""
    return Column(f"{header} {'/'.join(names)}", "",
                  cell=lambda c: "/".join(cell(c, n) for n in names))


COLUMNS = (
    Column("ratio", "ratio", "{:.1f}"), Column("N_tree", "n_tree"), Column("N_flat", "n_flat"),
    Column("N_comp dup", "", cell=lambda c: str(c["n_computed"]["duplicating"])),
    Column("parts", "", cell=lambda c: str(c["calls"]["rfree"])),
    Column("shapes", "part_shapes"),
    _per_method("ms", lambda c, n: f"{c['ms'][n]:.0f}"),
    _per_method("peak MiB", lambda c, n: f"{c['peak_bytes'][n] / 2**20:.1f}"),
    _per_method("rfree held MiB", lambda c, n: f"{c['held_bytes'][n] / 2**20:.1f}",
                tuple(RFREE_MODES)),
    _per_method("speedup vs baseline", lambda c, n: f"{c['speedup_vs_baseline'][n]:.2f}",
                NAMES[1:]),
    Column("token bound", "token_bound", "{:.2f}"), Column("FLOP ideal", "flop_ideal", "{:.2f}"),
    _per_method("speedup / token bound",
                lambda c, n: f"{c['speedup_vs_baseline'][n] / c['token_bound']:.2f}",
                tuple(RFREE_MODES)),
    Column("matmul GFLOP/s", "matmul_flops_per_s",
           cell=lambda c: f"{c['matmul_flops_per_s'] / 1e9:.1f}"),
    _per_method("MFU", lambda c, n: f"{c['utilization'][f'{n}_mfu']:.1%}"),
)


def plot(report: dict) -> Any:
    cases = report["cases"]
    x = [c["ratio"] for c in cases]
    fig, axes = figure(2, (10, 4))
    for name, style in (("baseline", "k--"), ("duplicating", "C1o-"), ("rfree", "C0s-"),
                        ("rfree_recompute", "C2^-"), ("rfree_auto", "C3v-")):
        axes[0].plot(x, [c["ms"][name] for c in cases], style, label=name)
        axes[1].plot(x, [c["peak_bytes"][name] / 2**20 for c in cases], style, label=name)
    axes[0].set(xlabel="tree tokens / capacity", ylabel="step time (ms)",
                title=f"SFT step, capacity {report['capacity']}")
    axes[1].set(xlabel="tree tokens / capacity", ylabel="peak MiB (live + temporaries)",
                title="peak memory")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    return fig


def main(argv=None) -> int:
    ap = bench_parser(__doc__, repeats=5, quick="one tree of 2x the capacity, a one-layer model "
                      "of width 32, one timed round")
    ap.add_argument("--capacity", type=int, default=256)
    ap.add_argument("--ratios", default="2,4,6,8")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--mlp-ratio", type=int, default=4, help="intermediate size / hidden size")
    add_attention_flag(ap, default="xla")
    ap.add_argument("--row-steps-per-octave", type=int, default=ROW_STEPS_PER_OCTAVE,
                    help="how finely rfree part rows fit their tokens (jtree.partitioning.redundancy_free.layout)")
    add_host_malloc_flag(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.ratios, args.hidden, args.layers, args.repeats = "2", 32, 1, 1
    kept = apply_host_malloc(args)
    cfg = Qwen3Config(vocab_size=512, hidden_size=args.hidden,
                      intermediate_size=args.mlp_ratio * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=args.hidden // 4,
                      tie_word_embeddings=False)
    graphdef, params = nnx.split(CausalLM(cfg, RuntimeConfig(attention_impl=args.attention),
                                          rngs=nnx.Rngs(0)))
    cases = []
    for i, ratio in enumerate(float(r) for r in args.ratios.split(",")):
        tree = pick_tree(ratio, args.capacity, seed=i)
        c = bench_tree(tree, args.capacity, graphdef, params, args.repeats, cfg,
                       args.row_steps_per_octave)
        cases.append(c)
        print(markdown_table([c], COLUMNS).splitlines()[-1], flush=True)
        losses = list(c["loss"].values())
        if max(losses) - min(losses) > 1e-4 * abs(losses[0]):
            raise AssertionError(f"losses disagree: {c['loss']}")
    table = markdown_table(cases, COLUMNS)
    print(table)
    report = {**run_info(args), "capacity": args.capacity,
              "row_steps_per_octave": args.row_steps_per_octave,
              "host_malloc_keeps_freed_memory": kept, "cases": cases}
    written = Output.from_args(args, "bench_redundancy_free").write(report, table=table, fig=plot(report),
                                                          dpi=80)
    print(f"wrote {', '.join(map(str, written))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
