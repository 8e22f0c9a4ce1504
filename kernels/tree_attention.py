"""Public entry point for attention under the tree mask, with implementation dispatch.

Every implementation reads the same one-int-per-token mask (`TreeMask`, `jtree.kernels.tree_mask`)
and computes softmax(q k^T * scale) v over the keys j with j <= i < end[j]. An implementation that
cannot honour the mask for given inputs raises; nothing falls back to plain causal attention.
With `TreeMask.real`, a block-sparse implementation may skip the query blocks without a real
query (the outputs of their queries are then unspecified but finite; real queries' outputs and
all gradients, given a zero cotangent on the non-real outputs, are the same).

Block-sparse implementations need S to be a multiple of their block sizes. The dispatch pads S with
tokens that attend only to themselves (end[j] = j + 1), which no real query can see (j <= i fails),
and drops them from the output, so padding never changes the result.

Prefix (redundancy-free partitioning): a part of a tree can attend to keys computed by earlier
parts. `prefix_k`, `prefix_v` [rows, P, Hkv, D] are laid out before the part's own keys and
the mask's `prefix_end` [rows, P] gives their subtree ends; `end` and `prefix_end` are in combined
coordinates (prefix key j at position j, own token i at position P + i), so the one rule
j <= i < end[j] still decides visibility while queries exist only for the own tokens. An
implementation without rectangular support raises ("prefix not supported"); every one `auto` picks
has it.

Context parallelism (a query offset, `TreeMask.query_offset`): q [rows, L, Hq, D] are the queries
at key positions offset + i of the whole row's k, v [rows, S, Hkv, D] (gathered over the
`context` mesh axis) and `mask.end` [rows, S] the ends of all keys; the call is the same
rectangular one, with the offset traced. Block tables come from the global `end` and the
queries' positions, so a kernel skips every key block no local query sees (all keys after the
device's last query, and every block outside the local queries' ancestors). An implementation
runs under it only where its registry entry says so (`context_parallel`); the others raise
naming the implementation and `mesh.context`.

Sliding window (`TreeMask.window` W with `TreeMask.positions`, the keys' path positions in the
layout of `key_end()`): query i also needs pos[i] - pos[j] < W. Attention sinks (`sinks` [Hq]
float): one logit per query head added to every softmax denominator, with no value
(`jtree.kernels.attention.flash_vjp`). An implementation takes either only where its registry entry says
so (`window`, `sinks`); the others raise naming the implementation and the option.

Multi-head latent attention (MLA: DeepSeek-V3, Kimi-K2): v (and `prefix_v`) may have a head dim
Dv other than q's and k's Dk; the output then has Dv and the default scale stays Dk**-0.5. An
implementation runs it only where its registry entry says so (`value_head_dim`); the others raise
naming the implementation and both dims, and `auto` picks only implementations that run it.

What `auto` runs (the table in docs/kernels.md): `pallas_tpu` on TPU; on a GPU the rule of
`gpu_impl` (Hopper's Mosaic kernel where wgmma takes the operands, the Triton-language kernel on
GPUs that are neither Hopper nor Blackwell, else the Pallas Triton kernel);
on CPU, among the kernels that can run the call (`cpu_candidates`: the C++ `cpu` kernel when it
builds and the call has no soft-cap, and `xla`), the faster one measured on the call's shape class
(`jtree.kernels.attention.calibration`: once per class and machine, kept on disk, logged); calls
too small to pay for a measurement, and calls with a prefix or a query offset, take the first
candidate.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jtree.kernels.attention import calibration as attention_calibration
from jtree.kernels.attention import cpu as attention_cpu
from jtree.kernels.attention import mgpu as attention_mgpu
from jtree.kernels.attention import mgpu_blackwell as attention_blackwell
from jtree.kernels.attention import tpu as attention_tpu
from jtree.kernels.attention import triton as attention_triton
from jtree.kernels.attention import triton_lang as attention_triton_lang
from jtree.kernels.attention import xla as attention_xla
from jtree.kernels.attention.reference import attention_reference
from jtree.kernels.tree_mask import TreeMask


class _Impl(NamedTuple):
    run: Callable[..., jax.Array]  # (q, k, v, end, *, scale, softcap, q_real, [q_pos], **options)
    padded_length: Callable[..., int] | None  # (S, **options) -> S' >= S it can run; None: any S
    # (Sq, Skv, **options) -> (Sq', Skv') for calls with a prefix (keyword `q_pos` of `run`);
    # None: the implementation does not support a prefix.
    padded_lengths: Callable[..., tuple[int, int]] | None = None
    # Whether it runs a query offset (context parallelism): the rectangular call with a traced
    # `q_pos`, checked against the reference on this machine (`triton_lang`'s kernels in Triton's
    # interpreter at a query window; the Mosaic GPU and Pallas Triton kernels are not yet).
    context_parallel: bool = False
    # Whether it runs a sliding window (`window`, `key_pos` keywords of `run`) and sinks (`sinks`).
    window: bool = False
    sinks: bool = False
    # Whether it runs a value head dim Dv other than the query/key head dim Dk (MLA).
    value_head_dim: bool = False
    # Whether it can be differentiated; one without a backward raises naming itself when it is,
    # and `auto` never picks it (a train step needs the backward).
    backward: bool = True
    # Whether its kernels are compiled while lowering, for the CUDA compute capability given as
    # `run`'s `compute_capability` keyword (jax-triton); the others are compiled by XLA, which
    # knows its target.
    compute_capability: bool = False


def _any_lengths(sq: int, skv: int, **_options) -> tuple[int, int]:
    return sq, skv


_IMPLS: dict[str, _Impl] = {
    "reference": _Impl(attention_reference, None, _any_lengths, context_parallel=True,
                       window=True, sinks=True, value_head_dim=True),
    "xla": _Impl(attention_xla.tree_attention_xla, attention_xla.padded_length,
                 attention_xla.padded_lengths, context_parallel=True, window=True, sinks=True,
                 value_head_dim=True),
    # The `xla` kernel's blocks and schedule, run by a multi-threaded C++ custom call (CPU only).
    "cpu": _Impl(attention_cpu.tree_attention_cpu, attention_xla.padded_length,
                 attention_xla.padded_lengths, context_parallel=True, window=True, sinks=True,
                 value_head_dim=True),
    "pallas_tpu": _Impl(attention_tpu.tree_attention_tpu, attention_tpu.padded_length,
                        attention_tpu.padded_lengths, context_parallel=True, window=True,
                        sinks=True, value_head_dim=True),
    "pallas_mosaic_gpu": _Impl(attention_mgpu.attention_mgpu, attention_mgpu.padded_length,
                               attention_mgpu.padded_lengths, window=True, sinks=True),
    "pallas_triton": _Impl(attention_triton.tree_attention_triton, attention_triton.padded_length,
                           attention_triton.padded_lengths, window=True, sinks=True,
                           value_head_dim=True),
    # Blackwell (tcgen05, tensor memory): forward and backward, MLA's 192 / 128 head dims
    # among its `HEAD_DIMS`; `auto` picks it on Blackwell.
    "mosaic_gpu_blackwell": _Impl(attention_blackwell.attention_blackwell,
                                  attention_blackwell.padded_length,
                                  attention_blackwell.padded_lengths, window=True, sinks=True,
                                  value_head_dim=True),
    # Triton-language kernels through jax-triton (the `gpu` extra): `auto` on GPUs that are
    # neither Hopper nor Blackwell.
    "triton_lang": _Impl(attention_triton_lang.tree_attention_triton_lang,
                         attention_triton_lang.padded_length, attention_triton_lang.padded_lengths,
                         context_parallel=True, window=True, sinks=True, value_head_dim=True,
                         compute_capability=True),
}

# NVIDIA Hopper (sm_90) device kinds: the GPUs with wgmma, which the Mosaic kernel is built on
# (Blackwell replaced it with tcgen05). jax reports e.g. "NVIDIA H100 80GB HBM3", "NVIDIA GH200
# 480GB", "NVIDIA H20".
_HOPPER = re.compile(r"\b(GH200|H100|H200|H800|H20)\b")
# NVIDIA datacenter Blackwell (sm_100) device kinds: the GPUs with tcgen05 and tensor memory
# ("NVIDIA B200", "NVIDIA GB200", "NVIDIA B300 SXM6 AC"); the consumer RTX 50 series (sm_120)
# has neither.
_BLACKWELL = re.compile(r"\b(GB200|GB300|B200|B300)\b")

log = logging.getLogger(__name__)


def available_impls() -> tuple[str, ...]:
    return ("auto",) + tuple(_IMPLS)


def gpu_impl(device_kind: str, dtype: Any, head_dim: int, value_head_dim: int | None = None) -> str:
    """What `auto` runs on the GPU `device_kind` for operands of `dtype` and `head_dim` (q, k)
    and `value_head_dim` (v; default `head_dim`).

    Hopper with bf16/f16 operands and a head_dim whose forward and backward fit shared memory (64,
    128): the Mosaic GPU kernel (wgmma, TMA, warp specialization). Blackwell with the operands
    `mosaic_gpu_blackwell` takes (bf16/f16, q/k and v head dims 64 / 64, 128 / 128 or MLA's
    192 / 128): that kernel (tcgen05, tensor memory), forward and backward. Every other GPU
    (Ampere, Ada, consumer Blackwell...), any dtype: the Triton-language kernel through
    jax-triton (`triton_lang`: the `gpu` extra), whose full sharded train step XLA:GPU compiles
    for sm_80 (docs/memory.md). The operands Hopper's and Blackwell's own kernels cannot take:
    the Pallas Triton kernel. Both Triton kernels raise ValueError naming their (shared) limits
    for operands they cannot run. Never the `xla` fallback: a GPU always gets a GPU kernel or an
    error. Prefix calls and soft-caps do not change the choice: both kernels take them. MLA calls
    (value head dim != head_dim) go to a Mosaic kernel only if its registry entry runs them.
    """
    mla = _is_mla(head_dim, value_head_dim)
    if (_HOPPER.search(device_kind) and attention_mgpu.handles(dtype, head_dim)
            and (not mla or _IMPLS["pallas_mosaic_gpu"].value_head_dim)):
        return "pallas_mosaic_gpu"
    if (is_blackwell(device_kind) and attention_blackwell.handles(dtype, head_dim, value_head_dim)
            and (not mla or _IMPLS["mosaic_gpu_blackwell"].value_head_dim)
            and _IMPLS["mosaic_gpu_blackwell"].backward):
        return "mosaic_gpu_blackwell"
    if not (_HOPPER.search(device_kind) or is_blackwell(device_kind)):
        return "triton_lang"
    return "pallas_triton"


def is_blackwell(device_kind: str) -> bool:
    """Whether `device_kind` is a datacenter Blackwell GPU (sm_100: tcgen05, tensor memory)."""
    return bool(_BLACKWELL.search(device_kind))


def has_backward(impl: str) -> bool:
    """Whether implementation `impl` can be differentiated (its registry entry's `backward`)."""
    return _IMPLS[impl].backward


def _is_mla(head_dim: int | None, value_head_dim: int | None) -> bool:
    """Whether v's head dim differs from q/k's (MLA); None: the same as q/k's."""
    return value_head_dim is not None and value_head_dim != head_dim


def resolve_impl(impl: str, backend: str | None = None, *, dtype: Any = None,
                 head_dim: int | None = None, softcap: float | None = None,
                 device_kind: str | None = None,
                 shape: tuple[int, int, int, int] | None = None,
                 value_head_dim: int | None = None) -> str:
    """Map `auto` to the implementation for `backend` (default: jax's default backend; lowering
    for another platform must name it), the operand `dtype` and `head_dim`, the soft-cap and
    `value_head_dim` (v's head dim, default `head_dim`; MLA when they differ).

    On a GPU `dtype` and `head_dim` are required (`gpu_impl`); `device_kind` defaults to the
    first local device's and must be given when resolving for a GPU from a host without one.
    On CPU, `shape` = (rows, S, q heads, kv heads) of the call (with `dtype` and `head_dim`)
    lets `auto` pick the faster of `cpu_candidates` by measurement (`calibrated_cpu_impl`);
    without it, or for a call of fewer than `attention_calibration.MIN_TOKENS` tokens, `auto`
    takes the first candidate."""
    if impl not in available_impls():
        raise ValueError(f"attention impl {impl!r} is not one of {available_impls()}")
    if impl != "auto":
        return impl
    backend = backend or jax.default_backend()
    if backend == "tpu":
        return "pallas_tpu"
    if backend == "cpu":
        mla = _is_mla(head_dim, value_head_dim)
        candidates = cpu_candidates(softcap, mla)
        if (shape is None or dtype is None or head_dim is None or len(candidates) == 1
                or shape[0] * shape[1] < attention_calibration.MIN_TOKENS):
            return candidates[0]
        return calibrated_cpu_impl(attention_calibration.ShapeClass.of(
            "cpu", dtype, shape[0], shape[1], shape[2], shape[3], head_dim,
            value_head_dim or head_dim), candidates)
    if backend != "gpu":
        return "xla"  # the portable block-sparse kernel: the same masked attention everywhere
    if dtype is None or head_dim is None:
        raise ValueError("attention impl 'auto' on a GPU needs the operands' dtype and head_dim")
    if device_kind is None:
        if jax.default_backend() != "gpu":
            raise ValueError("attention impl 'auto' for a GPU from a host without one needs the "
                             "target's device_kind (e.g. 'NVIDIA H100 80GB HBM3')")
        device_kind = jax.devices()[0].device_kind
    return gpu_impl(device_kind, dtype, head_dim, value_head_dim)


@functools.cache
def _auto_on_cpu() -> str:
    """`cpu` when the C++ kernel builds on this machine, else `xla`; decided (and logged) once per
    process, since the answer only changes when a compiler is installed."""
    error = attention_cpu.build_error()
    if error is None:
        log.info("tree attention: 'auto' runs the 'cpu' kernel on the CPU backend (the "
                 "multi-threaded C++ kernel built) for calls it does not measure; calls of at "
                 "least %d tokens run the faster of 'cpu' and 'xla', measured once per shape "
                 "class and machine (kept in %s)", attention_calibration.MIN_TOKENS,
                 attention_calibration.store_dir())
        return "cpu"
    log.warning("tree attention: 'auto' runs 'xla' on the CPU backend, the slower kernel, "
                "because the C++ 'cpu' kernel cannot be built: %s", error.splitlines()[0])
    return "xla"


def cpu_candidates(softcap: float | None, mla: bool = False) -> tuple[str, ...]:
    """The kernels `auto` may run on the CPU backend, the static choice first: `cpu` and `xla`
    when the C++ kernel builds and the call has no soft-cap (which `cpu` does not take) and, for
    an MLA call (`mla`: value head dim != query/key head dim), `cpu` runs MLA; else `xla` alone.
    Never a kernel that cannot run the call."""
    if (softcap is not None or (mla and not _IMPLS["cpu"].value_head_dim)
            or _auto_on_cpu() != "cpu"):
        return ("xla",)
    return ("cpu", "xla")


# A cache on purpose, in front of the on-disk store of `attention_calibration.decide`: the
# decision is made once per shape class and process, and every later call of the class runs the
# kernel it picked, so a run never switches kernels midway; the store makes a resume and a second
# run on the same machine pick the same one (results stay bitwise reproducible).
# `calibrated_cpu_impl.cache_clear()` forgets the process's choices (not the stored ones).
@functools.lru_cache(maxsize=None)
def calibrated_cpu_impl(shape: attention_calibration.ShapeClass,
                        candidates: tuple[str, ...]) -> str:
    """The faster of `candidates` (forward + backward) on `shape`'s representative call, as
    stored for this machine or measured now (`attention_calibration.decide`), ties to the earlier
    candidate; one log line says the choice, the times and whether it was measured now or read
    from the store (which file)."""
    def run(name, q, k, v, end):
        return tree_attention(q, k, v, TreeMask(end), impl=name)

    builds = {"cpu": attention_cpu.build_key()} if "cpu" in candidates else {}
    decision = attention_calibration.decide(shape, candidates, run, builds)
    rows, seq = shape.representative()
    log.info("tree attention: 'auto' runs %r for %s (forward+backward at %d x %d: %s; %s)",
             decision.choice, shape.describe(), rows, seq,
             ", ".join(f"{n} {t * 1e3:.1f} ms" for n, t in decision.times.items()),
             decision.origin)
    return decision.choice


def tree_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: TreeMask,
    *,
    impl: str = "auto",
    scale: float | None = None,
    softcap: float | None = None,
    prefix_k: jax.Array | None = None,
    prefix_v: jax.Array | None = None,
    sinks: jax.Array | None = None,
    compute_capability: int | None = None,
    **options: Any,
) -> jax.Array:
    """Attention of q [rows, S, Hq, Dk] over k [rows, S, Hkv, Dk], v [rows, S, Hkv, Dv] under the
    tree mask `mask`; the output is [rows, S, Hq, Dv]. Dv != Dk is MLA (module docstring).

    GQA: Hkv must divide Hq; query head h reads kv head h // (Hq // Hkv). `scale` defaults to
    Dk**-0.5; `softcap` applies cap * tanh(score / cap) before the softmax. `options` go to the
    implementation (e.g. `block_q`, `block_kv` for `xla` and `pallas_tpu`, `interpret` for
    `pallas_tpu`). `mask.end` [rows, S] int32 must satisfy j < end[j] <= S (checked when it is a
    host array).

    With a prefix (`prefix_k` [rows, P, Hkv, Dk], `prefix_v` [rows, P, Hkv, Dv] and
    `mask.prefix_end` [rows, P]; see the module docstring), the mask is in combined coordinates: P +
    i < end[i] <= P + S and j < prefix_end[j] <= P + S. With `mask.query_offset` (context
    parallelism), q holds L <= S queries at key positions offset + i and k, v, `mask.end` the whole
    row's S keys.
    `mask.real` [rows, queries] bool marks the real queries (see the module docstring).
    `mask.window` (with `mask.positions`) adds the sliding window along the path; `sinks` [Hq]
    (float) the per-head attention-sink logits. `compute_capability` (e.g. 80) is the CUDA target
    of an implementation compiled while lowering (registry `compute_capability`: `triton_lang`),
    needed to lower it on a host without a GPU; the others ignore it (XLA compiles them for the
    devices it compiles for).
    """
    if not isinstance(mask, TreeMask):
        raise TypeError(f"mask: expected a jtree.kernels.TreeMask, got {type(mask).__name__}")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [rows, S, heads, head_dim]; got {q.shape}, {k.shape}, {v.shape}")
    windowed = mask.query_offset is not None
    if (k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]
            or (q.shape[1] > k.shape[1] if windowed else q.shape[1] != k.shape[1])):
        raise ValueError(f"shape mismatch: q {q.shape}, k {k.shape}, v {v.shape}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"GQA: kv heads ({k.shape[2]}) must divide q heads ({q.shape[2]})")
    if mask.end.shape != k.shape[:2]:
        raise ValueError(f"end: shape {mask.end.shape} does not match k's [rows, S] {k.shape[:2]}")
    if mask.real is not None and tuple(mask.real.shape) != q.shape[:2]:
        raise ValueError(f"real: shape {tuple(mask.real.shape)} does not match q's [rows, S] "
                         f"{q.shape[:2]}")
    if scale is None:
        scale = q.shape[3] ** -0.5
    if sinks is not None:
        if tuple(jnp.shape(sinks)) != (q.shape[2],):
            raise ValueError(f"sinks: shape {tuple(jnp.shape(sinks))}, expected [Hq] = "
                             f"({q.shape[2]},)")
        options["sinks"] = sinks
    if compute_capability is not None:
        options["compute_capability"] = compute_capability
    if windowed:
        mask.check()
        name = resolve_impl(impl, dtype=q.dtype, head_dim=q.shape[3], softcap=softcap,
                            value_head_dim=v.shape[3])
        if not _IMPLS[name].context_parallel:
            supported = ", ".join(repr(n) for n, i in _IMPLS.items()
                                  if i.context_parallel and n != "reference")
            raise ValueError(f"attention impl {name!r} does not run under context parallelism "
                             f"(mesh.context > 1): set runtime.attention_impl to one of "
                             f"{supported}, or mesh.context=1")
        _check_options(name, mask, options, q.shape[3], v.shape[3])
        return _rectangular(q, k, v, mask, name, scale=scale, softcap=softcap, **options)
    if mask.prefix_end is not None or prefix_k is not None or prefix_v is not None:
        return _with_prefix(q, k, v, mask, prefix_k, prefix_v, impl=impl, scale=scale,
                            softcap=softcap, **options)
    mask.check()
    name = resolve_impl(impl, dtype=q.dtype, head_dim=q.shape[3], softcap=softcap,
                        shape=(q.shape[0], q.shape[1], q.shape[2], k.shape[2]),
                        value_head_dim=v.shape[3])
    _check_options(name, mask, options, q.shape[3], v.shape[3])
    chosen = _IMPLS[name]
    s = q.shape[1]
    target = s if chosen.padded_length is None else chosen.padded_length(s, **options)
    end, _ = mask.padded(target, target)
    q_real = mask.padded_real(target)
    options.update(_window_options(mask, target))
    if target == s:
        return chosen.run(q, k, v, end, scale=scale, softcap=softcap, q_real=q_real, **options)
    width = ((0, 0), (0, target - s), (0, 0), (0, 0))
    out = chosen.run(jnp.pad(q, width), jnp.pad(k, width), jnp.pad(v, width), end, scale=scale,
                     softcap=softcap, q_real=q_real, **options)
    return out[:, :s]


def _with_prefix(q, k, v, mask: TreeMask, prefix_k, prefix_v, *, impl: str, scale: float,
                 softcap: float | None, **options: Any) -> jax.Array:
    """Own queries over [prefix keys | own keys] (see the module docstring)."""
    if prefix_k is None or prefix_v is None or mask.prefix_end is None:
        raise ValueError("prefix: give all of prefix_k, prefix_v and mask.prefix_end, or none")
    rows, s = q.shape[:2]
    p = prefix_k.shape[1]
    if (prefix_k.shape[:3] != prefix_v.shape[:3] or prefix_k.shape[0] != rows
            or prefix_k.shape[2:] != k.shape[2:] or prefix_v.shape[2:] != v.shape[2:]):
        raise ValueError(f"prefix_k, prefix_v must be [rows, P, Hkv, Dk], [rows, P, Hkv, Dv] = "
                         f"[{rows}, P, {k.shape[2]}, {k.shape[3]}], [.., {v.shape[3]}]; got "
                         f"{prefix_k.shape}, {prefix_v.shape}")
    if mask.prefix_end.shape != (rows, p):
        raise ValueError(f"prefix_end: shape {mask.prefix_end.shape} does not match prefix_k's "
                         f"[rows, P] {(rows, p)}")
    mask.check()
    name = resolve_impl(impl, dtype=q.dtype, head_dim=q.shape[3], softcap=softcap,
                        value_head_dim=v.shape[3])
    if _IMPLS[name].padded_lengths is None:
        raise ValueError(f"attention impl {name!r}: prefix not supported (it cannot attend to "
                         "cached keys of earlier parts; use 'xla' or 'reference')")
    _check_options(name, mask, options, q.shape[3], v.shape[3])
    return _rectangular(q, jnp.concatenate([prefix_k, k], axis=1),
                        jnp.concatenate([prefix_v, v], axis=1), mask, name, scale=scale,
                        softcap=softcap, **options)


def _rectangular(q, k, v, mask: TreeMask, name: str, *, scale: float, softcap: float | None,
                 **options: Any) -> jax.Array:
    """Queries q [rows, Sq] at the key positions the mask gives them (after a prefix, or at a
    query offset) over all keys k, v [rows, Skv], padded to the kernel's lengths."""
    chosen = _IMPLS[name]
    s, skv_real = q.shape[1], k.shape[1]
    sq, skv = chosen.padded_lengths(s, skv_real, **options)
    end, q_pos = mask.padded(sq, skv, queries=s)
    kv_width = ((0, 0), (0, skv - skv_real), (0, 0), (0, 0))
    k, v = jnp.pad(k, kv_width), jnp.pad(v, kv_width)
    q = jnp.pad(q, ((0, 0), (0, sq - s), (0, 0), (0, 0)))
    out = chosen.run(q, k, v, end, scale=scale, softcap=softcap, q_pos=q_pos,
                     q_real=mask.padded_real(sq), **options, **_window_options(mask, skv))
    return out[:, :s]


def _check_options(name: str, mask: TreeMask, options: dict, head_dim: int,
                   value_head_dim: int) -> None:
    """Raise if implementation `name` cannot run the mask's window, the call's sinks or its value
    head dim; drop a compute capability it does not take."""
    chosen = _IMPLS[name]
    if not chosen.compute_capability:
        options.pop("compute_capability", None)
    if value_head_dim != head_dim and not chosen.value_head_dim:
        supported = ", ".join(repr(n) for n, i in _IMPLS.items() if i.value_head_dim)
        raise ValueError(f"attention impl {name!r}: value head dim {value_head_dim} != query/key "
                         f"head dim {head_dim} (MLA) not supported; use one of {supported}")
    if mask.window is not None and not chosen.window:
        supported = ", ".join(repr(n) for n, i in _IMPLS.items() if i.window)
        raise ValueError(f"attention impl {name!r}: sliding window (TreeMask.window) not "
                         f"supported; use one of {supported}")
    if options.get("sinks") is not None and not chosen.sinks:
        supported = ", ".join(repr(n) for n, i in _IMPLS.items() if i.sinks)
        raise ValueError(f"attention impl {name!r}: attention sinks not supported; use one of "
                         f"{supported}")


def _window_options(mask: TreeMask, skv: int) -> dict:
    """The `window` and `key_pos` keywords of an implementation's `run` ({} without a window)."""
    if mask.window is None:
        return {}
    return {"window": mask.window, "key_pos": mask.padded_positions(skv)}
