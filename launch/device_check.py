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
  multiple, and a second case with a cached prefix and a soft-cap; in each dtype the kernel takes.
  On a GPU/TPU the Pallas kernels run natively; on CPU in their interpreters (Mosaic GPU in
  `jtree.launch.mgpu_interpret`'s own process). The Gated DeltaNet tree scan (sequential and
  parallel) against the recurrent reference run path by path. A tiny Qwen3 and Qwen3-Next loss
  and gradients on the device (attention `auto`) against the same model on the CPU backend
  (attention `xla`).
- **memory**: a Qwen3-0.6B step (`configs/qwen3_0.6b.yaml` at S 8192, one micro-batch; `--quick`:
  `configs/tiny.yaml` at 256) run once through the trainer: peak device memory
  (`memory_stats()['peak_bytes_in_use']`, absent on CPU) next to `jtree.memory_plan`'s prediction
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
- numerics: 16 attention rows (xla and Triton in 3 dtypes, Mosaic GPU in 2, x 2 cases), each one
  forward+backward compile of ~2-5 s on tiny shapes (the float32 reference compiles once per
  case), plus 5 GDN and 4 tiny-model compiles: ~2 min; the FLOPs are negligible (S 200);
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
Total about 7 minutes, under the 8 the docs' recipe allows (`timeout 480`).

    python -m jtree.launch.device_check --out device_out          # full check (GPU/TPU)
    python -m jtree.launch.device_check --quick --out device_out  # smallest sizes (2-core CPU: 2-5 min)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jtree.kernels import TreeMask, tree_attention
from jtree.kernels.gdn import gated_delta_rule_recurrent, tree_gated_delta_rule
from jtree.launch.harness import Column, Output, bench_parser, markdown_table, run_info
from jtree.linearize import linearize
from jtree.tree import TrajectoryTree

dispatch = importlib.import_module("jtree.kernels.tree_attention")  # the module: its registry
SECTIONS = ("info", "numerics", "memory", "speed")
DTYPES = ("float32", "bfloat16", "float16")
# Max |got - reference| / max |reference| allowed per dtype (the reference runs in float32 on the
# same rounded inputs). float32: the kernels' stated 1e-5 (docs/kernels.md) with room for another
# reduction order on a device; bf16/f16: the Mosaic GPU and pallas_tpu tests' 1e-2, which also
# holds the Triton kernel's 4 x 2^-8 (bf16) and 4 x 2^-11 (f16).
TOLERANCE = {"float32": 5e-5, "bfloat16": 2e-2, "float16": 1e-2}
# Tiny train steps, device vs the CPU backend in float32: relative L2 of the loss and of every
# gradient leaf (the model tests' 1e-5, widened for a device's reduction order and GPU kernels).
STEP_TOLERANCE = 1e-4
GDN_TOLERANCE = 1e-4  # max-scaled, float32, tree scan vs per-path recurrence
# Datasheet dense bf16 peaks (FLOP/s) by device kind, first match wins.
PEAK_BF16 = (
    (r"H100.*PCIe", 756e12), (r"\b(H100|H200|H800|GH200)\b", 989e12), (r"\bH20\b", 148e12),
    (r"A100", 312e12), (r"L40S", 362e12), (r"TPU v6", 918e12), (r"TPU v5p", 459e12),
    (r"TPU v5", 197e12), (r"TPU v4", 275e12),
)


def peak_flops(device_kind: str) -> float | None:
    """The device's datasheet dense bf16 FLOP/s, None when not in `PEAK_BF16`."""
    return next((peak for pattern, peak in PEAK_BF16 if re.search(pattern, device_kind)), None)


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


