"""Every kernel compiled by its target's production compiler, on this CPU host:

    python -m jtree.launch.bench.compile_kernels [--targets tpu-v5p-8 gpu-h100x8 gpu-a100x8]

A lowering (`jax.export`, the kernel tests) proves the JAX side of a kernel; only the target's own
compiler (Mosaic TPU inside XLA:TPU, Triton and Mosaic GPU inside XLA:GPU) says whether it fits
the chip's VMEM, shared memory and layouts. Each case is one kernel's forward + backward (or
forward only where the docs claim no more) on one device of the target, at S = 4096 tokens, one
row, 2 kv heads: the attention kernels `auto` runs per target (`pallas_tpu` on TPU,
`pallas_mosaic_gpu` on H100, `mosaic_gpu_blackwell` on B200, `pallas_triton` on A100 and for
B200 operands the tcgen05 kernel does not take) over head_dim (on B200 also MLA's q/k 192,
v 128), GQA group, dtype, a window with sinks and a prefix; and the Gated DeltaNet kernels (the
tree recurrence with the parallel and the sequential scan, the path conv), which are XLA code,
compiled for TPU and the H100.

Cases compile in workers of `jtree.launch.compile.in_worker` (the plugin on their path), each
batch stopped after `TIMEOUT` seconds; runs/aot/kernels_TARGET.json holds a target's results and
the table of every target is printed as markdown. A refusal is the compiler's (or the kernel's
own check's) first line. Exit status 0 when every case compiled, 1 when one was refused or
stopped, 2 when a plugin is missing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jtree.launch.aot_plugins import requirements
from jtree.launch.compile import (
    PLUGINS_ABSENT,
    TARGETS,
    TIMED_OUT,
    WORKER_ENV,
    first_line,
    in_worker,
)

SEQ, KV_HEADS, PREFIX, WINDOW, CHUNK = 4096, 2, 1024, 128, 64
DEFAULT_TARGETS = ("tpu-v5p-8", "gpu-h100x8", "gpu-a100x8")
TIMEOUT = 300  # seconds per worker batch: a compile past 5 minutes is stopped and reported


@dataclasses.dataclass(frozen=True)
class Case:
    """One compile: `kernel` (an attention impl, or `gdn_parallel`, `gdn_sequential`,
    `tree_conv`) at `head_dim` (the key head dim for GDN), `dtype` and GQA group `gqa`, with
    `variant` "" (plain), "window+sinks" or "prefix"; `backward` False compiles the forward only;
    `value_head_dim` v's head dim (MLA) where it is not `head_dim`."""

    kernel: str
    head_dim: int
    dtype: str
    gqa: int = 1
    variant: str = ""
    backward: bool = True
    value_head_dim: int | None = None

    @property
    def dims(self) -> str:
        """The head dims as the name and the table give them: "128", or "192/128" (MLA)."""
        return str(self.head_dim) + (f"/{self.value_head_dim}" if self.value_head_dim else "")

    @property
    def name(self) -> str:
        parts = [self.kernel, f"d{self.dims}", self.dtype, f"gqa{self.gqa}", self.variant,
                 "fwd+bwd" if self.backward else "fwd"]
        return " ".join(p for p in parts if p)


def gdn_cases() -> list[Case]:
    """The Gated DeltaNet kernels at Qwen3-Next's per-device shapes under 8-way tensor
    parallelism (2 key heads of 128, 4 value heads), bf16 activations."""
    return [Case(k, 128, "bfloat16", 2) for k in ("gdn_parallel", "gdn_sequential", "tree_conv")]


