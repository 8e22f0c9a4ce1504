"""The `triton_lang` kernels compiled by Triton's own compiler for NVIDIA targets, on this CPU host:

    python -m jtree.launch.bench.triton_lang_compile [--capabilities 80 90] [--out FILE]
    python -m jtree.launch.bench.triton_lang_compile --lower 80 [--out FILE]

Each configuration (kernel x head dim x dtype x blocks) goes through `triton.compile` with an
explicit `GPUTarget("cuda", capability, 32)` (no GPU is asked), down to PTX and the cubin that
Triton's bundled ptxas assembles; `ptxas -v` on the same PTX reports the registers per thread and
the spill stores and loads, and Triton's metadata the shared memory the launch reserves. The
shapes are those of a 4096-token row with 8 q heads over 2 kv heads (GQA 4): the constants the
kernels are specialized on. Compile seconds are Triton's (near 0 when its on-disk cache already
held the kernel). A table is printed as markdown and the rows are written as JSON
(default runs/aot/triton_lang_kernels.json). Exit status 0 when every configuration compiled.

`--lower CAPABILITY` instead lowers forward + backward of `tree_attention(impl="triton_lang")`
(bf16: GQA 4 with soft-cap, a window and sinks; MLA 192/128 with a prefix; inside `shard_map`) for
CUDA through `jax_triton.triton_call`, which compiles each kernel to PTX for that capability while
lowering; it runs as a worker with jax's CUDA plugin on its path (`make aot-plugins`; jax-triton
needs a jax with CUDA support to import) and writes the number of Triton kernel calls in the
lowered module.

What this does not show: speed, or that the kernels run on a GPU (never tried on one).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from jtree.kernels.attention import triton_lang

SEQ, Q_HEADS, KV_HEADS = 4096, 8, 2
HEAD_DIMS = (64, 128, 256)
DTYPES = ("bfloat16", "float32")
KERNELS = ("forward", "dq", "dkv")
# Pointer arguments that are neither q/k/v-typed nor int32: the float32 row statistics.
_FLOAT32_ARGS = {"lse_ptr", "delta_ptr"}
_OPERAND_ARGS = {"q_ptr", "k_ptr", "v_ptr", "o_ptr", "do_ptr", "dq_ptr", "dk_ptr", "dv_ptr"}
_TRITON_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def configurations() -> list[dict[str, Any]]:
    """Every (kernel, head_dim, dtype) with the default blocks and warps `triton_lang` runs."""
    rows = []
    for d in HEAD_DIMS:
        for dtype in DTYPES:
            block_q, block_kv = triton_lang.default_blocks(dtype, d)
            for kernel in KERNELS:
                rows.append(dict(kernel=kernel, head_dim=d, dtype=dtype, block_q=block_q,
                                 block_kv=block_kv, num_warps=4 if d <= 64 else 8, num_stages=2))
    return rows


def compile_one(kernel: str, head_dim: int, dtype: str, block_q: int, block_kv: int,
                num_warps: int, num_stages: int, capability: int) -> dict[str, Any]:
    """Compile one kernel for sm_`capability`; -> registers, spills, shared memory, seconds."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from jtree.kernels.attention import triton_lang_kernels

    fn = getattr(triton_lang_kernels, f"{kernel}_kernel")
    cfg = triton_lang.Config(head_dim ** -0.5, None, block_q, block_kv, None, num_warps,
                             num_stages, capability)
    n_q, n_kv = SEQ // block_q, SEQ // block_kv
    spec = triton_lang.launch_specs((1, SEQ, Q_HEADS, head_dim), (1, SEQ, KV_HEADS, head_dim),
                                    head_dim, jnp.dtype(dtype), cfg, n_kv, n_q)[kernel]
    signature = {}
    for name in fn.arg_names:
        if name in spec.constants:
            signature[name] = "constexpr"
        elif name in _OPERAND_ARGS:
            signature[name] = "*" + _TRITON_TYPES[dtype]
        elif name in _FLOAT32_ARGS:
            signature[name] = "*fp32"
        else:
            signature[name] = "*i32"
    start = time.perf_counter()
    compiled = triton.compile(ASTSource(fn, signature, constexprs=spec.constants),
                              target=GPUTarget("cuda", capability, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages,
                                           enable_fp_fusion=True))
    seconds = time.perf_counter() - start
    return dict(shared_bytes=int(compiled.metadata.shared), seconds=round(seconds, 1),
                **ptxas_usage(compiled.asm["ptx"], capability))


def ptxas_usage(ptx: str, capability: int) -> dict[str, Any]:
    """Registers per thread and spill bytes of `ptx`, from `ptxas -v` (the ptxas Triton uses for
    `capability`) for the PTX's own target line."""
    from triton.backends.nvidia import compiler as nvidia

    arch = re.search(r"^\.target\s+(\w+)", ptx, re.MULTILINE).group(1)
    ptxas = nvidia.get_ptxas(capability).path
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        done = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", str(source), "-o",
                               str(Path(tmp) / "kernel.cubin")], capture_output=True, text=True,
                              check=True)
    log = done.stdout + done.stderr
    number = lambda pattern: int(re.search(pattern, log).group(1))
    return dict(arch=arch, registers=number(r"Used (\d+) registers"),
                spill_stores=number(r"(\d+) bytes spill stores"),
                spill_loads=number(r"(\d+) bytes spill loads"))


