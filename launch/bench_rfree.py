"""Benchmark redundancy-free partitioning: `python -m jtree.launch.bench_rfree`.

On agent-rollout trees 2-8x larger than the capacity C (rows of at most C tokens, one row per
device call or micro-batch), one SFT training step (loss and gradients) of a small dense Qwen3
three ways, measured side by side in one process (compile excluded, alternating rounds; a
speedup is the median over rounds of the baseline's time / the method's time in that round):

- `baseline`: every path a separate sequence, packed into rows of C tokens, micro-batches scanned;
- `duplicating`: the tree cut by the `jtree.partition` heuristic, each part holding its whole
  prefix (N_computed > N_tree), parts packed into rows of C tokens, micro-batches scanned;
- `rfree`: `jtree.rfree` parts of at most C tokens over cached prefixes (N_computed == N_tree),
  each in a row fitted to its tokens (`jtree.rfree.layout.row_length`), run part by part
  (`RedundancyFreeStep`), the prefix backward from saved residuals;
- `rfree_recompute`: the same, recomputing a part's forward for its backward (less memory held
  while its children run, one more forward per part with children);
- `rfree_auto`: residuals for parts whose children are all leaf parts, recompute above.

Parts run in post-order (`jtree.rfree.schedule`). Memory, two measures of real buffer bytes (the
CPU backend has no device memory statistics):
- `peak_bytes`: the peak over the step's device calls of (bytes of every live jax.Array in the
  process at the call, `jax.live_arrays()`, + the called executable's temporary bytes from XLA's
  memory analysis); for the scanned steps that is one call. Comparable across all methods.
- `held_bytes` (rfree only): the peak of what the executor itself holds between calls (residuals,
  outputs, prefixes, cotangent accumulators; `RedundancyFreeStep.live`), without parameters,
  gradients and temporaries.
Also reports the first step's time (compiles included) and checks that the losses agree.

Bounds. The issue's target is the token bound N_flat / N_tree; the FLOP ideal (`jtree.cost`, as
`jtree.launch.bench` reports it) is lower when attention matters, because sharing saves tokens but a
branch's queries still see every shared key (docs/design.md section 8). The model's MLP is 4x its
width by default (`--mlp-ratio`), the usual LLM proportion, so attention is ~10% of its FLOPs as
in a real model at these lengths; both bounds are printed.

Like `jtree.launch.bench`, it first makes glibc keep freed host memory (`jtree.host_allocator`; every
method's calls otherwise page-fault their temporaries again on each run).

Writes bench_out/rfree.json and bench_out/rfree.png (or --out PREFIX).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import numpy as np
from flax import nnx

from jtree.baseline import flatten_paths
from jtree.cost import FlopModel, ideal_speedup, tree_work
from jtree.loss import batch_normalizer
from jtree.models import Qwen3, Qwen3Config
from jtree.packing import build_microbatches
from jtree.partition import partition
from jtree.rfree.execute import RedundancyFreeStep
from jtree.rfree.layout import ROW_STEPS_PER_OCTAVE, build_program
from jtree.synthetic import AgentShape, agent_rollout_group
from jtree.train_step import Objective, make_grad_fn
from jtree.tree import TrajectoryTree
from jtree.launch.bench import add_host_malloc_flag, apply_host_malloc

OBJECTIVE = Objective(kind="sft", normalization="seq_mean_token_mean")
RFREE_MODES = {"rfree": "residuals", "rfree_recompute": "recompute", "rfree_auto": "auto"}


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
    mem = fn.lower(*args).compile().memory_analysis()
    return int(getattr(mem, "temp_size_in_bytes", 0) or 0)


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
               flops: FlopModel, row_steps_per_octave: int = ROW_STEPS_PER_OCTAVE) -> dict:
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
    losses, first_s = {}, {}
    for name, run in runs.items():
        t0 = time.perf_counter()
        losses[name] = float(jax.block_until_ready(run())[0])
        first_s[name] = time.perf_counter() - t0
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            times[name].append(time.perf_counter() - t0)
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
    ms = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
    return {
        "n_tree": stats.n_tree_tokens, "n_flat": stats.n_flat_tokens,
        "ratio": stats.n_tree_tokens / capacity, "paths": stats.n_paths,
        "n_computed": {"baseline": stats.n_flat_tokens,
                       "duplicating": int(sum(p.n_tree_tokens for p in dup_parts)),
                       **{name: program.n_computed for name in RFREE_MODES}},
        "calls": {"baseline": int(base["tokens"].shape[0]),
                  "duplicating": int(dup["tokens"].shape[0]),
                  **{name: len(program.parts) for name in RFREE_MODES}},
        "part_shapes": len(part_shapes), "prefix_lengths": sorted(
            {p.prefix_len for p in program.parts}),
        "ms": ms, "first_step_s": first_s, "peak_bytes": memory, "held_bytes": held,
        "loss": losses,
        # Each run is paired with the baseline run of the same round (alternating runs see the
        # same load on a shared machine): the median of those ratios.
        "speedup_vs_baseline": {k: float(np.median(np.asarray(times["baseline"])
                                                   / np.asarray(times[k])))
                                for k in ms if k != "baseline"},
        "times_s": times,
        "token_bound": stats.n_flat_tokens / stats.n_tree_tokens,
        "flop_ideal": ideal_speedup(flops, tree_w, base_w),
        "row_slots": {"baseline": int(base["tokens"].size), "duplicating": int(dup["tokens"].size),
                      "rfree": int(sum(p.inputs.tokens.size for p in program.parts))},
    }


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = report["cases"]
    x = [c["ratio"] for c in cases]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
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
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--capacity", type=int, default=256)
    ap.add_argument("--ratios", default="2,4,6,8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--mlp-ratio", type=int, default=4, help="intermediate size / hidden size")
    ap.add_argument("--attention", default="xla")
    ap.add_argument("--row-steps-per-octave", type=int, default=ROW_STEPS_PER_OCTAVE,
                    help="how finely rfree part rows fit their tokens (jtree.rfree.layout)")
    ap.add_argument("--out", default="bench_out/rfree")
    add_host_malloc_flag(ap)
    args = ap.parse_args()
    kept = apply_host_malloc(args)
    cfg = Qwen3Config(vocab_size=512, hidden_size=args.hidden,
                      intermediate_size=args.mlp_ratio * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=args.hidden // 4,
                      tie_word_embeddings=False, attention_impl=args.attention)
    graphdef, params = nnx.split(Qwen3(cfg, rngs=nnx.Rngs(0)))
    flops = FlopModel.for_config(cfg)
    cases = []
    names = ["baseline", "duplicating", *RFREE_MODES]
    print(f"{'ratio':>5} {'N_tree':>7} {'N_flat':>7} {'N_comp dup':>10} {'parts':>5} "
          f"{'shapes':>6} | ms " + "/".join(names) + " | peak MiB (same order) | rfree held MiB "
          "r/rc/auto | speedup vs baseline " + "/".join(names[1:]) + " | token bound | FLOP ideal "
          "| speedup / token bound r/rc/auto")
    for i, ratio in enumerate(float(r) for r in args.ratios.split(",")):
        tree = pick_tree(ratio, args.capacity, seed=i)
        c = bench_tree(tree, args.capacity, graphdef, params, args.repeats, flops,
                       args.row_steps_per_octave)
        cases.append(c)
        mib = {k: v / 2**20 for k, v in c["peak_bytes"].items()}
        held = {k: v / 2**20 for k, v in c["held_bytes"].items()}
        print(f"{c['ratio']:5.1f} {c['n_tree']:7d} {c['n_flat']:7d} "
              f"{c['n_computed']['duplicating']:10d} {c['calls']['rfree']:5d} "
              f"{c['part_shapes']:6d} | " + "/".join(f"{c['ms'][n]:.0f}" for n in names)
              + " | " + "/".join(f"{mib[n]:.1f}" for n in names) + " | "
              + "/".join(f"{held[n]:.1f}" for n in RFREE_MODES) + " | "
              + "/".join(f"{c['speedup_vs_baseline'][n]:.2f}" for n in names[1:])
              + f" | {c['token_bound']:.2f} | {c['flop_ideal']:.2f} | "
              + "/".join(f"{c['speedup_vs_baseline'][n] / c['token_bound']:.2f}"
                         for n in RFREE_MODES))
        losses = list(c["loss"].values())
        if max(losses) - min(losses) > 1e-4 * abs(losses[0]):
            raise AssertionError(f"losses disagree: {c['loss']}")
    report = {"capacity": args.capacity, "row_steps_per_octave": args.row_steps_per_octave,
              "model": dict(hidden=args.hidden, layers=args.layers, mlp_ratio=args.mlp_ratio,
                            attention=args.attention),
              "host_malloc_keeps_freed_memory": kept,
              "backend": jax.default_backend(), "cases": cases}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    plot(report, args.out + ".png")
    print(f"wrote {args.out}.json and {args.out}.png")


if __name__ == "__main__":
    main()