@dataclasses.dataclass
class Report:
    """Everything the check found, section by section; `failures` names the failed numerics."""

    platform: str
    sections: dict[str, Any] = dataclasses.field(default_factory=dict)
    failures: list[str] = dataclasses.field(default_factory=list)
    md: list[str] = dataclasses.field(default_factory=list)

    def run(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        """Run one section; an exception becomes the section's error (the others still run)."""
        t0 = time.perf_counter()
        try:
            result = fn()
        except Exception as error:  # the section's own failure must not stop the next one
            traceback.print_exc()
            result = {"error": first_line(error)}
            if name == "numerics":
                self.failures.append(f"numerics: {result['error']}")
        result["seconds"] = round(time.perf_counter() - t0, 1)
        self.sections[name] = result
        print(f"[{name}] done in {result['seconds']} s", flush=True)


def execution(impl: str, platform: str) -> str:
    """'native' or 'interpreted': the Pallas kernels run interpreted off their own platform."""
    native = {"pallas_tpu": "tpu", "pallas_mosaic_gpu": "gpu", "pallas_triton": "gpu"}
    return "interpreted" if impl in native and native[impl] != platform else "native"


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


def attention_layout(seq_len: int = 200) -> np.ndarray:
    """`end` [2, seq_len] of real tree rows: shared prompts branching into continuations, one path
    ending inside the tree (a sequence that is a prefix of another), several trees per row, and S
    not a multiple of any kernel's block. Each row starts with a tree's 40-token prompt (the
    prefix case caches it)."""
    rng = np.random.default_rng(0)
    trees = []
    for lens in ((30, 25, 12, 0), (20, 15), (25, 0, 10), (35,)):
        prompt = rng.integers(1, 50, 40).tolist()
        trees.append(TrajectoryTree.from_sequences(
            [prompt + rng.integers(1, 50, n).tolist() for n in lens]))
    return linearize(trees, seq_len, n_rows=2).inputs.mask.end


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    name: str
    prefix: int  # the first `prefix` tokens of every row are cached keys of an earlier part
    softcap: float | None


CASES = (AttentionCase("tree", 0, None), AttentionCase("prefix+softcap", 40, 30.0))
HEADS = (4, 2, 64)  # q heads, kv heads (GQA 2), head_dim: every kernel's limits allow it
# The Mosaic GPU interpreter simulates every warpgroup as its own XLA:CPU computation: minutes per
# case on a small CPU host, more than --quick's budget.
MGPU_QUICK_SKIP = ("skipped with --quick off a GPU (the Mosaic GPU interpreter takes minutes per "
                   "case; the full check or `python -m jtree.launch.mgpu_interpret` runs it)")


def value_and_grads(impl: str, q, k, v, end, d_out, case: AttentionCase,
                    **options: Any) -> list[jax.Array]:
    """[out, dq, dk, dv] (float32) of `tree_attention` on the layout [rows, P + S]: with a prefix
    P the keys [:P] are cached (`prefix_k`, `prefix_v`) and only [P:] are queries."""
    p = case.prefix

    def attend(q_own, k_own, v_own, prefix_k, prefix_v):
        mask = TreeMask(end[:, p:], end[:, :p]) if p else TreeMask(end)
        cached = dict(prefix_k=prefix_k, prefix_v=prefix_v) if p else {}
        return tree_attention(q_own, k_own, v_own, mask, impl=impl, softcap=case.softcap,
                              **cached, **options).astype(jnp.float32)

    out, pull = jax.vjp(attend, q[:, p:], k[:, p:], v[:, p:], k[:, :p], v[:, :p])
    dq, dk, dv, dpk, dpv = (g.astype(jnp.float32) for g in pull(d_out[:, p:]))
    return [out, dq, jnp.concatenate([dpk, dk], 1), jnp.concatenate([dpv, dv], 1)]


def errors(got: Sequence[Any], want: Sequence[Any]) -> dict[str, dict[str, float]]:
    """Per output: the max-scaled error max|got - want| / max|want| (what the tolerance bounds)
    and the largest element-wise relative error |got - want| / |want| over the elements above 1%
    of max|want| (below that the relative error of a near-zero value says nothing)."""
    result = {}
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = float(np.abs(b).max()) or 1.0
        big = np.abs(b) > 0.01 * scale
        rel = np.abs(a - b)[big] / np.abs(b)[big]
        result[name] = {"max_scaled": float(np.abs(a - b).max() / scale) if a.size else 0.0,
                        "max_elementwise_rel": float(rel.max()) if rel.size else 0.0}
    return result


def checked(row: dict[str, Any], compute: Callable[[], dict[str, dict[str, float]]],
            tolerance: float) -> dict[str, Any]:
    """Fill `row` with the errors `compute` returns (name -> {measure: value}; the first measure
    of each is the one bounded), its time and its verdict: every bounded error finite and within
    `tolerance`. An exception fails the row with its first line (the other rows still run)."""
    t0 = time.perf_counter()
    try:
        errs = compute()
        worst = max(next(iter(e.values())) for e in errs.values())
        row.update(errors=errs, worst=worst, tolerance=tolerance,
                   passed=bool(np.isfinite(worst) and worst <= tolerance))
    except Exception as error:
        row.update(error=first_line(error), passed=False)
    row["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"  {row['check']}: {'pass' if row['passed'] else 'FAIL'} "
          f"{row.get('worst', row.get('error'))} ({row['seconds']} s)", flush=True)
    return row


def impl_dtypes(platform: str, device_kind: str) -> dict[str, tuple[str, ...]]:
    """Implementation -> the dtypes it is checked in, on this platform."""
    impls = {"xla": DTYPES}
    if platform == "cpu":
        impls.update(cpu=("float32",), pallas_triton=DTYPES, pallas_tpu=("float32", "bfloat16"),
                     pallas_mosaic_gpu=("bfloat16", "float16"))
    elif platform == "gpu":
        impls.update(pallas_triton=DTYPES)
        if dispatch.gpu_impl(device_kind, jnp.bfloat16, 128) == "pallas_mosaic_gpu":  # Hopper
            impls["pallas_mosaic_gpu"] = ("bfloat16", "float16")
    elif platform == "tpu":  # no float16 on a TPU
        impls.update(xla=("float32", "bfloat16"), pallas_tpu=("float32", "bfloat16"))
    return impls


def _interpret_options(impl: str, platform: str) -> dict[str, Any]:
    if execution(impl, platform) == "native":
        return {}
    return {"interpret": True}  # pallas_triton and pallas_tpu: the Pallas interpreter


def _mgpu_interpreted(q, k, v, end, d_out, dtype: str, case: AttentionCase,
                      timeout: float = 1200.0) -> list[np.ndarray]:
    """The Mosaic GPU kernels in the Mosaic GPU interpreter, in `jtree.launch.mgpu_interpret`'s own
    process (it sizes XLA's CPU thread pool and can deadlock: docs/kernels.md)."""
    with tempfile.TemporaryDirectory() as tmp:
        inputs, outputs = Path(tmp) / "in.npz", Path(tmp) / "out.npz"
        np.savez(inputs, q=q, k=k, v=v, end=end, d_out=d_out, dtype=np.asarray(dtype),
                 softcap=np.asarray(np.nan if case.softcap is None else case.softcap),
                 block_kv=np.asarray(0), prefix=np.asarray(case.prefix))
        proc = subprocess.run([sys.executable, "-m", "jtree.launch.mgpu_interpret", str(inputs),
                               str(outputs)], capture_output=True, text=True, timeout=timeout)
        if proc.returncode:
            raise RuntimeError((proc.stderr.strip().splitlines() or ["no output"])[-1])
        with np.load(outputs) as got:
            if bool(got["races"]):
                raise RuntimeError("the Mosaic GPU interpreter found races")
            return [got[n] for n in ("out", "dq", "dk", "dv")]


def attention_numerics(platform: str, device_kind: str, impls: Sequence[str] | None,
                       quick: bool) -> list[dict[str, Any]]:
    """One row per (impl, dtype, case): errors against the float32 reference, pass/fail."""
    end = attention_layout()
    hq, hkv, d = HEADS
    rng = np.random.default_rng(1)
    shape = lambda h: (*end.shape, h, d)  # noqa: E731
    normal = [rng.normal(size=shape(h)).astype(np.float32) for h in (hq, hkv, hkv, hq)]
    # The oracle runs on the CPU backend (IEEE float32), whatever the device.
    reference = jax.jit(value_and_grads, static_argnames=("impl", "case"))
    cpu = jax.devices("cpu")[0]
    rows = []
    for impl, dtypes in impl_dtypes(platform, device_kind).items():
        if impls and impl not in impls:
            continue
        for dtype in dtypes[:1] if quick else dtypes:
            # Rounded to the dtype first, so the reference sees exactly the kernel's inputs.
            q, k, v, d_out = (np.asarray(jnp.asarray(x, dtype), np.float32) for x in normal)
            # The C++ `cpu` kernel has no soft-cap (it raises; docs/kernels.md). --quick runs
            # the last case an impl takes: every feature of the layout at once.
            cases = [c for c in CASES if impl != "cpu" or c.softcap is None]
            for case in cases[-1:] if quick else cases:
                row = {"check": f"attention {impl} {dtype} {case.name}", "impl": impl,
                       "dtype": dtype, "case": case.name, "execution": execution(impl, platform)}
                if impl == "pallas_mosaic_gpu" and platform != "gpu" and quick:
                    rows.append({**row, "passed": None, "skipped": MGPU_QUICK_SKIP})
                    continue

                def compute(impl=impl, dtype=dtype, case=case, q=q, k=k, v=v):
                    want = reference("reference", *jax.device_put((q, k, v, end, d_out), cpu),
                                     case)
                    if impl == "pallas_mosaic_gpu" and platform != "gpu":
                        return errors(_mgpu_interpreted(q, k, v, end, d_out, dtype, case), want)
                    cast = [jnp.asarray(x, dtype) for x in (q, k, v)]
                    run = functools.partial(value_and_grads, impl, case=case,
                                            **_interpret_options(impl, platform))
                    # float32 at full precision: a GPU's default (TF32) matmuls would hide
                    # nothing but cost 1e-3 of accuracy against the 5e-5 tolerance.
                    with (jax.default_matmul_precision("highest") if dtype == "float32"
                          else contextlib.nullcontext()):
                        got = jax.jit(run)(*cast, jnp.asarray(end), jnp.asarray(d_out))
                    return errors(got, want)

                rows.append(checked(row, compute, TOLERANCE[dtype]))
    return rows


def gdn_numerics() -> list[dict[str, Any]]:
    """The tree scans' loss and q/k/v/g/beta gradients against the recurrent reference run on
    every root-to-leaf path alone. Loss: sum over paths of <o_path, target>; on the tree each
    token's output is weighted by the number of paths through it, which is the same sum."""
    rng = np.random.default_rng(2)
    trees = [TrajectoryTree.from_sequences(
        [rng.integers(1, 50, 40 + 9 * i).tolist() + rng.integers(1, 50, n).tolist()
         for n in (0, 17, 30, 5)]) for i in range(2)]
    chunk, hk, hv, dk, dv = 8, 2, 4, 16, 8
    batch = linearize(trees, 256, gdn_chunk_size=chunk, n_rows=2)
    r, s = batch.shape
    f32 = np.float32
    args = (rng.normal(size=(r, s, hk, dk)).astype(f32),
            rng.normal(size=(r, s, hk, dk)).astype(f32),
            rng.normal(size=(r, s, hv, dv)).astype(f32),
            -rng.uniform(0.0, 1.5, size=(r, s, hv)).astype(f32),
            rng.uniform(size=(r, s, hv)).astype(f32))
    target = rng.normal(size=(r, s, hv, dv)).astype(f32)
    layout = batch.layout
    paths = [(row, t.path_token_index(p) + off)
             for t, row, off in zip(layout.trees, layout.rows, layout.offsets)
             for p in range(t.n_paths)]
    weight = np.zeros((r, s), f32)
    for row, path in paths:
        weight[row, path] += 1
    # Every path as one batch row [P, T], padded at its end with zero inputs (k = g = beta = 0
    # leave the state and the earlier outputs unchanged; their outputs are masked out).
    path_rows = np.asarray([row for row, _ in paths])[:, None]
    longest = max(len(path) for _, path in paths)
    idx = np.stack([np.pad(path, (0, longest - len(path)), constant_values=-1)
                    for _, path in paths])
    valid = idx >= 0
    gather = lambda x: jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 2)),  # noqa: E731
                                 x[path_rows, np.maximum(idx, 0)], 0)
    gdn = batch.inputs.gdn

    def path_loss(*xs):
        o, _ = gated_delta_rule_recurrent(*(gather(x) for x in xs))
        return jnp.sum(o * gather(target))

    on_cpu = jax.device_put(args, jax.devices("cpu")[0])  # the oracle runs on the CPU backend
    want = jax.jit(jax.grad(path_loss, argnums=range(5)))(*on_cpu)
    want_loss = float(jax.jit(path_loss)(*on_cpu))
    rows = []
    for scan in ("sequential", "parallel"):
        def tree_loss(*xs, scan=scan):
            o, _ = tree_gated_delta_rule(*xs, chunk_tokens=gdn.chunk_tokens,
                                         chunk_src=gdn.chunk_src, token_slot=gdn.token_slot,
                                         scan=scan)
            return jnp.sum(weight[:, :, None, None] * o * target)

        def compute(tree_loss=tree_loss):
            got = jax.jit(jax.grad(tree_loss, argnums=range(5)))(*args)
            errs = {name: errors([a], [b])["out"] for name, a, b in
                    zip(("dq", "dk", "dv", "dg", "dbeta"), got, want)}
            loss = float(jax.jit(tree_loss)(*args))
            errs["loss"] = {"rel": abs(loss - want_loss) / abs(want_loss)}
            return errs

        rows.append(checked({"check": f"gdn {scan} scan", "execution": "native"}, compute,
                            GDN_TOLERANCE))
    return rows


