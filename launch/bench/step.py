"""End-to-end speedup of tree training over the per-branch baseline (not a test).

For every workload, the tree step and the baseline step (`jtree.layout.baseline`: every path its own
packed sequence, through the same linearization, model, attention kernel family and loss code)
run on the same trees, with the same model config, in one process: both compiled and run once, then
alternating runs, medians. Measured the way docs/design.md section 8 (and the seeds) define it:

- POR, token bound N_flat / N_computed, ideal speedup FLOPs_baseline / FLOPs_tree (`jtree.layout.flop_model`:
  per computed token, per visible (query, key) pair, per scored token), realized speedup (median
  over rounds of baseline step time / tree step time, wall clock, each tree run paired with the
  baseline run of its round, the two in shuffled order; the range of the pair ratios shows the
  noise), efficiency = realized / ideal, and the same from the process CPU time of the steps
  (less sensitive to other jobs taking the cores of a shared machine);
- host preparation (partitioning, packing, linearization, transfer; from trees whose cached
  layouts are cold) vs the device step, and host tokens/s;
- padding of each layout, and peak step memory of each mode from XLA's compiled memory analysis
  (arguments + outputs + temporaries of the jitted step; not a process RSS);
- the automatic mode choice (`jtree.layout.flop_model.choose_mode`) for the batch, and its predicted gain.
- utilization (`jtree.training.utilization`): each mode's model FLOPs, achieved FLOP/s and MFU
  against a plain matmul at the tree step's dominant shape, timed in the same rounds (the median
  of the per-round ratios), and against the datasheet peak on a GPU/TPU; XLA's own FLOP count of
  each compiled step is kept in the JSON.

Batches: exactly the trainer's. `prepare` builds both modes' step through `jtree.training.step_builders.step_builder`
(what the trainer, `jtree.training.run_data`, trains with) for a run whose one step holds the workload's trees: one data
shard, one micro-batch, the fewest rows of S that hold the step (`rows_for_run`), and row lengths
from `data.row_steps_per_octave` = `ROW_STEPS_PER_OCTAVE` (each step packs at the shortest length
of the ladder that fits those rows; `jtree.layout.planner`), so its speedups are the trainer's.

Workloads: synthetic trees with POR 0 / 0.3 / 0.5 / 0.7 / 0.9 at a constant flat-token count and
path length (`jtree.trees.synthetic.por_forest`) on a projection-dominated model (S = 4096) and an
attention-heavy one (S = 16384); agent-rollout trees (`jtree.trees.synthetic.agent_rollout_group`: long
shared system prompt, parallel tool calls, think-mode branches) on both; chat conversations
(`jtree.trees.synthetic.chat_record`) through the chat ingestion path (`jtree.trees.chat`, byte tokenizer).

Step size. A step also pays costs that do not shrink with its tokens (the AdamW update of all
parameters, per-op dispatch, loss set-up): the "fixed s" column times the same step on one 64-token
row, an upper bound of that cost. The FLOP ideal leaves it out, and at high POR the tree step is
small: with fixed cost F and token work T in the baseline step, a 10x ideal can at best realize
(T + F) / (T / 10 + F). Real steps hold 10^5+ tokens, where F vanishes; a bench step must be
small enough for this 2-core CPU. The proj synthetic workloads hold `PROJ_FLAT_TOKENS` = 12288
flat tokens (24 paths of 512; the tree step at POR 0.9 holds 1229 tokens, a baseline step
10-15 s here), twice the first version's 6144, where the fixed cost was 12-35% of the 614-token
tree step at POR 0.9 (efficiency 0.87 there vs 0.99 at 4x the tokens). 4x would keep the
proj workloads alone above 15 minutes here; with 2x, `make bench` took 1423 s at load 6-8
(limit 30 minutes). The count is the same at every POR (the issue's rule), so the baseline step is the same
size across POR and only the tree step shrinks. The attn workloads' steps are 32768 flat tokens
already.

Host memory. XLA:CPU mallocs a step's temporaries (hundreds of MiB) and frees them after it;
glibc maps them fresh every step, so each step page-faults and zeroes all of them again (~0.3 s
per 560 MiB here, a cost of memory, not FLOPs; device allocators cache). The bench therefore
calls `jtree.training.host_allocator.keep_freed_memory` first (`--host-malloc default` to measure without
it) and records each mode's minor page faults per step.

    python -m jtree.launch.bench                 # everything (`make bench`), ~9 min idle here
    python -m jtree.launch.bench --only proj     # workloads whose name contains "proj"
    python -m jtree.launch.bench --attention xla # both modes on the plain-XLA kernel
    python -m jtree.launch.bench --quick         # two tiny workloads (a smoke run)
    python -m jtree.launch.bench --check-auto    # + auto's kernel choice checked

Attention kernel: `cpu` by default (`jtree.kernels.attention.cpu`, the block schedule over all cores);
XLA:CPU runs the `xla` kernel's block loop on one thread, which cost the tree step, with its larger
attention share, more than the baseline (README, "How the last 5% was closed").

`--check-auto` checks `runtime.attention_impl: auto` on every workload: the tree step also runs
with the other CPU kernel (`cpu` and `xla` both, in the same shuffled rounds as the rest), and the
row gets what `auto` resolves to for the step's attention calls (`step_auto_attention`: the
kernels' own rule, `jtree.kernels.tree_attention.resolve_impl`, measured per shape class), the
same-round cpu / xla time ratio with its interval, and whether auto's pick is the faster
(`auto_check`). Off by default: it adds one or two tree steps to every round.

Writes bench_out/bench.json, bench_out/bench.md (the table) and bench_out/bench.png
(`jtree.launch.bench.harness`; `--out` picks the folder).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jtree.config.architectures import Qwen3Config
from jtree.config.objective import Objective, OptimConfig
from jtree.config.runtime import RuntimeConfig
from jtree.kernels.tree_attention import resolve_impl
from jtree.launch.bench.harness import (
    Column,
    CompiledMemory,
    Output,
    Timings,
    add_attention_flag,
    add_host_malloc_flag,
    alternate,
    apply_host_malloc,
    bench_parser,
    figure,
    machine,
    markdown_table,
)
from jtree.launch.bench.workloads import (
    AUTO_MIN_GAIN,
    BATCHES,
    CPU_IMPLS,
    SHAPES,
    Workload,
    block_stats,
    fixed_cost_inputs,
    host_seconds,
    prepare,
    workloads,
)
from jtree.layout.flop_model import FlopModel, choose_mode, ideal_speedup
from jtree.layout.planner import StepPlan
from jtree.models import CausalLM
from jtree.step.optimizer import TrainState, make_optimizer
from jtree.step.train_step import make_train_step
from jtree.training.utilization import (
    device_peak,
    dominant_shape,
    matmul_call,
    model_flops,
    utilization_fields,
)

# ----------------------------------------------------------------------------- measurement


def measure(workload: Workload, step: Callable, state: TrainState, *, min_reps: int,
            max_reps: int, budget_s: float, attention: str = "cpu",
            check_auto: Mapping[str, tuple[Callable, StepLoop]] | None = None
            ) -> tuple[dict[str, Any], TrainState]:
    """One workload: compile both steps (memory from the compiled executables), one warm-up run
    each, then rounds of one tree run, one baseline run and one step on one 64-token row (the
    fixed cost, `fixed_cost_inputs`) in shuffled order (at least `min_reps` rounds, more while
    `budget_s` lasts, at most `max_reps`), then host preparation timed from cold trees.

    `check_auto` (kernel -> its step and state loop, for each of `CPU_IMPLS` that `step`, built
    with the `attention` kernel, is not): the tree step also runs with those kernels in the same
    rounds, and the row gets `auto_check`'s fields."""
    cfg = SHAPES[workload.shape]
    trees = workload.make_trees()
    stats = sum((t.stats() for t in trees[1:]), trees[0].stats())
    prep = {mode: prepare(trees, mode, workload.seq_len) for mode in ("tree", "baseline")}
    fm = FlopModel.for_config(cfg)
    work = {m: p.work for m, p in prep.items()}
    tree_w, base_w = work["tree"], work["baseline"]
    plans = {m: p.plan for m, p in prep.items()}
    choice = choose_mode(fm, trees, tree_tokens=plans["tree"].n_rows * plans["tree"].row_len,
                         baseline_tokens=plans["baseline"].n_rows * plans["baseline"].row_len,
                         min_gain=AUTO_MIN_GAIN)
    prep["fixed"] = fixed_cost_inputs(cfg)
    memory, compile_s, runs, xla_flops = {}, {}, {}, {}
    loop = StepLoop(state)
    for mode in ("tree", "baseline", "fixed"):
        t0 = time.perf_counter()
        compiled = step.lower(state, prep[mode].inputs).compile()
        compile_s[mode] = time.perf_counter() - t0
        memory[mode] = CompiledMemory.of(compiled).peak_bytes
        xla_flops[mode] = xla_cost_flops(compiled)
        runs[mode] = loop.run(compiled, prep[mode].inputs)
    impl_runs: dict[str, str] = {}
    if check_auto is not None:
        for impl in CPU_IMPLS:
            impl_runs[impl] = "tree" if impl == attention else f"tree {impl}"
            if impl != attention:
                other_step, other_loop = check_auto[impl]
                runs[impl_runs[impl]] = other_loop.run(
                    other_step.lower(other_loop.state, prep["tree"].inputs).compile(),
                    prep["tree"].inputs)
    # The ceiling of MFU: a plain matmul at the tree step's dominant shape, timed in the same
    # rounds as the steps (same load on a shared machine).
    matmul = dominant_shape(plans["tree"].n_rows * plans["tree"].row_len, cfg)
    runs["matmul"] = matmul_call(matmul)
    timings = alternate(runs, min_reps, max_rounds=max_reps, budget_s=budget_s)
    times = timings.wall
    host = {mode: host_seconds(workload, mode, 3) for mode in ("tree", "baseline")}
    device = {mode: timings.median(mode) for mode in times}
    # Each ratio compares a tree run with the baseline run of the same round (same load on a
    # shared machine); their median is the realized speedup (the ratio of the medians is kept too).
    pair_ratios = timings.ratios("baseline", "tree")
    realized = timings.ratio("baseline", "tree")
    realized_cpu = timings.ratio("baseline", "tree", cpu=True)
    ideal = ideal_speedup(fm, tree_w, base_w)
    fixed = device["fixed"]
    peak = device_peak("float32")
    row = {
        "workload": workload.name, "shape": workload.shape, "seq_len": workload.seq_len,
        "n_trees": len(trees), "n_paths": stats.n_paths, "por": stats.por,
        "n_flat_tokens": base_w.tokens, "n_computed_tokens": tree_w.tokens,
        "token_bound": base_w.tokens / tree_w.tokens, "ideal_speedup": ideal,
        "realized_speedup": realized, "efficiency": realized / ideal,
        "ratio_of_medians": device["baseline"] / device["tree"],
        "ratio_spread": [float(pair_ratios.min()), float(pair_ratios.max())],
        "realized_speedup_cpu_time": realized_cpu, "efficiency_cpu_time": realized_cpu / ideal,
        "fixed_s": fixed, "fixed_times_s": times["fixed"],
        "fixed_share_tree": fixed / device["tree"],
        "repeats": timings.rounds,
        "flop_shares_tree": fm.shares(tree_w), "flop_shares_baseline": fm.shares(base_w),
        "auto_mode": choice.mode, "auto_predicted_gain": choice.predicted_gain,
        "auto_reason": choice.reason,
        "matmul_shape": dataclasses.asdict(matmul),
        "matmul_flops_per_s": matmul.flops / device["matmul"],
        "matmul_times_s": times["matmul"], "peak_flops_per_s": peak,
    }
    if check_auto is not None:
        row.update(auto_check(timings, step_auto_attention(cfg, plans["tree"]), impl_runs))
    for mode, key in (("tree", "tree"), ("baseline", "base")):
        p, w = plans[mode], work[mode]
        blocks = block_stats(list(prep[mode].end), w)
        row.update({
            f"{key}_device_s": device[mode], f"{key}_host_s": host[mode],
            f"{key}_host_fraction": host[mode] / (host[mode] + device[mode]),
            f"{key}_host_tokens_per_s": w.tokens / host[mode],
            f"{key}_rows": p.n_rows, f"{key}_row_len": p.row_len,
            f"{key}_padding": p.padding_fraction,
            f"{key}_scored": w.scored, f"{key}_pairs": w.pairs,
            f"{key}_peak_mib": memory[mode] / 2**20, f"{key}_compile_s": compile_s[mode],
            f"{key}_times_s": times[mode], f"{key}_cpu_s": timings.cpu[mode],
            f"{key}_minor_faults": int(np.median(timings.faults[mode])),
            **{f"{key}_{k}": v for k, v in blocks.items()},
            **utilization_fields(key, model_flops(fm, w), times[mode], matmul, times["matmul"],
                                 peak, xla_flops[mode]),
        })
    return row, loop.state


