"""Per-device memory plan of a config's train step (see `jtree.memory.plan` for the rule):

    python -m jtree.launch.memory_plan --config configs/qwen3_30b_a3b.yaml --devices 64 \
        --device-gib 80

Parameters, gradients, optimizer state and batch inputs are exact bytes per device from the
shardings at full depth on `--devices` forced host devices (the target's device count, so the
config's mesh resolves as on the target); activations and the largest temporary come from XLA's
`memory_analysis()` of the step compiled on this host at two depths (`--depth-blocks`, in
repeated layer blocks; scanned when the config scans its layers), scaled linearly to the full
depth. Exits 1 when the plan does not fit `--device-gib`. `runtime.attention_impl=auto` compiles
as `xla`, as `jtree.launch.lower_step` exports it (`auto` would pick this CPU host's own kernel).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

# XLA:CPU's default scheduler orders for concurrency; its memory-minimizing scheduler is the closer
# model of an accelerator's, which schedules within the device memory (docs/memory.md).
MEMORY_SCHEDULER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--devices", type=int, default=8,
                        help="the target's device count (forced host devices)")
    parser.add_argument("--device-gib", type=float, default=80.0, help="memory per device (GiB)")
    parser.add_argument("--rows", type=int, default=1,
                        help="rows per micro-batch per row shard (data x fsdp)")
    parser.add_argument("--depth-blocks", type=int, nargs=2, default=None,
                        help="the two depths compiled, in repeated layer blocks (default 2 3 "
                             "with runtime.scan_layers, else 1 2; scanned, the second may "
                             "be the full depth)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    os.environ["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={args.devices} "
                               f"{MEMORY_SCHEDULER}")

    import jax

    from jtree.config import load_config
    from jtree.launch.lower_step import export_attention_impl
    from jtree.memory.plan import memory_plan

    if jax.device_count() != args.devices:
        raise SystemExit("jax was initialized before XLA_FLAGS could be set; run as a module")
    impl = export_attention_impl(load_config(args.config, args.overrides).runtime.attention_impl)
    overrides = [*args.overrides, f"runtime.attention_impl={impl}"]
    plan = memory_plan(args.config, overrides, rows=args.rows,
                       depth_blocks=args.depth_blocks and tuple(args.depth_blocks))
    print(plan.report(args.device_gib))
    return 0 if plan.fits(args.device_gib) else 1


if __name__ == "__main__":
    sys.exit(main())