def tiny_models() -> dict[str, Any]:
    """A 2-layer Qwen3 and a Qwen3-Next (one Gated DeltaNet and one attention layer, MoE)."""
    from jtree.models import Qwen3Config, Qwen3NextConfig

    common = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, tie_word_embeddings=False,
                  rope_theta=10_000.0)
    return {"qwen3": Qwen3Config(intermediate_size=128, **common),
            "qwen3_next": Qwen3NextConfig(
                intermediate_size=96, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=32, mlp_only_layers=(1,), router_aux_loss_coef=0.5,
                output_router_logits=True, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=16,
                shared_expert_intermediate_size=48,
                layer_types=("linear_attention", "full_attention"), **common)}


def rel_l2(a: Any, b: Any) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def step_numerics(platform: str) -> list[dict[str, Any]]:
    """Loss and gradients of tiny models on the device (attention `auto`) against the CPU backend
    (attention `xla`), float32 at the highest matmul precision, on two rows of branching trees."""
    from flax import nnx

    from jtree.models import CausalLM, RuntimeConfig
    from jtree.synthetic import por_forest
    from jtree.train_step import Objective, make_grad_fn, stack_microbatches

    cpu = jax.devices("cpu")[0]
    rows = []
    for name, cfg in tiny_models().items():
        def compute(cfg=cfg):
            trees = por_forest(np.random.default_rng(3), 600, 0.6, path_len=100,
                               max_tree_tokens=256, vocab_size=cfg.vocab_size)
            chunk = 16 if cfg.decoder().needs_gdn_tables else None
            inputs = stack_microbatches([linearize(trees, 256, gdn_chunk_size=chunk, n_rows=4)])
            results = []
            for impl, where in (("auto", jax.devices()[0]), ("xla", cpu)):
                model = CausalLM(cfg, RuntimeConfig(attention_impl=impl), rngs=nnx.Rngs(0))
                graphdef, params = nnx.split(model)
                grad_fn = jax.jit(make_grad_fn(graphdef, Objective()))
                with jax.default_matmul_precision("highest"):
                    loss, _, grads = grad_fn(jax.device_put(params, where),
                                             jax.device_put(inputs, where))
                results.append((float(loss), jax.tree_util.tree_leaves(grads)))
            (loss_d, grads_d), (loss_c, grads_c) = results
            return {"loss": {"rel": abs(loss_d - loss_c) / abs(loss_c)},
                    "grads": {"worst_leaf_rel_l2": max(rel_l2(a, b) for a, b in
                                                       zip(grads_d, grads_c))}}

        auto = dispatch.resolve_impl("auto", platform, dtype=jnp.float32, head_dim=cfg.head_dim)
        rows.append(checked({"check": f"{name} step vs CPU backend", "execution": "native",
                             "device_attention": auto}, compute, STEP_TOLERANCE))
    return rows


