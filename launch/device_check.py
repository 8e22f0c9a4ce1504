"""One prepared check of jtree on the accelerator it finds: numerics, speed, memory (not a test).

Nothing in jtree ran on a GPU or TPU before this script: the Pallas kernels ran in interpreters and
were lowered, the memory plan comes from XLA:CPU. A first, short session on a device should answer
every open question at once, and a kernel that does not compile must not cost the other answers,
so every section (and every row in it) runs on its own and reports its error's first line.

- **info**: the device, `jax.print_environment_info()` (jax, jaxlib, driver and CUDA through
  nvidia-smi on a GPU; the device kind names a TPU's generation), and what `impl="auto"` runs
  for each dtype and head_dim.
- **numerics** (pass/fail; the exit code is 1 when one fails): every attention implementation the
  device runs, forward and q/k/v gradients against the float32 `reference` on the same rounded
  inputs, on tree rows with branching, paths ending inside the tree, GQA 2, S not a block
  multiple, a case with a sliding window along the path (W 24) and attention sinks, and one with a
  cached prefix and a soft-cap; in each dtype the kernel takes.
  On a GPU/TPU the Pallas kernels run natively; on CPU in their interpreters (Mosaic GPU in
  `jtree.launch.bench.mgpu_interpret`'s own process). The Gated DeltaNet tree scan (sequential and
  parallel) against the recurrent reference run path by path. A tiny Qwen3 and Qwen3-Next loss
  and gradients on the device (attention `auto`) against the same model on the CPU backend
  (attention `xla`).
- **memory**: a Qwen3-0.6B step (`configs/qwen3_0.6b.yaml` at S 8192, one micro-batch; `--quick`:
  `configs/tiny.yaml` at 256) run once through the trainer: peak device memory
  (`memory_stats()['peak_bytes_in_use']`, absent on CPU) next to `jtree.memory.plan`'s prediction
  (its own process on the CPU backend, as documented). It runs before the speed section, whose
  dense attention baselines would own the process's peak.
- **speed** (`--quick`: tiny sizes): tree attention forward and forward+backward against dense
  attention given the same tree mask (`jax.nn.dot_product_attention`, cuDNN on a GPU, XLA
  elsewhere; tokamax when installed) at S 8k/16k/32k for POR 0.5 and 0.9 trees, TFLOP/s on
  visible pairs; a Qwen3-0.6B-shaped random model (bf16, S 8192) train step in tree and baseline
  mode, tokens/s and MFU against the datasheet peak; what `run.mode=auto` picks; the GDN parallel
  against the sequential scan.

Writes OUT/device_check.json and OUT/device_check.md (`--out`, default bench_out). Every row says
whether it ran natively or interpreted.

Time on one H100, full run (estimated from compiles and FLOPs; it has not run on one):
- start, info (jax and CUDA init, nvidia-smi): ~15 s;
- numerics: 33 attention rows (xla and both Triton kernels in 3 dtypes, Mosaic GPU in 2, x 3
  cases), each one forward+backward compile of ~2-5 s on tiny shapes (the float32 reference
  compiles once per case), plus 5 GDN and 4 tiny-model compiles: ~3 min; the FLOPs are
  negligible (S 200);
- memory: one compile of the scanned 0.6B step (~40 s) while the plan's two XLA:CPU compiles run
  in a child process (26-31 s each on 2 cores at S 16384 per docs/memory.md, fewer at 8192):
  ~1 min;
- speed, attention: 6 (S, POR) cases x (tree, dense cuDNN, dense XLA [, tokamax]) x (fwd,
  fwd+bwd): ~36 compiles of ~3 s = 2 min; 5 runs each, the largest a dense 32k fwd+bwd,
  3.5 x 4 x 32768^2 x 128 x 16 heads = 3.1e13 FLOPs (~0.1 s at 300 TFLOP/s): seconds in all
  (the XLA dense kernel runs out of memory at 32k, reported as failed); host-side tree shapes:
  ~15 s;
- speed, train step: two compiles of the scanned 0.6B step (~80 s), then 5 runs of each mode; the
  baseline step holds 16k flat tokens, 6 x 0.6e9 x 16384 = 6e13 FLOPs plus attention, well under
  a second at 30% MFU: ~1.5 min;
- speed, GDN: two compiles at S 8192 (~20 s).
Total about 8 minutes, at the 8 the docs' recipe allows (`timeout 480`): the numerics
and memory sections come first, so a timeout cuts only speed rows.

    python -m jtree.launch.device_check --out device_out          # full check (GPU/TPU)
    python -m jtree.launch.device_check --quick --out device_out  # smallest sizes (2-core CPU: 2-5 min)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jtree.launch.bench.harness import Column, Output, bench_parser, markdown_table, run_info
from jtree.launch.device_numerics import DTYPES, numerics
from jtree.launch.device_report import Report, dispatch, first_line, peak_flops
from jtree.launch.device_speed import speed

SECTIONS = ("info", "numerics", "memory", "speed")


# ----------------------------------------------------------------------------- info


def auto_table(platform: str, device_kind: str) -> list[dict[str, Any]]:
    """What `impl="auto"` runs here for every dtype and head_dim, with and without a soft-cap."""
    rows = []
    for dtype in DTYPES:
        for head_dim in (64, 128, 256):
            row = {"dtype": dtype, "head_dim": head_dim}
            for key, softcap in (("auto", None), ("auto_softcap", 30.0)):
                row[key] = dispatch.resolve_impl("auto", platform, dtype=jnp.dtype(dtype),
                                                 head_dim=head_dim, softcap=softcap,
                                                 device_kind=device_kind)
            rows.append(row)
    return rows


def info(report: Report, _args: Any) -> dict[str, Any]:
    device = jax.devices()[0]
    kind = device.device_kind
    result = {"device_kind": kind, "platform": report.platform, "device_count": jax.device_count(),
              "jax": jax.__version__, "jaxlib": jax.lib.__version__,
              "compute_capability": getattr(device, "compute_capability", None),
              "peak_bf16_tflops": (peak_flops(kind) or 0) / 1e12 or "unknown",
              "environment": jax.print_environment_info(return_string=True),
              "auto": auto_table(report.platform, kind)}
    report.md += [f"## info\n\n{kind} ({report.platform}), jax {jax.__version__}, jaxlib "
                  f"{jax.lib.__version__}, peak bf16 {result['peak_bf16_tflops']} TFLOP/s\n",
                  "```\n" + result["environment"].strip() + "\n```\n", "`impl='auto'` runs:\n",
                  markdown_table(result["auto"], (Column("dtype", "dtype"),
                                                  Column("head_dim", "head_dim"),
                                                  Column("auto", "auto"),
                                                  Column("auto, soft-cap", "auto_softcap"))), ""]
    return result


# ----------------------------------------------------------------------------- numerics


# ----------------------------------------------------------------------------- memory


def memory(report: Report, args: Any) -> dict[str, Any]:
    """The trainer's step of a config, run once here, against `jtree.memory.plan` (XLA:CPU)."""
    from jtree.config import load_config
    from jtree.memory.step_shapes import padding_step_inputs
    from jtree.training.trainer import Trainer

    config = "configs/tiny.yaml" if args.quick else "configs/qwen3_0.6b.yaml"
    overrides = ["data.micro_batches=1", "mesh.data=1",
                 f"data.seq_len={256 if args.quick else 8192}"]
    result: dict[str, Any] = {"config": config, "overrides": overrides}
    with tempfile.TemporaryDirectory() as tmp:
        plan_json = Path(tmp) / "plan.json"
        # The plan compiles in its own process while the step runs here (they overlap).
        plan = subprocess.Popen(
            [sys.executable, "-m", "jtree.launch.memory_plan", "--config", config, "--devices",
             "1", "--json", str(plan_json), *overrides], stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
        try:
            trainer = Trainer.build(load_config(config, [*overrides,
                                                         "runtime.attention_impl=auto"]))
            _, metrics = trainer.step_fn(trainer.init_fn(), padding_step_inputs(trainer, rows=1))
            jax.block_until_ready(metrics)
            stats = jax.devices()[0].memory_stats()
            result["peak_bytes_in_use"] = stats and stats.get("peak_bytes_in_use")
            if not result["peak_bytes_in_use"]:
                result["peak_note"] = f"memory_stats() gives no peak on {report.platform}"
        except Exception as error:
            result["step_error"] = first_line(error)
        try:
            _, stderr = plan.communicate(timeout=420)
        except subprocess.TimeoutExpired:
            plan.kill()
            _, stderr = plan.communicate()
        if plan_json.exists():
            result["plan"] = json.loads(plan_json.read_text())
        else:
            result["plan_error"] = (stderr.strip().splitlines() or ["no output"])[-1]
    gib = lambda n: f"{n / 2**30:.2f} GiB" if n else "n/a"  # noqa: E731
    predicted = result.get("plan", {}).get("total")
    result["predicted_bytes"] = predicted
    if predicted and result.get("peak_bytes_in_use"):
        result["measured_over_predicted"] = result["peak_bytes_in_use"] / predicted
    report.md += ["## memory\n", f"{config} {' '.join(overrides)}: measured peak "
                  f"{gib(result.get('peak_bytes_in_use'))} "
                  f"({result.get('peak_note') or result.get('step_error') or 'native'}), "
                  f"memory_plan predicts {gib(predicted)} "
                  f"({result.get('plan_error') or 'XLA:CPU buffer assignment'})\n"]
    return result


# ----------------------------------------------------------------------------- speed


# ----------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench_parser(__doc__, repeats=3, quick="smallest sizes: one dtype per kernel, tiny "
                          "speed and memory cases, one repeat")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--impls", nargs="+", default=None,
                        help="check only these attention implementations (numerics; the GDN "
                             "and model checks are then left out)")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = 1
    report = Report(jax.default_backend())
    for name, fn in (("info", info), ("numerics", numerics), ("memory", memory),
                     ("speed", speed)):
        if name in args.sections:
            report.run(name, lambda fn=fn: fn(report, args))
    interpreted = sorted({f"{name}: {r['check']}" for name, section in report.sections.items()
                          for r in (section.get("rows") or [])
                          if r.get("execution") == "interpreted" and not r.get("skipped")})
    verdict = ("FAILED: " + ", ".join(report.failures) if report.failures
               else "all numerics passed" if "numerics" in args.sections else "numerics not run")
    summary = (f"{verdict}\n\ninterpreted (not native): {', '.join(interpreted) or 'none'}\n")
    table = "\n".join([f"# device check: {jax.devices()[0].device_kind}\n", summary, *report.md])
    print(table)
    written = Output.from_args(args, "device_check").write(
        {**run_info(args), "platform": report.platform, "failures": report.failures,
         "interpreted": interpreted, "sections": report.sections}, table=table)
    print(f"wrote {', '.join(map(str, written))}")
    return 1 if report.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