def step_auto_attention(cfg: Qwen3Config, plan: StepPlan, dtype: Any = np.float32) -> str:
    """What `auto` runs on CPU in the attention calls of a step laid out by `plan`: each call
    holds one micro-batch, q [plan.rows, plan.row_len, q heads, head_dim]
    (`jtree.models.attention`), resolved by the kernels' own rule (`resolve_impl`: measured once
    per shape class and machine, logged, stored), so the bench names the call's shape and
    nothing else. For a measurement in the same run, start with an empty decision store
    (`JTREE_ATTENTION_CALIBRATION_DIR` pointed at a new directory)."""
    return resolve_impl("auto", "cpu", dtype=dtype, head_dim=cfg.head_dim,
                        shape=(plan.rows, plan.row_len, cfg.num_attention_heads,
                               cfg.num_key_value_heads))


def auto_check(timings: Timings, auto: str, runs: Mapping[str, str]) -> dict[str, Any]:
    """`auto`'s pick against the same step timed with each of `CPU_IMPLS` in the same rounds
    (`runs`: kernel -> its variant in `timings`): the median same-round cpu / xla time ratio
    with its bootstrap interval, the faster kernel by that ratio, whether `auto` picked it, and
    the verdict: "parity" when the interval holds 1 (the rounds cannot tell the kernels apart,
    so either pick is as fast), else which kernel is faster beyond noise."""
    cpu, xla = runs["cpu"], runs["xla"]
    ratio = timings.ratio(cpu, xla)
    faster = "cpu" if ratio < 1 else "xla"
    verdict = timings.compare(cpu, xla)  # "faster": xla is; "slower": cpu is
    return {"auto_attention": auto, "cpu_over_xla": ratio,
            "cpu_over_xla_interval": list(timings.ratio_interval(cpu, xla)),
            "faster_attention": faster, "auto_attention_is_faster": auto == faster,
            "attention_verdict": {"faster": "xla faster", "slower": "cpu faster"}.get(
                verdict, "parity")}