def _elementwise(row: dict[str, Any]) -> str:
    rel = [e["max_elementwise_rel"] for e in row.get("errors", {}).values()
           if "max_elementwise_rel" in e]
    return f"{max(rel):.1e}" if rel else "-"


NUMERIC_COLUMNS = (
    Column("check", "check"), Column("execution", "execution"),
    Column("worst error", "worst", "{:.2e}"), Column("tolerance", "tolerance", "{:.0e}"),
    Column("max element-wise rel.", "errors", cell=lambda r: _elementwise(r)),
    Column("result", "passed", cell=lambda r: "skipped" if r.get("skipped") else
           "pass" if r.get("passed") else "FAIL"),
    Column("seconds", "seconds"), Column("error or note", "error",
                                         cell=lambda r: r.get("error") or r.get("skipped") or "-"),
)


def numerics(report: Report, args: Any) -> dict[str, Any]:
    kind = jax.devices()[0].device_kind
    rows = attention_numerics(report.platform, kind, args.impls, args.quick)
    if not args.impls:
        rows += gdn_numerics() + step_numerics(report.platform)
    report.failures += [r["check"] for r in rows if r["passed"] is False]  # None: skipped
    report.md += ["## numerics\n", "attention: max |got - ref| / max |ref| over out, dq, dk, dv "
                  "against the float32 reference; GDN: tree scans vs per-path recurrence; steps: "
                  "relative error of loss and gradients, device vs CPU backend\n",
                  markdown_table(rows, NUMERIC_COLUMNS), ""]
    return {"rows": rows, "tolerance": TOLERANCE, "step_tolerance": STEP_TOLERANCE}


