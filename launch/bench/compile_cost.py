"""Tree step vs per-path baseline step, estimated by XLA:TPU's cost model (no TPU needed):

    python -m jtree.launch.bench.compile_cost [--config configs/qwen3_0.6b.yaml] [--target T]

The bench's agent workload (`jtree.launch.bench.workloads`, "attn/agent": a 2000-token system
prompt, 6 rollouts of 3 turns) is laid out by the trainer's builder in both modes; each mode's
step is compiled for the target with the config's model at that layout's rows and row length,
one micro-batch, and the compiler's `cost_analysis()` read (flops, bytes accessed,
`optimal_seconds`: XLA:TPU's own roofline of the step). Three corrections make its figures the
step's rather than a fragment's:

- XLA's analysis counts a loop body once (the layer scan, the micro-batch scan, the vocabulary
  chunks of the loss). So the layers are unrolled (`runtime.scan_layers=false`), one micro-batch
  is compiled, the loss takes one vocabulary chunk, and the step is compiled at 1 and 2 layers:
  cost(L) = a + b L, extrapolated to the config's depth (a compile at full depth unrolled would
  take far longer here, and is linear in L for a repeated layer).
- A custom call (the `pallas_tpu` attention kernels) costs nothing in that analysis. The kernels'
  FLOPs are added from the block tables they run: non-empty 128 x 128 blocks of the layout, priced
  per pair by `jtree.layout.flop_model` (forward and backward passes); their time as those FLOPs
  at the chip's datasheet peak (a lower bound: a kernel never runs faster).
- The step's useful FLOPs (for the MFU bound) are the flop model's, padding excluded.

Estimated step time = optimal_seconds + kernel FLOPs / peak; speedup = baseline / tree; MFU bound
= useful tree FLOPs / (time x peak). These are compiler estimates, not measurements: no step ran.
Each compile is of one device's step (every device runs the same layout under data parallelism).
Runs as a worker of `jtree.launch.compile.in_worker`; writes runs/aot/cost_CONFIG_TARGET.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jtree.launch.compile import TARGETS, WORKER_ENV, Target, in_worker

BLOCK = 128  # the pallas_tpu kernels' default block (kernels/attention/tpu.py)
WORKLOAD = "attn/agent"
DEPTHS = (1, 2)
ONE_CHUNK = 1 << 24  # objective.logprob_chunk: every scored token in one chunk of the loss


def kernel_pairs(end: Any) -> int:
    """Pairs the block-sparse kernels compute: the non-empty BLOCK x BLOCK blocks of every
    [rows, S] micro-batch of `end` [micro_batches, rows, S], padded as the dispatch pads."""
    import numpy as np

    from jtree.kernels.block_tables import EMPTY, classify_blocks, round_up_to_blocks

    blocks = 0
    for mb in end:
        s = round_up_to_blocks(mb.shape[1], BLOCK, BLOCK)
        pad = np.arange(mb.shape[1], s, dtype=np.int32)[None].repeat(mb.shape[0], 0) + 1
        classes = classify_blocks(np.concatenate([mb, pad], axis=1), BLOCK, BLOCK)
        blocks += int((classes != EMPTY).sum())
    return blocks * BLOCK * BLOCK


def step_cost(config: str, overrides: Sequence[str], rows: int, target: Target,
              devices: list) -> dict[str, float]:
    """`jtree.launch.compile`'s step, compiled for `target`'s `devices`; its cost analysis per
    device."""
    from jtree.config import load_config
    from jtree.launch.compile import cost, target_overrides
    from jtree.memory.step_shapes import abstract_step_args
    from jtree.training.trainer import Trainer

    cfg = load_config(config, target_overrides(config, overrides, target, devices[0]))
    trainer = Trainer.build(cfg, devices=devices)
    state, inputs = abstract_step_args(trainer, rows)
    analysis = cost(trainer.step_fn.lower(state, inputs).compile().cost_analysis())
    if analysis is None:
        raise SystemExit("this compiler gives no cost analysis (XLA:GPU does not)")
    return analysis


def mode_estimate(config: str, overrides: Sequence[str], mode: str, workload: Any,
                  target: Target, devices: list, peak: float) -> dict[str, Any]:
    """One mode's layout, its step's cost at full depth and the estimated step time."""
    from jtree.config import load_config
    from jtree.launch.bench.workloads import prepare
    from jtree.layout.flop_model import FlopModel, Work

    model_cfg = load_config(config, overrides).model.config
    prepared = prepare(workload.make_trees(), mode, workload.seq_len)
    plan = prepared.plan
    base = [*overrides, f"data.seq_len={plan.row_len}", "data.micro_batches=1",
            "runtime.scan_layers=false", f"objective.logprob_chunk={ONE_CHUNK}"]
    at = {n: step_cost(config, [*base, f"model.num_hidden_layers={n}"], plan.rows, target, devices)
          for n in DEPTHS}
    layers = model_cfg.num_hidden_layers
    full = {k: at[1][k] + (at[2][k] - at[1][k]) * (layers - 1) for k in at[1]}
    flops = FlopModel.for_config(model_cfg)
    pairs = kernel_pairs(prepared.end)
    kernel_flops = flops.per_pair * pairs
    seconds = full["optimal_seconds"] + kernel_flops / peak
    useful = flops.flops(prepared.work)
    return {"rows": plan.rows, "row_len": plan.row_len, "tokens": prepared.work.tokens,
            "visible_pairs": prepared.work.pairs, "kernel_pairs": pairs,
            "cost_per_depth": at, "cost_full_depth": full, "kernel_flops": kernel_flops,
            "xla_plus_kernel_flops": full["flops"] + kernel_flops, "useful_flops": useful,
            "useful_without_attention": flops.flops(Work(prepared.work.tokens, 0,
                                                         prepared.work.scored)),
            "step_seconds": seconds, "mfu_bound": useful / (seconds * peak)}


def worker(args: argparse.Namespace, path: Path) -> int:
    from jtree.launch.bench.workloads import workloads
    from jtree.launch.compile import compiler_name, target_devices
    from jtree.training.utilization import datasheet_peak

    target = TARGETS[args.target]
    devices = target_devices(target)
    peak = datasheet_peak(devices[0].device_kind, "bfloat16")
    workload = next(w for w in workloads() if w.name == WORKLOAD)
    modes = {mode: mode_estimate(args.config, args.overrides, mode, workload, target, devices,
                                 peak)
             for mode in ("tree", "baseline")}
    report = {"config": args.config, "target": args.target, "compiler": compiler_name("tpu"),
              "device_kind": devices[0].device_kind, "peak_flops": peak,
              "workload": WORKLOAD, "overrides": args.overrides, **modes,
              "speedup": modes["baseline"]["step_seconds"] / modes["tree"]["step_seconds"],
              "flop_speedup": (modes["baseline"]["xla_plus_kernel_flops"]
                               / modes["tree"]["xla_plus_kernel_flops"])}
    path.write_text(json.dumps(report, indent=1) + "\n")
    for mode in ("tree", "baseline"):
        m = modes[mode]
        full = m["cost_full_depth"]
        print(f"{mode}: {m['rows']} x {m['row_len']} tokens, XLA {full['flops']:.3e} flops + "
              f"kernels {m['kernel_flops']:.3e}, optimal {full['optimal_seconds']:.4f} s, step "
              f"{m['step_seconds']:.4f} s, MFU bound {m['mfu_bound']:.2f}")
    print(f"speedup {report['speedup']:.2f} (FLOPs {report['flop_speedup']:.2f}); report: {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/qwen3_0.6b.yaml")
    parser.add_argument("--target", default="tpu-v5p-8",
                        choices=sorted(k for k, t in TARGETS.items() if t.platform == "tpu"))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    path = Path(f"runs/aot/cost_{Path(args.config).stem}_{args.target}.json")
    if os.environ.get(WORKER_ENV):
        return worker(args, path)
    argv = list(sys.argv[1:] if argv is None else argv)
    return in_worker("jtree.launch.bench.compile_cost", argv, args.target,
                     path.with_suffix(".log"))


if __name__ == "__main__":
    sys.exit(main())