def xla_cost_flops(compiled: Any) -> float | None:
    """XLA's own FLOP count of a compiled step (its cost analysis; None where the backend gives
    none). It counts what the program does, padding and every computed attention block included
    (a loop body once, whatever its trip count), so it is context for the model FLOPs, not MFU's
    numerator."""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - some backends raise for programs they cannot cost
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    flops = (cost or {}).get("flops")
    return None if flops is None else float(flops)


class StepLoop:
    """Runs compiled train steps that donate their state, carrying the updated state from one
    call to the next (whatever step ran last)."""

    def __init__(self, state: TrainState):
        self.state = state

    def run(self, compiled: Callable, inputs: dict[str, jax.Array]) -> Callable[[], Any]:
        """A call of `compiled` on `inputs` and the current state; returns the step's metrics."""
        def call() -> Any:
            self.state, metrics = compiled(self.state, inputs)
            return metrics
        return call


def make_step(cfg: Qwen3Config, attention: str, *, objective: Objective = Objective(),
              **runtime: Any) -> tuple[Callable, TrainState]:
    """The jitted train step of `cfg`'s model with the `attention` kernel (both modes use it);
    `runtime` sets the other `RuntimeConfig` fields (e.g. a device's bf16 compute)."""
    model = CausalLM(cfg, RuntimeConfig(attention_impl=attention, **runtime), rngs=nnx.Rngs(0))
    return step_of(model, objective)


