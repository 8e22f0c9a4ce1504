"""The numerics section of `jtree.launch.device_check`: every attention implementation the device runs
against the float32 reference, the Gated DeltaNet tree scans against the recurrence, and tiny
train steps on the device against the CPU backend; each row passes or fails against a stated
tolerance."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jtree.kernels import TreeMask, tree_attention
from jtree.kernels.gdn.delta_rule import gated_delta_rule_recurrent, tree_gated_delta_rule
from jtree.launch.bench.harness import Column, markdown_table
from jtree.launch.device_report import Report, dispatch, execution, first_line
from jtree.layout.linearize import linearize
from jtree.trees.tree import TrajectoryTree

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
    window: int | None = None  # sliding window along the path, with attention sinks (constants)
    dims: tuple[int, int] | None = None  # (q/k, v) head dims; None: HEADS' head_dim for both


# --quick runs the last case an impl takes, so the window case is not last.
CASES = (AttentionCase("tree", 0, None), AttentionCase("window+sinks", 0, None, window=24),
         AttentionCase("prefix+softcap", 40, 30.0))
# MLA (DeepSeek-V3's q/k head dim 192, v 128) with a cached prefix, for the kernels in
# `MLA_IMPLS`: the ones whose MLA path runs nowhere but on their device.
MLA = AttentionCase("mla+prefix", 40, None, dims=(192, 128))
MLA_IMPLS = ("mosaic_gpu_blackwell",)
SINKS = np.asarray([0.5, -1.0, 2.0, 0.0], np.float32)  # one logit per q head (HEADS[0])


def path_positions(end: Any) -> Any:
    """Every token's depth on its path (the keys it sees, minus one), from `end` alone (numpy
    or jax, like `end`)."""
    xp = np if isinstance(end, np.ndarray) else jnp
    i, j = xp.arange(end.shape[1])[:, None], xp.arange(end.shape[1])[None, :]
    return (((j <= i)[None] & (i[None] < end[:, None, :])).sum(-1) - 1).astype(xp.int32)


HEADS = (4, 2, 64)  # q heads, kv heads (GQA 2), head_dim: every kernel's limits allow it


# The Mosaic GPU interpreter simulates every warpgroup as its own XLA:CPU computation: minutes per
# case on a small CPU host, more than --quick's budget.
MGPU_QUICK_SKIP = ("skipped with --quick off a GPU (the Mosaic GPU interpreter takes minutes per "
                   "case; the full check or `python -m jtree.launch.bench.mgpu_interpret` runs it)")


def value_and_grads(impl: str, q, k, v, end, d_out, case: AttentionCase,
                    **options: Any) -> list[jax.Array]:
    """[out, dq, dk, dv] (float32) of `tree_attention` on the layout [rows, P + S]: with a prefix
    P the keys [:P] are cached (`prefix_k`, `prefix_v`) and only [P:] are queries."""
    p = case.prefix
    window = {}
    if case.window is not None:
        window = dict(positions=path_positions(end), window=case.window)
        options = dict(options, sinks=jnp.asarray(SINKS))

    def attend(q_own, k_own, v_own, prefix_k, prefix_v):
        mask = TreeMask(end[:, p:], end[:, :p], **window) if p else TreeMask(end, **window)
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


def attention_cases(impl: str) -> list[AttentionCase]:
    """The cases `impl` is checked on: `CASES` (the C++ `cpu` kernel has no soft-cap: it raises,
    docs/kernels.md), after `MLA` for the kernels in `MLA_IMPLS` (first, so that --quick still
    runs the last case: every feature of the layout at once)."""
    cases = [c for c in CASES if impl != "cpu" or c.softcap is None]
    return [MLA, *cases] if impl in MLA_IMPLS else cases


def impl_dtypes(platform: str, device_kind: str) -> dict[str, tuple[str, ...]]:
    """Implementation -> the dtypes it is checked in, on this platform."""
    impls = {"xla": DTYPES}
    if platform == "cpu":
        impls.update(cpu=("float32",), pallas_triton=DTYPES, pallas_tpu=("float32", "bfloat16"),
                     pallas_mosaic_gpu=("bfloat16", "float16"))
    elif platform == "gpu":  # both Triton kernels: `auto` runs triton_lang off Hopper/Blackwell
        impls.update(pallas_triton=DTYPES, triton_lang=DTYPES)
        if dispatch.gpu_impl(device_kind, jnp.bfloat16, 128) == "pallas_mosaic_gpu":  # Hopper
            impls["pallas_mosaic_gpu"] = ("bfloat16", "float16")
        if dispatch.is_blackwell(device_kind):  # the tcgen05 kernels (no interpreter runs them)
            impls["mosaic_gpu_blackwell"] = ("bfloat16", "float16")
    elif platform == "tpu":  # no float16 on a TPU
        impls.update(xla=("float32", "bfloat16"), pallas_tpu=("float32", "bfloat16"))
    return impls


def _interpret_options(impl: str, platform: str) -> dict[str, Any]:
    if execution(impl, platform) == "native":
        return {}
    return {"interpret": True}  # pallas_triton and pallas_tpu: the Pallas interpreter


def _mgpu_interpreted(q, k, v, end, d_out, dtype: str, case: AttentionCase,
                      timeout: float = 1200.0) -> list[np.ndarray]:
    """The Mosaic GPU kernels in the Mosaic GPU interpreter, in `jtree.launch.bench.mgpu_interpret`'s own
    process (it sizes XLA's CPU thread pool and can deadlock: docs/kernels.md)."""
    with tempfile.TemporaryDirectory() as tmp:
        inputs, outputs = Path(tmp) / "in.npz", Path(tmp) / "out.npz"
        window = ({} if case.window is None else
                  dict(window=np.asarray(case.window), positions=path_positions(end), sinks=SINKS))
        np.savez(inputs, q=q, k=k, v=v, end=end, d_out=d_out, dtype=np.asarray(dtype),
                 softcap=np.asarray(np.nan if case.softcap is None else case.softcap),
                 block_kv=np.asarray(0), prefix=np.asarray(case.prefix), **window)
        proc = subprocess.run([sys.executable, "-m", "jtree.launch.bench.mgpu_interpret", str(inputs),
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

    def operands(dims: tuple[int, int] | None) -> list[np.ndarray]:  # q, k, v, d_out
        rng = np.random.default_rng(1 if dims is None else 4)
        dk, dv = dims or (d, d)
        return [rng.normal(size=(*end.shape, h, x)).astype(np.float32)
                for h, x in ((hq, dk), (hkv, dk), (hkv, dv), (hq, dv))]

    normal = {dims: operands(dims) for dims in (None, MLA.dims)}
    # The oracle runs on the CPU backend (IEEE float32), whatever the device.
    reference = jax.jit(value_and_grads, static_argnames=("impl", "case"))
    cpu = jax.devices("cpu")[0]
    rows = []
    for impl, dtypes in impl_dtypes(platform, device_kind).items():
        if impls and impl not in impls:
            continue
        for dtype in dtypes[:1] if quick else dtypes:
            cases = attention_cases(impl)
            for case in cases[-1:] if quick else cases:
                # Rounded to the dtype first, so the reference sees exactly the kernel's inputs.
                q, k, v, d_out = (np.asarray(jnp.asarray(x, dtype), np.float32)
                                  for x in normal[case.dims])
                row = {"check": f"attention {impl} {dtype} {case.name}", "impl": impl,
                       "dtype": dtype, "case": case.name, "execution": execution(impl, platform)}
                if impl == "pallas_mosaic_gpu" and platform != "gpu" and quick:
                    rows.append({**row, "passed": None, "skipped": MGPU_QUICK_SKIP})
                    continue

                def compute(impl=impl, dtype=dtype, case=case, q=q, k=k, v=v, d_out=d_out):
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
    from jtree.config.architectures import Qwen3Config, Qwen3NextConfig

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

    from jtree.config.objective import Objective
    from jtree.config.runtime import RuntimeConfig
    from jtree.models import CausalLM
    from jtree.step.batches import stack_microbatches
    from jtree.step.train_step import make_grad_fn
    from jtree.trees.synthetic import por_forest

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