# ----------------------------------------------------------------------------- memory


def memory(report: Report, args: Any) -> dict[str, Any]:
    """The trainer's step of a config, run once here, against `jtree.memory_plan` (XLA:CPU)."""
    from jtree.abstract_step import padding_step_inputs
    from jtree.config import load_config
    from jtree.trainer import Trainer

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


def dense_kernels(end: np.ndarray, heads: Any, platform: str
                  ) -> dict[str, tuple[Callable, Callable]]:
    """Dense attention given the tree mask as a [1, 1, S, S] boolean mask (built inside the jitted
    call from `end`, so no S x S constant is compiled in): jax's dense kernels here (cuDNN and XLA
    on a GPU, XLA elsewhere; the XLA one runs out of memory at long S and is reported so) and
    tokamax when installed."""
    from jtree.launch.bench_attention_gpu import _fwd_and_step

    end = jnp.asarray(end[0])
    scale = heads.dim ** -0.5

    def tree_mask() -> jax.Array:
        i = jnp.arange(end.shape[0])
        return ((i[None, :] <= i[:, None]) & (i[:, None] < end[None, :]))[None, None]

    def dense(impl: str) -> Callable:
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=tree_mask(),
                                                            scale=scale, implementation=impl)

    impls = ("cudnn", "xla") if platform == "gpu" else ("xla",)
    kernels = {f"dense_{impl}": _fwd_and_step(dense(impl)) for impl in impls}
    try:
        import tokamax
    except ImportError:
        return kernels
    kernels["dense_tokamax"] = _fwd_and_step(lambda q, k, v: tokamax.dot_product_attention(
        q, k, v, mask=tree_mask(), scale=scale))
    return kernels