def step_of(model: CausalLM, objective: Objective = Objective()) -> tuple[Callable, TrainState]:
    """The jitted train step (AdamW, learning rate 1e-4, donated state) of `model` and its
    initial state."""
    graphdef, params = nnx.split(model)
    optimizer = make_optimizer(OptimConfig(learning_rate=1e-4))
    state = TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32))
    step = jax.jit(make_train_step(graphdef, optimizer, objective), donate_argnums=0)
    return step, state


# ----------------------------------------------------------------------------- reporting

COLUMNS = (
    Column("workload", "workload"), Column("POR", "por", "{:.2f}"),
    Column("ideal", "ideal_speedup", "{:.2f}"), Column("token bound", "token_bound", "{:.2f}"),
    Column("realized", "realized_speedup", "{:.2f}"),
    Column("run-pair range", "ratio_spread", "{0[0]:.2f}-{0[1]:.2f}"),
    Column("efficiency", "efficiency", "{:.2f}"),
    Column("efficiency (CPU time)", "efficiency_cpu_time", "{:.2f}"),
    Column("tree s", "tree_device_s", "{:.2f}"), Column("baseline s", "base_device_s", "{:.2f}"),
    Column("fixed s", "fixed_s", "{:.3f}"), Column("fixed / tree", "fixed_share_tree", "{:.1%}"),
    Column("tree host", "tree_host_fraction", "{:.1%}"),
    Column("base host", "base_host_fraction", "{:.1%}"),
    Column("tree pad", "tree_padding", "{:.1%}"), Column("base pad", "base_padding", "{:.1%}"),
    Column("tree MiB", "tree_peak_mib", "{:.0f}"), Column("base MiB", "base_peak_mib", "{:.0f}"),
    Column("auto", "auto_mode"),
    Column("tree GFLOP/s", "tree_flops_per_s", cell=lambda r: f"{r['tree_flops_per_s'] / 1e9:.1f}"),
    Column("matmul GFLOP/s", "matmul_flops_per_s",
           cell=lambda r: f"{r['matmul_flops_per_s'] / 1e9:.1f}"),
    Column("tree MFU", "tree_mfu", "{:.1%}"), Column("base MFU", "base_mfu", "{:.1%}"),
    Column("tree MFU (peak)", "tree_mfu_peak", "{:.1%}"),
)