def sweep(target: str) -> list[Case]:
    """The cases compiled for `target`: the attention kernel `auto` runs there, then GDN."""
    if target.startswith("tpu"):
        attention = [Case("pallas_tpu", d, dt, g) for d in (64, 128, 256)
                     for dt in ("bfloat16", "float32") for g in (1, 4)]
        attention += [Case("pallas_tpu", 128, dt, 4, v) for dt in ("bfloat16", "float32")
                      for v in ("window+sinks", "prefix")]
    elif target.startswith("gpu-h100"):
        attention = [Case("pallas_mosaic_gpu", d, "bfloat16", g) for d in (64, 128) for g in (1, 4)]
        attention += [Case("pallas_mosaic_gpu", 128, "bfloat16", 4, v)
                      for v in ("window+sinks", "prefix")]
        attention.append(Case("pallas_mosaic_gpu", 256, "bfloat16", 4, backward=False))
    elif target.startswith("gpu-b200"):
        # The tcgen05 kernel `auto` trains with there (MLA's 192 / 128 too), then the Triton
        # kernel it takes for the operands the tcgen05 kernel does not handle (fp32, other head
        # dims).
        attention = [Case("mosaic_gpu_blackwell", d, "bfloat16", g)
                     for d in (64, 128) for g in (1, 4)]
        attention += [Case("mosaic_gpu_blackwell", 128, dt, 4, v)
                      for dt, v in (("float16", ""), ("bfloat16", "window+sinks"),
                                    ("bfloat16", "prefix"))]
        attention += [Case("mosaic_gpu_blackwell", 192, "bfloat16", g, v, value_head_dim=128)
                      for g, v in ((1, ""), (1, "prefix"), (4, "window+sinks"))]
        return attention + [Case("pallas_triton", 128, "bfloat16", 4)]
    else:
        attention = [Case("pallas_triton", d, dt, 4) for d in (64, 128)
                     for dt in ("float32", "bfloat16", "float16")]
        attention += [Case("pallas_triton", 128, "bfloat16", 4, v)
                      for v in ("window+sinks", "prefix")]
        return attention  # the GDN code is XLA's on every GPU: compiled for the H100 only
    return attention + gdn_cases()


def attention_program(case: Case) -> tuple[Callable, list[tuple[tuple[int, ...], str]], int]:
    """(loss, argument shapes and dtypes, number of differentiable leading arguments) of one
    tree-attention call; the mask's arrays are traced, as in the train step."""
    from jtree.kernels import TreeMask, tree_attention

    hq, d, dt, i32 = KV_HEADS * case.gqa, case.head_dim, case.dtype, "int32"
    dv = case.value_head_dim or d
    shapes = [((1, SEQ, hq, d), dt), ((1, SEQ, KV_HEADS, d), dt), ((1, SEQ, KV_HEADS, dv), dt)]
    if case.variant == "prefix":
        shapes += [((1, PREFIX, KV_HEADS, d), dt), ((1, PREFIX, KV_HEADS, dv), dt),
                   ((1, SEQ), i32), ((1, PREFIX), i32)]

        def loss(q, k, v, pk, pv, end, pend):
            return tree_attention(q, k, v, TreeMask(end, pend), impl=case.kernel, prefix_k=pk,
                                  prefix_v=pv)
        return loss, shapes, 5
    if case.variant == "window+sinks":
        shapes += [((hq,), "float32"), ((1, SEQ), i32), ((1, SEQ), i32)]

        def loss(q, k, v, sinks, end, positions):
            mask = TreeMask(end, positions=positions, window=WINDOW)
            return tree_attention(q, k, v, mask, impl=case.kernel, sinks=sinks)
        return loss, shapes, 4
    shapes.append(((1, SEQ), i32))
    return lambda q, k, v, end: tree_attention(q, k, v, TreeMask(end), impl=case.kernel), shapes, 3


def gdn_program(case: Case) -> tuple[Callable, list[tuple[tuple[int, ...], str]], int]:
    """The GDN recurrence (`scan` explicit: `auto` would read this host's backend) or the path
    conv, on one row of `SEQ` tokens in chunks of `CHUNK`."""
    from jtree.kernels.gdn.delta_rule import tree_gated_delta_rule
    from jtree.kernels.tree_conv import tree_causal_conv1d

    hk, hv, d, dt, i32 = case.gqa, 2 * case.gqa, case.head_dim, case.dtype, "int32"
    if case.kernel == "tree_conv":
        width = (2 * hk + hv) * d  # the conv runs over q, k and v channels together
        shapes = [((1, SEQ, width), dt), ((width, 4), "float32"), ((1, SEQ, 3), i32)]
        return tree_causal_conv1d, shapes, 2
    chunks = SEQ // CHUNK
    shapes = [((1, SEQ, hk, d), dt), ((1, SEQ, hk, d), dt), ((1, SEQ, hv, d), dt),
              ((1, SEQ, hv), "float32"), ((1, SEQ, hv), "float32"),
              ((1, chunks, CHUNK), i32), ((1, chunks), i32), ((1, SEQ), i32)]
    scan = case.kernel.removeprefix("gdn_")

    def recurrence(q, k, v, g, beta, chunk_tokens, chunk_src, token_slot):
        return tree_gated_delta_rule(q, k, v, g, beta, chunk_tokens=chunk_tokens,
                                     chunk_src=chunk_src, token_slot=token_slot, scan=scan)[0]
    return recurrence, shapes, 5


