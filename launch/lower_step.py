"""Lower a config's sharded train step for TPU or CUDA on this CPU machine (no accelerator):

    python -m jtree.launch.lower_step --config configs/qwen3_0.6b.yaml --platform tpu --devices 8

Builds the real step (shard_map over the config's mesh on `--devices` forced host devices, optax
update, donation) from abstract shapes only, exports it with `jax.export` for the target platform
and prints the size of the lowered module and its collectives. This checks that the step traces,
shards and lowers for the target; it does not compile it for the chip or run it.

`runtime.attention_impl=auto` lowers as `xla` (`export_attention_impl`); a named implementation
lowers as named. The Pallas Triton kernel's custom call carries no serialization compatibility
guarantee, so `jax.export` is told to accept it (`TRITON_CALL`): the module is inspected here,
never stored and loaded by a later jax.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence

# The custom call target `pallas_call` lowers to on the GPU Triton backend.
TRITON_CALL = "__gpu$xla.gpu.triton"


def export_attention_impl(impl: str) -> str:
    """The attention implementation the exported step uses for `impl`. `auto` would resolve for
    this CPU host, where it picks the C++ `cpu` kernel: a CPU-only custom call no TPU or GPU can
    run; it lowers as `xla`, the block-sparse kernel every platform runs. The targets' own Pallas
    kernels lower inside the sharded step when named (`runtime.attention_impl=pallas_tpu`, or
    `pallas_mosaic_gpu` with a head_dim of 64 or 128 and bf16 compute)."""
    return "xla" if impl == "auto" else impl


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--platform", choices=("tpu", "cuda"), default="tpu")
    parser.add_argument("--devices", type=int, default=8, help="mesh size (forced host devices)")
    parser.add_argument("--rows", type=int, default=1, help="rows per micro-batch per data shard")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"

    import jax
    import numpy as np

    from jtree.config import load_config
    from jtree.memory.step_shapes import abstract_step_args
    from jtree.parallel.sharding import describe_mesh
    from jtree.training.trainer import Trainer

    if jax.device_count() != args.devices:
        raise SystemExit("jax was initialized before XLA_FLAGS could be set; run as a module")
    cfg = load_config(args.config, args.overrides)
    impl = export_attention_impl(cfg.runtime.attention_impl)
    cfg = load_config(args.config, [*args.overrides, f"runtime.attention_impl={impl}"])
    trainer = Trainer.build(cfg)
    mesh = trainer.mesh
    state, inputs = abstract_step_args(trainer, args.rows)
    shape = inputs.tokens.shape
    exported = jax.export.export(
        trainer.step_fn, platforms=[args.platform],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(state, inputs)
    text = exported.mlir_module()
    ops = {op: len(re.findall(rf"\b{op}\b", text)) for op in
           ("all_reduce", "all_gather", "reduce_scatter", "collective_permute", "all_to_all")}
    custom_calls = sorted(set(re.findall(r"custom_call @([\w.$]+)", text)))
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(state.params))
    print(f"lowered {args.config} for {args.platform}: {n_params:,} parameters, mesh "
          f"{describe_mesh(mesh)}, inputs {shape}, attention "
          f"{impl}; StableHLO "
          f"{len(text.splitlines()):,} lines; collectives "
          + ", ".join(f"{k} {v}" for k, v in ops.items() if v)
          + f"; custom calls {', '.join(custom_calls) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