# --check-auto's columns: auto's kernel, the same-round cpu / xla step time, whether auto's pick
# is the faster (and whether the rounds tell the two apart at all).
AUTO_COLUMNS = (
    Column("auto attention", "auto_attention"),
    Column("cpu / xla", "cpu_over_xla", "{:.2f}"),
    Column("cpu / xla 95%", "cpu_over_xla_interval", "{0[0]:.2f}-{0[1]:.2f}"),
    Column("auto's pick faster", "", cell=lambda r: (
        "yes" if r["auto_attention_is_faster"] else "no") + f" ({r['attention_verdict']})"),
)


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The bench's table; with `--check-auto`'s columns when its rows have them."""
    checked = any("auto_attention" in r for r in rows)
    return markdown_table(rows, COLUMNS + (AUTO_COLUMNS if checked else ()))


def plot(rows: Sequence[dict[str, Any]]) -> Any:
    """Realized speedups (and the FLOP ideal of the synthetic workloads) against POR."""
    fig, ax = figure(1, (7.5, 5))
    por = np.linspace(0, 0.92, 200)
    ax.plot(por, 1 / (1 - por), color="0.6", ls="--", label="token bound 1/(1-POR)")
    styles = zip(("tab:blue", "tab:red", "tab:green"), ("o", "s", "^"))
    for shape, (color, marker) in zip(SHAPES, styles):
        sel = sorted((r for r in rows if r["shape"] == shape), key=lambda r: r["por"])
        if not sel:
            continue
        synth = [r for r in sel if "synthetic" in r["workload"]]
        if synth:
            ax.plot([r["por"] for r in synth], [r["ideal_speedup"] for r in synth], color=color,
                    lw=1, label=f"{shape}: ideal (FLOPs)")
        ax.scatter([r["por"] for r in sel], [r["realized_speedup"] for r in sel], color=color,
                   marker=marker, zorder=3, label=f"{shape}: realized")
        for r in sel:
            if "synthetic" not in r["workload"]:
                ax.annotate(r["workload"].split("/")[1], (r["por"], r["realized_speedup"]),
                            textcoords="offset points", xytext=(5, -10), fontsize=8)
    ax.set_xlabel("POR (fraction of flat tokens that are shared repeats)")
    ax.set_ylabel("speedup over the per-branch baseline")
    ax.set_title("jtree tree vs baseline training step (CPU, medians of alternating runs)")
    ax.set_yscale("log")
    ax.set_yticks([1, 2, 3, 5, 10])
    ax.set_yticklabels(["1", "2", "3", "5", "10"])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def write(out: Path, info: str, rows: Sequence[dict[str, Any]], wall: float) -> list[Path]:
    """out/bench.json (rows, machine, model shapes), out/bench.md (the table), out/bench.png."""
    return Output(out, "bench").write(
        {"machine": info, "wall_s": wall, "rows": rows,
         "shapes": {k: dataclasses.asdict(v) for k, v in SHAPES.items()}},
        table=f"machine: {info}; wall {wall:.0f} s\n\n{table(rows)}", fig=plot(rows), dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench_parser(__doc__, repeats=None,
                          quick="two tiny workloads, one timed round each (a smoke run)")
    parser.add_argument("--only", default="", help="run workloads whose name contains this")
    parser.add_argument("--min-reps", type=int, default=4)
    parser.add_argument("--max-reps", type=int, default=7)
    parser.add_argument("--budget", type=float, default=20.0,
                        help="seconds of alternating runs per workload after the minimum")
    parser.add_argument("--total-budget", type=float, default=1200.0,
                        help="seconds for the whole run: later workloads get fewer repeats "
                             "(never below --min-reps) when earlier ones ran long")
    parser.add_argument("--check-auto", action="store_true",
                        help="also time the tree step with both CPU attention kernels in the "
                             "same rounds and report whether auto's choice is the faster")
    add_host_malloc_flag(parser)
    add_attention_flag(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.min_reps, args.max_reps, args.budget = 1, 1, 0.0
    kept = apply_host_malloc(args)
    if args.check_auto:  # the calibration's line: what `auto` measured and chose, per class
        logging.basicConfig(format="%(message)s")
        logging.getLogger("jtree.kernels.tree_attention").setLevel(logging.INFO)
    out = Path(args.out)
    info = (f"{machine()}, host malloc {'keeps freed memory' if kept else 'default'}, "
            f"attention kernel {args.attention}; {BATCHES}")
    print(f"machine: {info}", flush=True)
    steps: dict[str, tuple[Callable, TrainState]] = {}
    others: dict[str, dict[str, tuple[Callable, StepLoop]]] = {}  # --check-auto's kernels
    rows = []
    t_all = time.perf_counter()
    chosen = [w for w in workloads(args.quick) if args.only in w.name]
    for i, w in enumerate(chosen):
        if w.shape not in steps:
            steps[w.shape] = make_step(SHAPES[w.shape], args.attention)
            if args.check_auto:
                others[w.shape] = {}
                for impl in CPU_IMPLS:
                    if impl != args.attention:
                        other_step, other_state = make_step(SHAPES[w.shape], impl)
                        others[w.shape][impl] = (other_step, StepLoop(other_state))
        step, state = steps[w.shape]
        t0 = time.perf_counter()
        left = args.total_budget - (time.perf_counter() - t_all)
        budget = min(args.budget, max(0.0, left / (len(chosen) - i) - 30.0))
        row, state = measure(w, step, state, min_reps=args.min_reps, max_reps=args.max_reps,
                             budget_s=budget, attention=args.attention,
                             check_auto=others.get(w.shape))
        steps[w.shape] = (step, state)
        rows.append(row)
        print(f"{w.name}: POR {row['por']:.2f}, ideal {row['ideal_speedup']:.2f}x, realized "
              f"{row['realized_speedup']:.2f}x (pairs {row['ratio_spread'][0]:.2f}-"
              f"{row['ratio_spread'][1]:.2f}, {row['repeats']} reps), efficiency "
              f"{row['efficiency']:.2f}; tree {row['tree_device_s']:.2f} s, baseline "
              f"{row['base_device_s']:.2f} s; MFU tree {row['tree_mfu']:.1%}, baseline "
              f"{row['base_mfu']:.1%} of a matmul at "
              f"{row['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s; auto: {row['auto_reason']}"
              + (f"; auto attention {row['auto_attention']}, cpu / xla "
                 f"{row['cpu_over_xla']:.2f} ({row['attention_verdict']})"
                 if args.check_auto else "")
              + f" [{time.perf_counter() - t0:.0f} s]", flush=True)
        written = write(out, info, rows, time.perf_counter() - t_all)  # after every workload
    print(table(rows))
    print(f"wrote {', '.join(map(str, written))} ({time.perf_counter() - t_all:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
