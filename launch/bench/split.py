"""Where a bench workload's step time goes: attention vs everything else, tree vs baseline.

`jtree.launch.bench` reports efficiency = realized / ideal speedup, with the ideal from FLOPs. When it
falls short, this splits each mode's step time: the attention kernel's forward + backward alone
(the same kernel, `--attention cpu|xla`, on the same `end` layouts, one micro-batch at a time as the step scans them,
times the model's layer count) and the rest (projections, MLP, norms, loss, optimizer), and the step's fixed cost: the same
step on one 64-token row (optimizer update, gradient buffers; what does not shrink with the
tokens). Comparing each part's baseline/tree time ratio with its FLOP ratio shows which part runs below its FLOP rate
in one mode (a timing breakdown, not a trace; same process, alternating runs, medians).

    python -m jtree.launch.bench.split "proj/synthetic POR 0.3"
    python -m jtree.launch.bench.split "proj/synthetic POR 0.9" --ops   # + XLA op kinds

`--ops` also traces each step with the JAX profiler and sums the XLA:CPU thunks' time by op kind
(fusion names without their numbers: `ynn_fusion` = matmuls and reductions, `multiply_add_fusion`
= mostly the AdamW moment and parameter updates, `copy_bitcast_fusion` = layout copies), per step:
what a step spends its time on, e.g. the fixed step's optimizer share.

Writes bench_out/bench_split.json and .md (`jtree.launch.bench.harness`; `--out` picks the folder).
`--quick` runs on the bench's tiny quick workloads (a smoke run).
"""

from __future__ import annotations

import collections
import re
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jtree.config.architectures import Qwen3Config
from jtree.kernels import TreeMask, tree_attention
from jtree.launch.bench.harness import (
    Output,
    add_attention_flag,
    add_host_malloc_flag,
    alternate,
    apply_host_malloc,
    bench_parser,
    run_info,
)
from jtree.launch.bench.step import StepLoop, make_step
from jtree.launch.bench.workloads import SHAPES, fixed_cost_inputs, prepare, workloads
from jtree.layout.flop_model import FlopModel
from jtree.training.utilization import dominant_shape, matmul_call, mfu_from_rounds, model_flops


def attention_grad_fn(end: np.ndarray, cfg: Qwen3Config, attention: str) -> Callable:
    """A compiled fwd+bwd of the model's tree attention kernel over micro-batches `end`
    [M, rows, S] (scanned like the train step scans them) with the `attention` kernel, and its
    inputs."""
    m, rows, s = end.shape
    q = jax.random.normal(jax.random.key(0), (m, rows, s, cfg.num_attention_heads, cfg.head_dim))
    k = jax.random.normal(jax.random.key(1), (m, rows, s, cfg.num_key_value_heads, cfg.head_dim))

    def loss(q, k, v, end):
        def body(total, x):
            q, k, v, end = x
            out = tree_attention(q, k, v, TreeMask(end), impl=attention)
            return total + jnp.sum(out ** 2), None
        return jax.lax.scan(body, 0.0, (q, k, v, end))[0]

    args = (q, k, k, jnp.asarray(end))
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    return lambda: compiled(*args)


def op_profile(run: Callable[[], Any], repeats: int) -> dict[str, tuple[float, float]]:
    """Seconds and thunk count per step of each XLA op kind over `repeats` traced calls of `run`
    (already warm). Sums the events of XLA's CPU worker threads; `while` thunks are left out
    (their bodies' ops are counted), so the total is op time, not wall time."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(repeats):
                jax.block_until_ready(run())
        files = sorted(Path(d).rglob("*.xplane.pb"))
        data = jax.profiler.ProfileData.from_file(str(files[-1]))
    seconds: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLA"):
                continue
            for event in line.events:
                kind = re.sub(r"\.\d+$", "", event.name)
                if kind == "while" or kind.startswith("end: ") or "::" in kind:
                    continue  # loops (bodies counted), thread-pool and executor markers
                seconds[kind] += event.duration_ns * 1e-9 / repeats
                counts[kind] += 1 / repeats
    return {k: (v, counts[k]) for k, v in seconds.most_common()}


def split(name: str, repeats: int, ops: bool = False, attention: str = "cpu",
          quick: bool = False) -> dict[str, Any]:
    """Median seconds of the attention part and the whole step, per mode, alternating.
    `quick`: `name` is one of the bench's quick workloads."""
    workload = next((w for w in workloads(quick) if w.name == name), None)
    if workload is None:
        raise ValueError(f"workload: no bench workload named {name!r}; the bench's workloads: "
                         + ", ".join(repr(w.name) for w in workloads(quick)))
    cfg = SHAPES[workload.shape]
    trees = workload.make_trees()
    step, state = make_step(cfg, attention)
    runs, work, positions = {}, {}, {}
    loop = StepLoop(state)
    for mode in ("tree", "baseline"):
        p = prepare(trees, mode, workload.seq_len)
        work[mode] = p.work
        positions[mode] = p.plan.n_rows * p.plan.row_len
        runs[f"{mode} attention"] = attention_grad_fn(p.end, cfg, attention)
        compiled = step.lower(state, p.inputs).compile()
        runs[f"{mode} step"] = loop.run(compiled, p.inputs)
    tiny = fixed_cost_inputs(cfg)
    runs["fixed"] = loop.run(step.lower(state, tiny.inputs).compile(), tiny.inputs)
    matmul = dominant_shape(positions["tree"], cfg)  # MFU's ceiling, timed in the same rounds
    runs["matmul"] = matmul_call(matmul)
    timings = alternate(runs, repeats)
    med = {k: timings.median(k) for k in runs}
    fm = FlopModel.for_config(cfg)
    out: dict[str, Any] = {"fixed_s": med["fixed"], "matmul_shape": matmul.describe(),
                           "matmul_flops_per_s": matmul.flops / med["matmul"]}
    if ops:
        out["ops"] = {k: op_profile(runs[k], repeats) for k in ("tree step", "baseline step",
                                                                  "fixed")}
    for mode in ("tree", "baseline"):
        attn = med[f"{mode} attention"] * cfg.num_hidden_layers
        out[f"{mode}_attention_s"], out[f"{mode}_step_s"] = attn, med[f"{mode} step"]
        out[f"{mode}_rest_s"] = med[f"{mode} step"] - attn
        w = work[mode]
        out[f"{mode}_attention_flops"] = fm.per_pair * w.pairs
        out[f"{mode}_rest_flops"] = fm.per_token * w.tokens + fm.per_scored * w.scored
        out[f"{mode}_model_flops"] = model_flops(fm, w)
        out[f"{mode}_mfu"] = mfu_from_rounds(model_flops(fm, w), timings.wall[f"{mode} step"],
                                             matmul, timings.wall["matmul"])
    return out