def attention_speed(platform: str, quick: bool, repeats: int) -> list[dict[str, Any]]:
    from jtree.launch.bench_attention import Heads, packed_row
    from jtree.launch.bench_attention_gpu import (
        _inputs, attention_flops, time_kernels, tree_kernel, visible_pairs)

    heads = Heads(16, 8, 128)  # Qwen3-0.6B's attention
    dtype = jnp.float32 if platform == "cpu" else jnp.bfloat16
    rows = []
    for s in (512,) if quick else (8192, 16384, 32768):
        for por in (0.5,) if quick else (0.5, 0.9):
            end, trees = packed_row(por, s, seed=s + int(100 * por))
            pairs = visible_pairs(end, sum(t.n_tree_tokens for t in trees))
            kernels = {**tree_kernel("auto", end), **dense_kernels(end, heads, platform)}
            seconds, failed = time_kernels(kernels, _inputs(s, heads, dtype), repeats)
            row: dict[str, Any] = {"S": s, "por": por, "pairs": pairs, "failed": failed,
                                   "tree_impl": dispatch.resolve_impl(
                                       "auto", platform, dtype=dtype, head_dim=heads.dim),
                                   "execution": "native"}
            for run, t in seconds.items():
                kind = run.rsplit("_", 1)[1]
                row[f"{run}_ms"] = 1e3 * t
                row[f"{run}_tflops"] = attention_flops(pairs, heads, kind == "step") / t / 1e12
            for kind in ("fwd", "step"):
                dense = [n for n in seconds if n.startswith("dense") and n.endswith(kind)]
                if dense and f"tree_{kind}" in seconds:
                    best_dense = min(seconds[n] for n in dense)
                    row[f"speedup_{kind}"] = best_dense / seconds[f"tree_{kind}"]
            row["tokamax"] = "not installed" if not any("tokamax" in n for n in kernels) else "ran"
            rows.append(row)
            print(f"  attention S {s} POR {por}: {row.get('speedup_step')}", flush=True)
    return rows