def compile_case(case: Case, device: Any) -> dict[str, Any]:
    """Lower and compile one case on `device` (a compile-only device of the target)."""
    import jax
    import jax.numpy as jnp

    build = gdn_program if case.kernel in ("gdn_parallel", "gdn_sequential", "tree_conv") \
        else attention_program
    fn, shapes, n_diff = build(case)
    sharding = jax.sharding.SingleDeviceSharding(device)
    args = [jax.ShapeDtypeStruct(s, jnp.dtype(dt), sharding=sharding) for s, dt in shapes]

    def scalar(*a):
        return fn(*a).astype(jnp.float32).sum()

    program = jax.value_and_grad(scalar, argnums=tuple(range(n_diff))) if case.backward \
        else scalar
    start = time.perf_counter()
    try:
        compiled = jax.jit(program).lower(*args).compile()
    except Exception as e:  # noqa: BLE001 - a refusal is the result
        return {"case": case.name, **dataclasses.asdict(case), "compiled": False,
                "reason": first_line(e), "seconds": round(time.perf_counter() - start, 1)}
    calls = re.findall(r'custom_call_target="([^"]+)"', compiled.as_text())
    return {"case": case.name, **dataclasses.asdict(case), "compiled": True,
            "seconds": round(time.perf_counter() - start, 1),
            "custom_calls": {c: calls.count(c) for c in sorted(set(calls))},
            **kernel_resources(case)}


def kernel_resources(case: Case) -> dict[str, str]:
    """Per-CTA shared memory (KiB) and tensor memory (32-bit columns) of the Blackwell kernels
    (forward, and dQ, dK/dV when the case has a backward), from the buffers they allocate (the
    compile does not report them); {} for other kernels."""
    if case.kernel != "mosaic_gpu_blackwell":
        return {}
    import jax.numpy as jnp

    from jtree.kernels.attention import mgpu_blackwell_backward as backward
    from jtree.kernels.attention.mgpu_blackwell_forward import forward_buffers, tmem_columns
    from jtree.kernels.attention.mgpu_pipeline import smem_bytes

    keys = SEQ + (PREFIX if case.variant == "prefix" else 0)
    window = WINDOW if case.variant == "window+sinks" else None
    d, dv, dt = case.head_dim, case.value_head_dim or case.head_dim, jnp.dtype(case.dtype)
    kernels = {"fwd": (forward_buffers(keys, d, dv, 2, dt, window), tmem_columns(d, dv))}
    if case.backward:
        columns = backward.tmem_columns(d, dv)
        kernels["dq"] = (backward.dq_buffers(keys, d, dv, 2, dt, window), columns["dq"])
        kernels["dkv"] = (backward.dkv_buffers(SEQ, d, dv, 2, dt, window), columns["dkv"])
    kib = lambda buffers: round(sum(smem_bytes(b.shape, b.dtype) for b in buffers.values()) / 1024)
    return {"smem_kib": "/".join(str(kib(b)) for b, _ in kernels.values()),
            "tmem_columns": "/".join(str(c) for _, c in kernels.values())}


def worker(target: str, indices: Sequence[int], path: Path) -> int:
    """Compile the cases `indices` of `target`'s sweep, appending each result to `path` (JSON
    lines) as it comes, so a batch stopped for time keeps what it compiled."""
    from jtree.launch.compile import target_devices

    device = target_devices(TARGETS[target])[0]
    cases = sweep(target)
    for i in indices:
        r = {"index": i, "device_kind": device.device_kind, **compile_case(cases[i], device)}
        with path.open("a") as f:
            f.write(json.dumps(r) + "\n")
        print(f"{target}: {r['case']}: " + (f"compiled in {r['seconds']} s" if r["compiled"]
                                           else f"REFUSED: {r['reason']}"), flush=True)
    return 0


