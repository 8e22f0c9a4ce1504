"""Per-device memory plan of a config's train step (see `jtree.memory.plan` for the rule):

    python -m jtree.launch.memory_plan --config configs/qwen3_30b_a3b.yaml --device-gib 80

Parameters, gradients, optimizer state and batch inputs are exact bytes per device from the
shardings at full depth on `--devices` forced host devices (the target's device count, so the
config's mesh resolves as on the target; default: the devices the config's mesh names, its
`data` x `fsdp` x `context` x `model` with `data: -1` counted once: per-device shapes do not
depend on how many data-parallel replicas there are); activations and the largest temporary
come from XLA's `memory_analysis()` of the step compiled on this host at two depths
(`--depth-blocks`, in repeated layer blocks; scanned when the config scans its layers), scaled
linearly to the full depth (a layer list that repeats no single block, such as Nemotron 3 Nano's:
one slope per repeated block, each block compiled at both depths). Exits 1 when the plan does not
fit `--device-gib`.
`runtime.attention_impl=auto` compiles as `xla`, as `jtree.launch.lower_step` exports it (`auto`
would pick this CPU host's own kernel).

With `--target T` (a `jtree.launch.compile` target) the plan is the target compiler's instead:
the full-depth step compiled by XLA:TPU or XLA:GPU through `jtree.launch.compile` (the same
worker, the same report), its buffer assignment against the chip's memory; `--devices`,
`--device-gib` and `--depth-blocks` do not apply. Without the plugins (`make aot-plugins`) it
says so and falls back to the fitted XLA:CPU estimate on the target's device count and memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from jtree.config import load_config
from jtree.config.run import MeshConfig
from jtree.launch.compile import GIB, PLUGINS_ABSENT, TARGETS, json_path
from jtree.launch.compile import main as compile_main

# XLA:CPU's default scheduler orders for concurrency; its memory-minimizing scheduler is the closer
# model of an accelerator's, which schedules within the device memory (docs/memory.md).
MEMORY_SCHEDULER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def mesh_devices(mesh: MeshConfig) -> int:
    """The devices a config's mesh names: the product of its axes, `data: -1` (all devices left
    over) counted as one replica."""
    return max(mesh.data, 1) * mesh.fsdp * mesh.context * mesh.model


def target_plan(args: argparse.Namespace) -> int:
    """The plan as the target's compiler allocates it: `jtree.launch.compile` run on the config at
    full depth (it prints its report). Exits 0 when the step fits the chip, 1 when it does not
    or a stage failed, `PLUGINS_ABSENT` without the plugins."""
    report = json_path(args)
    report.unlink(missing_ok=True)  # a stale report must not stand in for a failed compile
    rc = compile_main(["--config", args.config, "--target", args.target, "--rows",
                       str(args.rows), "--json", str(report), *args.overrides])
    if rc != 0:
        return rc
    return 0 if json.loads(report.read_text())["memory"]["fits"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--devices", type=int, default=None,
                        help="the target's device count (forced host devices; default: the "
                             "config's mesh size, `mesh_devices`)")
    parser.add_argument("--device-gib", type=float, default=80.0, help="memory per device (GiB)")
    parser.add_argument("--rows", type=int, default=1,
                        help="rows per micro-batch per row shard (data x fsdp)")
    parser.add_argument("--depth-blocks", type=int, nargs=2, default=None,
                        help="the two depths compiled, in repeated layer blocks (default 2 3 "
                             "with runtime.scan_layers, else 1 2; scanned, the second may "
                             "be the full depth)")
    parser.add_argument("--json", default=None,
                        help="also write the plan's fields (bytes) and its total to this file "
                             "(with --target: the compile report)")
    parser.add_argument("--target", default=None, choices=sorted(TARGETS),
                        help="compile for this target with its own compiler (jtree.launch.compile)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.target:
        rc = target_plan(args)
        if rc != PLUGINS_ABSENT:
            return rc
        target = TARGETS[args.target]
        args.devices, args.device_gib = target.device_count, target.hbm_bytes / GIB
        print(f"falling back to the XLA:CPU estimate on {args.devices} host devices and "
              f"{args.device_gib:.2f} GiB (not the {args.target} compiler's)")
    cfg = load_config(args.config, args.overrides)  # reads no device: XLA_FLAGS can still be set
    args.devices = args.devices or mesh_devices(cfg.mesh)
    os.environ["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={args.devices} "
                               f"{MEMORY_SCHEDULER}")

    import jax

    from jtree.launch.lower_step import export_attention_impl
    from jtree.memory.plan import memory_plan

    if jax.device_count() != args.devices:
        raise SystemExit("jax was initialized before XLA_FLAGS could be set; run as a module")
    impl = export_attention_impl(cfg.runtime.attention_impl)
    overrides = [*args.overrides, f"runtime.attention_impl={impl}"]
    plan = memory_plan(args.config, overrides, rows=args.rows,
                       depth_blocks=args.depth_blocks and tuple(args.depth_blocks))
    print(plan.report(args.device_gib))
    if args.json:
        fields = dataclasses.asdict(plan)
        Path(args.json).write_text(json.dumps({**fields, "total": plan.total}, indent=1))
    return 0 if plan.fits(args.device_gib) else 1


if __name__ == "__main__":
    sys.exit(main())