def step_speed(platform: str, quick: bool, repeats: int) -> dict[str, Any]:
    """Tree vs baseline train step of a Qwen3-0.6B-shaped random model (bf16, S 8192), through
    `jtree.launch.bench`'s trainer batches; tokens/s (flat: the baseline's tokens) and MFU."""
    from jtree.cost import FlopModel, choose_mode
    from jtree.launch.bench import AUTO_MIN_GAIN, SHAPES, StepLoop, make_step, prepare
    from jtree.launch.harness import alternate
    from jtree.models import Qwen3Config
    from jtree.synthetic import por_forest

    if quick:
        cfg, seq_len, flat, path_len = SHAPES["tiny"], 256, 768, 96
    else:
        cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                          num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                          head_dim=128, tie_word_embeddings=True)
        # Baseline: 16k flat tokens in 2-3 rows (activations ~0.4 GiB per layer and row).
        seq_len, flat, path_len = 8192, 16384, 2048
    trees = por_forest(np.random.default_rng(5), flat, 0.7, path_len=path_len,
                       max_tree_tokens=seq_len, vocab_size=cfg.vocab_size)
    prep = {mode: prepare(trees, mode, seq_len) for mode in ("tree", "baseline")}
    fm = FlopModel.for_config(cfg)
    plans = {m: p.plan for m, p in prep.items()}
    choice = choose_mode(fm, trees, tree_tokens=plans["tree"].n_rows * plans["tree"].row_len,
                         baseline_tokens=plans["baseline"].n_rows * plans["baseline"].row_len,
                         min_gain=AUTO_MIN_GAIN)
    dtype = "float32" if platform == "cpu" else "bfloat16"
    step, state = make_step(cfg, "auto", dtype=dtype, scan_layers=not quick,
                            remat="none" if quick else "dots_no_batch")
    loop = StepLoop(state)
    runs = {mode: loop.run(step.lower(state, p.inputs).compile(), p.inputs)
            for mode, p in prep.items()}
    timings = alternate(runs, repeats)
    peak = peak_flops(jax.devices()[0].device_kind)
    flat_tokens = prep["baseline"].work.tokens
    result: dict[str, Any] = {"execution": "native", "dtype": dtype, "seq_len": seq_len,
                              "auto_mode": choice.mode, "auto_reason": choice.reason,
                              "speedup": timings.ratio("baseline", "tree")}
    for mode, p in prep.items():
        t = timings.median(mode)
        flops = fm.flops(p.work)
        result[mode] = {"ms": 1e3 * t, "rows": p.plan.n_rows, "row_len": p.plan.row_len,
                        "computed_tokens": p.work.tokens, "flat_tokens_per_s": flat_tokens / t,
                        "tflops": flops / t / 1e12,
                        "mfu": flops / t / peak if peak else "unknown"}
    return result