def lower_forward_backward(capability: int, seq: int = 1024) -> dict[str, Any]:
    """Lower the gradient of a loss over `tree_attention(impl="triton_lang")` for CUDA from this
    host: bf16 GQA 4 head dim 64 with a soft-cap, a window and sinks; MLA (q/k 192, v 128,
    zero-padded to 256 around the kernels) with a prefix; forward + backward inside
    `shard_map` on a one-device mesh, as the train step calls attention; half the queries at a
    traced offset (context parallelism); -> per case the Triton
    kernel calls in the module, and the seconds all took."""
    import jax

    from jtree.kernels import TreeMask, tree_attention

    def struct(*shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype)

    def window_loss(q, k, v, end, positions, sinks):
        out = tree_attention(q, k, v, TreeMask(end, positions=positions, window=128),
                             impl="triton_lang", softcap=30.0, sinks=sinks,
                             compute_capability=capability)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    def mla_loss(q, k, v, prefix_k, prefix_v, end, prefix_end):
        out = tree_attention(q, k, v, TreeMask(end, prefix_end), impl="triton_lang",
                             prefix_k=prefix_k, prefix_v=prefix_v, compute_capability=capability)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    mesh = jax.make_mesh((1,), ("data",))
    rows = jax.NamedSharding(mesh, jax.P("data"))

    def sharded_loss(q, k, v, end):  # the train step's form: the kernels inside shard_map
        grads = jax.shard_map(lambda *a: jax.grad(plain_loss, argnums=(0, 1, 2))(*a),
                              mesh=mesh, in_specs=(jax.P("data"),) * 4,
                              out_specs=(jax.P("data"),) * 3)(q, k, v, end)
        return sum(jnp.sum(g.astype(jnp.float32)) for g in grads)

    def offset_loss(q, k, v, end, offset):  # context parallelism: a traced query offset
        out = tree_attention(q, k, v, TreeMask(end, query_offset=offset), impl="triton_lang",
                             compute_capability=capability)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    def plain_loss(q, k, v, end):
        out = tree_attention(q, k, v, TreeMask(end), impl="triton_lang",
                             compute_capability=capability)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    prefix = seq // 4
    cases = {
        "window+sinks": (window_loss, (0, 1, 2, 5), [
            struct(1, seq, Q_HEADS, 64), struct(1, seq, KV_HEADS, 64),
            struct(1, seq, KV_HEADS, 64), struct(1, seq, dtype=jnp.int32),
            struct(1, seq, dtype=jnp.int32), struct(Q_HEADS, dtype=jnp.float32)]),
        "mla 192/128 + prefix": (mla_loss, (0, 1, 2, 3, 4), [
            struct(1, seq, Q_HEADS, 192), struct(1, seq, KV_HEADS, 192),
            struct(1, seq, KV_HEADS, 128), struct(1, prefix, KV_HEADS, 192),
            struct(1, prefix, KV_HEADS, 128), struct(1, seq, dtype=jnp.int32),
            struct(1, prefix, dtype=jnp.int32)]),
        "shard_map": (sharded_loss, None, [
            jax.ShapeDtypeStruct((1, seq, h, 64), jnp.bfloat16, sharding=rows)
            for h in (Q_HEADS, KV_HEADS, KV_HEADS)]
            + [jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=rows)]),
        "context offset": (offset_loss, (0, 1, 2), [
            struct(1, seq // 2, Q_HEADS, 64), struct(1, seq, KV_HEADS, 64),
            struct(1, seq, KV_HEADS, 64), struct(1, seq, dtype=jnp.int32),
            struct(dtype=jnp.int32)]),
    }
    start = time.perf_counter()
    calls = {}
    for name, (loss, argnums, shapes) in cases.items():
        f = loss if argnums is None else jax.grad(loss, argnums=argnums)
        text = jax.jit(f).trace(*shapes).lower(
            lowering_platforms=("cuda",)).as_text()
        calls[name] = text.count("custom_call @triton_kernel_call")
    return dict(capability=capability, seq=seq, triton_calls=calls,
                seconds=round(time.perf_counter() - start, 1))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capabilities", type=int, nargs="+", default=[80, 90])
    parser.add_argument("--lower", type=int, default=None, metavar="CAPABILITY")
    parser.add_argument("--out", type=Path, default=Path("runs/aot/triton_lang_kernels.json"))
    args = parser.parse_args(argv)
    if args.lower is not None:
        result = lower_forward_backward(args.lower)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result))
        print(result)
        return 0
    results, failed = [], 0
    print("| target | kernel | head_dim | dtype | blocks | warps | registers | spills (st/ld B) "
          "| shared KiB | compile s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for capability in args.capabilities:
        for config in configurations():
            row = dict(capability=capability, **config)
            try:
                row.update(compile_one(capability=capability, **config))
            except Exception as error:  # noqa: BLE001 (a refusal is a result: reported, not raised)
                failed += 1
                row["error"] = str(error).strip().splitlines()[0][:200]
            results.append(row)
            print(describe(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"{len(results) - failed}/{len(results)} compiled; rows in {args.out}")
    return 1 if failed else 0


def describe(r: dict[str, Any]) -> str:
    head = (f"| sm_{r['capability']} | {r['kernel']} | {r['head_dim']} | {r['dtype']} | "
            f"{r['block_q']}x{r['block_kv']} | {r['num_warps']} | ")
    if "error" in r:
        return head + f"refused: {r['error']} | | | |"
    return head + (f"{r['registers']} | {r['spill_stores']}/{r['spill_loads']} | "
                   f"{r['shared_bytes'] / 1024:.1f} | {r['seconds']} |")


if __name__ == "__main__":
    sys.exit(main())
