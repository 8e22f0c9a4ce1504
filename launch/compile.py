"""Compile a config's sharded train step with a TPU's or GPU's own compiler, on this CPU host:

    python -m jtree.launch.compile --config configs/qwen3_0.6b.yaml --target gpu-h100x8 \\
        runtime.attention_impl=pallas_triton

The target (`TARGETS`) names a platform, a topology of compile-only devices and the chip's memory.
The step is the trainer's own (`Trainer.build` on those devices, `abstract_step_args`,
`step_fn.lower(...).compile()`), compiled by XLA:TPU (libtpu) or XLA:GPU (jax's CUDA plugin),
installed by `make aot-plugins` into `.aot/` (`jtree.launch.aot_plugins`). The command re-runs
itself as a worker process with that platform's folder on its PYTHONPATH, since the plugins must
not be importable from the virtual environment.

Printed, and written as JSON (`--json`, default runs/aot/CONFIG_TARGET.json): XLA's per-device
memory (arguments, temporaries, outputs, aliased, generated code; their total against the chip's
memory and a fit verdict), the lowering and compile times, the compiler's cost analysis where it
gives one (XLA:TPU: flops, bytes accessed, optimal_seconds; XLA:GPU gives none) and the
collectives of the compiled module. A compile proves that the step compiles and what it
allocates; it says nothing of its speed or numerics.

Exit status: 0 compiled (whether or not it fits: see the verdict), 1 a stage failed (the worker
prints `FAILED` with the stage and the compiler's first line), 2 the plugins are not installed.
`runtime.attention_impl=auto`, `runtime.gdn_scan=auto` and `runtime.expert_matmul=auto` resolve for
the target, as they would on the chip.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jtree.launch.aot_plugins import installed, plugin_root, requirements

GIB = 1024**3
SPECS = Path(__file__).resolve().parent / "gpu_specs"
# Set in the worker's environment: the process that compiles (with the plugin importable).
WORKER_ENV = "JTREE_AOT_WORKER"
# The exit status when the target's plugin is not installed; when a worker ran past its time.
PLUGINS_ABSENT, TIMED_OUT = 2, 124
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


@dataclasses.dataclass(frozen=True)
class Target:
    """A compile target: `platform` ("tpu" or "cuda"), its topology of compile-only devices
    (`topology` for `get_topology_desc`; TPU `chips_per_host`), the memory of one device in bytes
    and, for a GPU, the GpuTargetConfigProto file in `gpu_specs/`."""

    platform: str
    topology: str
    hbm_bytes: int
    chips_per_host: tuple[int, int, int] | None = None
    spec: str | None = None
    note: str = ""

    @property
    def device_count(self) -> int:
        """Devices in the topology (one per chip on TPU, one per GPU): the product of its
        dimensions, known without the plugin (the fallback plan forces this many host devices)."""
        return math.prod(int(n) for n in self.topology.split(":")[-1].split("x"))


H200_NOTE = "H100 SXM spec with the H200's memory (XLA publishes no H200 spec)"
TARGETS = {
    # v5p-8 counts TensorCores: 4 chips (2x2x1), one device each (megacore), 95 GiB HBM2e.
    "tpu-v5p-8": Target("tpu", "v5p:2x2x1", 95 * GIB, (2, 2, 1)),
    # v5p-16: 8 chips (2x2x2) on 2 hosts; v5p-128: 64 chips (4x4x4) on 16 hosts.
    "tpu-v5p-16": Target("tpu", "v5p:2x2x2", 95 * GIB, (2, 2, 1)),
    "tpu-v5p-128": Target("tpu", "v5p:4x4x4", 95 * GIB, (2, 2, 1)),
    "tpu-v5e-8": Target("tpu", "v5e:2x4", 16 * GIB, (2, 4, 1)),
    "tpu-v6e-8": Target("tpu", "v6e:2x4", 32 * GIB, (2, 4, 1)),
    # A GPU's memory is its spec's device_memory_size (what the driver reports as total).
    "gpu-h100x8": Target("cuda", "1x1x8", 84978434048, spec="h100_sxm.txtpb"),
    # The GPU topology is slices x hosts per slice x GPUs per host: 8 nodes of 8 H100s.
    "gpu-h100x64": Target("cuda", "1x8x8", 84978434048, spec="h100_sxm.txtpb"),
    "gpu-a100x8": Target("cuda", "1x1x8", 85100068864, spec="a100_sxm_80.txtpb"),
    # Blackwell (sm_100a): XLA's B200 spec.
    "gpu-b200x8": Target("cuda", "1x1x8", 191514411008, spec="b200.txtpb"),
    "gpu-h200x8": Target("cuda", "1x1x8", 141 * 10**9, spec="h200_sxm.txtpb",
                         note=H200_NOTE),
    # 2 and 64 nodes of 8 H200s: Kimi-Linear-48B's and DeepSeek-V3's / Kimi-K2's targets.
    "gpu-h200x16": Target("cuda", "1x2x8", 141 * 10**9, spec="h200_sxm.txtpb",
                          note=H200_NOTE),
    "gpu-h200x512": Target("cuda", "1x64x8", 141 * 10**9, spec="h200_sxm.txtpb",
                           note=H200_NOTE),
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--target", required=True, choices=sorted(TARGETS))
    parser.add_argument("--rows", type=int, default=1, help="rows per micro-batch per data shard")
    parser.add_argument("--json", help="where to write the report (default runs/aot/...)")
    parser.add_argument("overrides", nargs="*")
    return parser.parse_args(argv)


def json_path(args: argparse.Namespace) -> Path:
    return Path(args.json or f"runs/aot/{Path(args.config).stem}_{args.target}.json")


def main(argv: Sequence[str] | None = None) -> int:
    """Compile in a worker process (`in_worker`), or be that worker."""
    args = parse_args(argv)
    if os.environ.get(WORKER_ENV):
        return worker(args)
    argv = list(sys.argv[1:] if argv is None else argv)
    log = json_path(args).with_suffix(".log")
    return in_worker("jtree.launch.compile", argv, args.target, log)


def in_worker(module: str, argv: Sequence[str], target: str, log: Path,
              timeout: float | None = None) -> int:
    """Re-run `python -m module argv` as the worker of `target`'s platform: that platform's plugin
    folder on its PYTHONPATH, its stderr (the plugins' start-up noise) into `log`, shown only
    when the worker dies without a report. Returns its exit status, `PLUGINS_ABSENT` with one
    line when the plugin is not installed, or `TIMED_OUT` when it ran past `timeout` seconds
    (killed: a compile cannot be interrupted from inside)."""
    platform = TARGETS[target].platform
    folder = installed(platform)
    if folder is None:
        print(f"{target}: the {platform} compiler is not installed in "
              f"{plugin_root() / platform} ({' '.join(requirements(platform))}); run "
              "`make aot-plugins`")
        return PLUGINS_ABSENT
    env = dict(os.environ, **{WORKER_ENV: "1"}, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2",
               JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(folder.resolve()), env.get("PYTHONPATH")) if p)
    env.pop("XLA_FLAGS", None)  # forced host device counts are not the target's devices
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as err:
        try:
            rc = subprocess.run([sys.executable, "-m", module, *argv], env=env, stderr=err,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return TIMED_OUT
    if rc not in (0, 1):
        tail = log.read_text().strip().splitlines()[-20:]
        print(f"{target}: the compile worker exited with status {rc}; the end of {log}:\n"
              + "\n".join(tail))
    return rc


def target_devices(target: Target) -> list[Any]:
    """The target's compile-only devices, from the platform's plugin."""
    from jax.experimental import topologies

    if target.platform == "tpu":
        topology = topologies.get_topology_desc(
            platform="tpu", topology_name=target.topology, chip_config_name="default",
            chips_per_host_bounds=target.chips_per_host, num_slices=1)
    else:
        topology = topologies.get_topology_desc(
            platform="cuda", topology_name=target.topology,
            target_config=(SPECS / target.spec).read_text(), topology=target.topology)
    return list(topology.devices)


def target_overrides(config: str, overrides: Sequence[str], target: Target,
                     device: Any) -> list[str]:
    """`overrides` with `auto` attention, GDN scan and expert matmul resolved as they would be on the target's
    `device` (this host's backend is the CPU, whose `auto` would pick CPU kernels) and, for a GPU,
    its compute capability ("8.0" -> `runtime.gpu_compute_capability=80`): kernels compiled while
    lowering (jax-triton's) would otherwise ask this host's absent GPU for it."""
    import jax.numpy as jnp

    from jtree.config import load_config
    from jtree.config.architectures import attention_head_dims
    from jtree.kernels.gdn.delta_rule import pick_scan
    from jtree.kernels.grouped_matmul import pick_grouped_matmul
    from jtree.kernels.tree_attention import resolve_impl

    runtime, model = (cfg := load_config(config, overrides)).runtime, cfg.model.config
    head_dim, value_head_dim = attention_head_dims(model)
    backend = "tpu" if target.platform == "tpu" else "gpu"
    impl = resolve_impl(runtime.attention_impl, backend, dtype=jnp.dtype(runtime.dtype),
                        head_dim=head_dim, value_head_dim=value_head_dim,
                        device_kind=device.device_kind)
    capability = ([] if backend == "tpu" else
                  [f"runtime.gpu_compute_capability={round(float(device.compute_capability) * 10)}"])
    return [*overrides, f"runtime.attention_impl={impl}",
            f"runtime.gdn_scan={pick_scan(runtime.gdn_scan, backend)}",
            f"runtime.expert_matmul={pick_grouped_matmul(runtime.expert_matmul, backend)}",
            *capability]


def compiler_name(platform: str) -> str:
    """The production compiler and the installed plugin's version (in the worker's path)."""
    from importlib.metadata import version

    if platform == "tpu":
        return f"XLA:TPU, libtpu {version('libtpu')}"
    return f"XLA:GPU, jax-cuda12-plugin {version('jax-cuda12-plugin')}"


def first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def worker(args: argparse.Namespace) -> int:
    """Build, lower and compile the step on the target's devices; print and write the report."""
    import jax
    import numpy as np

    from jtree.config import load_config
    from jtree.memory.step_shapes import abstract_step_args
    from jtree.parallel.sharding import describe_mesh
    from jtree.training.trainer import Trainer

    target = TARGETS[args.target]
    stage = "devices"
    try:
        devices = target_devices(target)
        stage = "build"
        overrides = target_overrides(args.config, args.overrides, target, devices[0])
        cfg = load_config(args.config, overrides)
        trainer = Trainer.build(cfg, devices=devices)
        state, inputs = abstract_step_args(trainer, args.rows)
        stage = "lower"
        start = time.perf_counter()
        lowered = trainer.step_fn.lower(state, inputs)
        lowered_s = time.perf_counter() - start
        stage = "compile"
        start = time.perf_counter()
        compiled = lowered.compile()
        compile_s = time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 - any stage's refusal is the report
        print(f"{args.target}: FAILED at {stage}: {first_line(e)}")
        return 1
    report = {
        "config": args.config, "target": args.target, "platform": target.platform,
        "topology": target.topology, "device_kind": devices[0].device_kind,
        "devices": len(devices), "note": target.note,
        "compiler": compiler_name(target.platform), "overrides": overrides,
        "mesh": describe_mesh(trainer.mesh), "inputs": list(inputs.tokens.shape),
        "parameters": sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(state.params)),
        "attention_impl": cfg.runtime.attention_impl, "seq_len": cfg.data.seq_len,
        "lower_seconds": round(lowered_s, 2), "compile_seconds": round(compile_s, 2),
        "memory": memory(compiled.memory_analysis(), target.hbm_bytes),
        "cost": cost(compiled.cost_analysis()), "collectives": collectives(compiled.as_text()),
    }
    print(describe(report))
    path = json_path(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"  report: {path}")
    return 0


def memory(stats: Any, hbm_bytes: int) -> dict[str, Any]:
    """XLA's buffer assignment per device. Donated state is counted once: the total is arguments
    + outputs - aliased (outputs written into donated arguments) + temporaries + generated code."""
    fields = {name: int(getattr(stats, f"{name}_size_in_bytes")) for name in
              ("argument", "output", "alias", "temp", "generated_code")}
    total = (fields["argument"] + fields["output"] - fields["alias"] + fields["temp"]
             + fields["generated_code"])
    return {**fields, "total": total, "hbm": hbm_bytes, "fits": total <= hbm_bytes}


def cost(analysis: Any) -> dict[str, float] | None:
    """The compiler's own cost analysis (None where it gives none, as XLA:GPU does here)."""
    if isinstance(analysis, list):  # older jax: one dict per computation
        analysis = analysis[0] if analysis else None
    if not analysis:
        return None
    keys = ("flops", "bytes accessed", "transcendentals", "optimal_seconds")
    return {k: float(analysis[k]) for k in keys if k in analysis}


def collectives(hlo: str) -> dict[str, int]:
    """Collective instructions of the compiled module by kind (async starts count once)."""
    found = re.findall(r"\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(", hlo)
    return {kind: found.count(kind) for kind in COLLECTIVES if kind in found}


def describe(r: dict[str, Any]) -> str:
    """The report as printed."""
    gib = lambda n: f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"  # noqa: E731
    m = r["memory"]
    free = m["hbm"] - m["total"]
    verdict = (f"fits {gib(m['hbm'])} ({gib(free)} free)" if m["fits"] else
               f"does NOT fit {gib(m['hbm'])} ({gib(-free)} over)")
    c = r["cost"]
    cost_line = "not reported by this compiler" if c is None else ", ".join(
        f"{k} {v:.4g}" for k, v in c.items())
    lines = [
        f"compiled {r['config']} for {r['target']} ({r['devices']} x {r['device_kind']}, "
        f"{r['compiler']}): {r['parameters']:,} parameters, mesh {r['mesh']}, inputs "
        f"{tuple(r['inputs'])}, attention {r['attention_impl']}"
        + (f"; {r['note']}" if r["note"] else ""),
        f"  time: lower {r['lower_seconds']:.1f} s, compile {r['compile_seconds']:.1f} s",
        f"  memory per device: arguments {gib(m['argument'])}, temporaries {gib(m['temp'])}, "
        f"outputs {gib(m['output'])}, aliased {gib(m['alias'])}, code "
        f"{gib(m['generated_code'])}; total {gib(m['total'])}: {verdict}",
        f"  cost: {cost_line}",
        "  collectives: " + (", ".join(f"{k} {v}" for k, v in r["collectives"].items())
                             or "none"),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