def batches(cases: Sequence[Case]) -> list[list[int]]:
    """Worker batches: the attention cases together (each compiles in seconds), every GDN case
    alone (the recurrence's compiles are the long ones), so a stop for time costs one case."""
    attention = [i for i, c in enumerate(cases) if c not in gdn_cases()]
    return [attention] + [[i] for i, c in enumerate(cases) if c in gdn_cases()]


def run_target(target: str, out: Path) -> dict[str, Any] | None:
    """Every batch of `target` in its own worker (at most `TIMEOUT` s each); the report, or None
    without the plugin. A case with no result is reported as stopped, with its batch's time."""
    (out / f"kernels_{target}.jsonl").unlink(missing_ok=True)
    stopped = {}
    for batch in batches(sweep(target)):
        rc = in_worker("jtree.launch.bench.compile_kernels",
                       ["--targets", target, "--out", str(out), "--cases", *map(str, batch)],
                       target, out / f"kernels_{target}.log", timeout=TIMEOUT)
        if rc == PLUGINS_ABSENT:
            return None
        why = (f"not compiled within {TIMEOUT} s (stopped)" if rc == TIMED_OUT
               else f"the worker exited with status {rc}")
        stopped.update({i: why for i in batch})
    return target_report(target, out, stopped)


def target_report(target: str, out: Path, stopped: dict[int, str]) -> dict[str, Any]:
    """`target`'s results from its workers' JSON lines, the cases without one marked with the
    reason in `stopped`; written to runs/aot/kernels_TARGET.json."""
    lines, cases = out / f"kernels_{target}.jsonl", sweep(target)
    done = [json.loads(line) for line in lines.read_text().splitlines()] \
        if lines.exists() else []
    missing = {i: why for i, why in stopped.items() if i not in {r["index"] for r in done}}
    results = done + [{"index": i, "case": cases[i].name, **dataclasses.asdict(cases[i]),
                       "compiled": False, "reason": why, "seconds": None}
                      for i, why in missing.items()]
    report = {"target": target, "compiler": " ".join(requirements(TARGETS[target].platform)),
              "seq_len": SEQ, "results": sorted(results, key=lambda r: r["index"])}
    (out / f"kernels_{target}.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def table(reports: Sequence[dict[str, Any]]) -> str:
    """The markdown table of docs/kernels.md."""
    lines = ["| target | kernel | head_dim | dtype | GQA | variant | pass | result | compile |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for rep in reports:
        for r in rep["results"]:
            result = "compiled" if r["compiled"] else f"refused: {r['reason']}"
            if r.get("smem_kib"):
                result += f" (SMEM {r['smem_kib']} KiB, TMEM {r['tmem_columns']} columns)"
            seconds = "-" if r["seconds"] is None else f"{r['seconds']} s"
            dims = Case(**{f.name: r[f.name] for f in dataclasses.fields(Case)
                           if f.name in r}).dims
            lines.append(f"| `{rep['target']}` | `{r['kernel']}` | {dims} | "
                         f"{r['dtype']} | {r['gqa']} | {r['variant'] or '-'} | "
                         f"{'fwd+bwd' if r['backward'] else 'fwd'} | {result} | {seconds} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", nargs="+", default=list(DEFAULT_TARGETS),
                        choices=sorted(TARGETS))
    parser.add_argument("--out", default="runs/aot", help="folder of the JSON reports")
    parser.add_argument("--cases", nargs="*", type=int, help=argparse.SUPPRESS)  # a worker's
    args = parser.parse_args(argv)
    out = Path(args.out)
    if os.environ.get(WORKER_ENV):
        (target,) = args.targets
        return worker(target, args.cases, out / f"kernels_{target}.jsonl")
    out.mkdir(parents=True, exist_ok=True)
    reports = []
    for target in args.targets:
        report = run_target(target, out)
        if report is None:
            return PLUGINS_ABSENT
        reports.append(report)
    print(table(reports))
    return 0 if all(r["compiled"] for rep in reports for r in rep["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