def gdn_speed(quick: bool, repeats: int) -> dict[str, Any]:
    """Forward+backward of the tree scan, parallel vs sequential, on Qwen3-Next's GDN shapes."""
    from jtree.launch.harness import alternate
    from jtree.synthetic import por_forest

    s, hk, hv, d, chunk = (512, 2, 4, 32, 64) if quick else (8192, 16, 32, 128, 64)
    trees = por_forest(np.random.default_rng(6), 3 * s, 0.7, path_len=s // 4,
                       max_tree_tokens=s, vocab_size=100)
    batch = linearize(trees, s, gdn_chunk_size=chunk)
    gdn = batch.inputs.gdn
    r = batch.shape[0]
    rng = np.random.default_rng(0)
    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    args = [jnp.asarray(rng.normal(size=(r, s, h, d)) / d ** 0.5, dtype) for h in (hk, hk, hv)]
    args += [jnp.asarray(-rng.uniform(0, 1, size=(r, s, hv)), dtype),
             jnp.asarray(rng.uniform(size=(r, s, hv)), dtype)]
    runs = {}
    for scan in ("sequential", "parallel"):
        def loss(*xs, scan=scan):
            o, _ = tree_gated_delta_rule(*xs, chunk_tokens=gdn.chunk_tokens,
                                         chunk_src=gdn.chunk_src, token_slot=gdn.token_slot,
                                         scan=scan)
            return jnp.sum(o.astype(jnp.float32))

        step = jax.jit(jax.grad(loss, argnums=range(5))).lower(*args).compile()
        runs[scan] = lambda step=step: step(*args)
    timings = alternate(runs, repeats)
    chunks = int((np.asarray(gdn.chunk_tokens) >= 0).any(-1).sum())
    return {"execution": "native", "rows": r, "S": s, "chunks": chunks,
            **{f"{scan}_ms": 1e3 * timings.median(scan) for scan in runs},
            "parallel_speedup": timings.ratio("sequential", "parallel")}


SPEED_COLUMNS = (
    Column("S", "S"), Column("POR", "por"), Column("tree impl", "tree_impl"),
    Column("tree fwd TFLOP/s", "tree_fwd_tflops", "{:.3g}"),
    Column("tree f+b TFLOP/s", "tree_step_tflops", "{:.3g}"),
    Column("speedup fwd", "speedup_fwd", "{:.2f}"), Column("speedup f+b", "speedup_step", "{:.2f}"),
    Column("tokamax", "tokamax"),
    Column("failed", "failed", cell=lambda r: "; ".join(f"{k}: {v[:80]}" for k, v in
                                                      r["failed"].items()) or "-"),
)


STEP_COLUMNS = (
    Column("mode", "mode"), Column("ms", "ms", "{:.1f}"), Column("rows", "rows"),
    Column("row length", "row_len"), Column("computed tokens", "computed_tokens"),
    Column("flat tokens/s", "flat_tokens_per_s", "{:.4g}"), Column("TFLOP/s", "tflops", "{:.3g}"),
    Column("MFU", "mfu", cell=lambda r: r["mfu"] if isinstance(r["mfu"], str)
           else f"{r['mfu']:.1%}"),
)


def speed(report: Report, args: Any) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for name, fn in (("attention", lambda: attention_speed(report.platform, args.quick,
                                                         args.repeats)),
                     ("train_step", lambda: step_speed(report.platform, args.quick, args.repeats)),
                     ("gdn", lambda: gdn_speed(args.quick, args.repeats))):
        try:
            result[name] = fn()
        except Exception as error:  # one failed part leaves the others
            traceback.print_exc()
            result[name] = {"error": first_line(error)}
    report.md.append("## speed (native)\n\nattention: TFLOP/s over visible pairs; speedup = best "
                     "dense time given the tree mask / tree time\n")
    if isinstance(result["attention"], list):
        report.md.append(markdown_table(result["attention"], SPEED_COLUMNS))
    step = result["train_step"]
    if "error" in step:
        report.md.append(f"\ntrain step: {step['error']}\n")
    else:
        report.md += [f"\ntrain step ({step['dtype']}, S {step['seq_len']}): tree speedup "
                      f"{step['speedup']:.2f}x; `run.mode=auto` picks {step['auto_mode']} "
                      f"({step['auto_reason']})\n",
                      markdown_table([{"mode": m, **step[m]} for m in ("tree", "baseline")],
                                     STEP_COLUMNS)]
    gdn = result["gdn"]
    report.md.append("\nGDN tree scan, forward+backward: " + (gdn.get("error") or (
        f"S {gdn['S']}, {gdn['chunks']} chunks: sequential {gdn['sequential_ms']:.1f} ms, "
        f"parallel {gdn['parallel_ms']:.1f} ms ({gdn['parallel_speedup']:.2f}x)")) + "\n")
    return result


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