def report(name: str, s: dict[str, float]) -> str:
    lines = [f"{name}", "| part | tree s | baseline s | time ratio base/tree | FLOP ratio base/tree |"
             " tree share of step |", "| --- | --- | --- | --- | --- | --- |"]
    for part in ("attention", "rest"):
        t, b = s[f"tree_{part}_s"], s[f"baseline_{part}_s"]
        flops = s[f"baseline_{part}_flops"] / s[f"tree_{part}_flops"]
        lines.append(f"| {part} | {t:.2f} | {b:.2f} | {b / t:.2f} | {flops:.2f} | "
                     f"{t / s['tree_step_s']:.0%} |")
    t, b = s["tree_step_s"], s["baseline_step_s"]
    total = (s["baseline_attention_flops"] + s["baseline_rest_flops"]) / \
        (s["tree_attention_flops"] + s["tree_rest_flops"])
    lines.append(f"| step | {t:.2f} | {b:.2f} | {b / t:.2f} | {total:.2f} | 100% |")
    f = s["fixed_s"]
    lines.append(f"| fixed (step on one 64-token row) | {f:.2f} | {f:.2f} | | | {f / t:.0%} |")
    lines.append(f"step minus fixed: base/tree {(b - f) / (t - f):.2f} vs FLOP ratio {total:.2f}")
    lines.append(f"MFU (model FLOP/s over a plain matmul {s['matmul_shape']} at "
                 f"{s['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s, same rounds): tree "
                 f"{s['tree_mfu']:.1%}, baseline {s['baseline_mfu']:.1%}")
    lines += [ops_line(step, kinds) for step, kinds in s.get("ops", {}).items()]
    return "\n".join(lines)


def ops_line(label: str, kinds: dict[str, tuple[float, float]], top: int = 8) -> str:
    """One line of an `op_profile`: the total op time and the `top` kinds with their time, share
    and thunk count per step."""
    total = sum(v for v, _ in kinds.values())
    return f"{label}: XLA op time {total * 1e3:.1f} ms per step, by kind: " + ", ".join(
        f"{k} {v * 1e3:.1f} ms ({v / total:.0%}, x{n:.0f})" for k, (v, n) in
        list(kinds.items())[:top])


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench_parser(__doc__, repeats=3, quick="the bench's quick workloads (tiny model); "
                          "with no workload named, the first of them")
    parser.add_argument("workloads", nargs="*", help="bench workload names (jtree.launch.bench)")
    parser.add_argument("--ops", action="store_true", help="also XLA op time by kind (profiler)")
    add_host_malloc_flag(parser)
    add_attention_flag(parser)
    args = parser.parse_args(argv)
    if not args.workloads:
        if not args.quick:
            parser.error("name at least one workload (or --quick)")
        args.workloads = [workloads(quick=True)[0].name]
    apply_host_malloc(args)  # before the first computation, as in jtree.launch.bench
    splits, reports = {}, []
    for name in args.workloads:
        splits[name] = split(name, args.repeats, args.ops, args.attention, args.quick)
        reports.append(report(name, splits[name]))
        print(reports[-1], flush=True)
    written = Output.from_args(args, "bench_split").write(
        {**run_info(args), "splits": splits}, table="\n\n".join(reports))
    print(f"wrote {', '.join(map(str, written))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
