"""Model FLOP utilization (MFU) of a training step: the model FLOPs it does, the FLOP/s it
achieves, and what the same device gives a plain matmul.

The ratio a step benchmark reports (tree vs per-path baseline) hides how fast the model code is,
since both sides run the same code. MFU says it: achieved model FLOP/s over what the device can
do. Two denominators:

- **same-process matmul** (`matmul_probe`): one `[M, K] x [K, N]` float matmul at the step's
  dominant shape (its tokens x hidden x the MLP width), jitted and timed in the same process, on
  the same device, ideally in the same alternating rounds as the step (`jtree.launch.bench.harness`).
  On a shared CPU this is the only fair ceiling: the load both see is the same.
- **datasheet peak** (`datasheet_peak`, GPU/TPU only): the vendor's dense peak for the device
  kind and dtype, from the table `PEAKS` (sources named there).

Model FLOPs (`model_flops`) follow the usual MFU convention: forward matmul FLOPs x 3 (forward,
input gradient, weight gradient), no recomputation counted, on the work the step really needs
(computed tokens, visible (query, key) pairs, scored tokens; padding and masked-out blocks are
not model FLOPs). `jtree.layout.flop_model.FlopModel` counts the implementation's passes instead
(3.5 for flash attention, 4 for the chunked loss); `model_flops` rescales them to 3.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jtree.layout.flop_model import (
    ATTENTION_PASSES,
    LOSS_PASSES,
    PROJECTION_PASSES,
    FlopModel,
    Work,
)

MODEL_PASSES = 3.0  # forward, input gradient, weight gradient


def model_flops(fm: FlopModel, work: Work) -> float:
    """Model FLOPs of a training step doing `work`: forward matmul FLOPs x `MODEL_PASSES`."""
    return (fm.per_token * MODEL_PASSES / PROJECTION_PASSES * work.tokens
            + fm.per_pair * MODEL_PASSES / ATTENTION_PASSES * work.pairs
            + fm.per_scored * MODEL_PASSES / LOSS_PASSES * work.scored)


# ----------------------------------------------------------------------------- matmul probe


@dataclasses.dataclass(frozen=True)
class MatmulShape:
    """A plain matmul [m, k] x [k, n] in `dtype`."""

    m: int
    k: int
    n: int
    dtype: str = "float32"

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n

    def describe(self) -> str:
        return f"[{self.m}, {self.k}] x [{self.k}, {self.n}] {self.dtype}"


def dominant_shape(tokens: int, cfg: Any, dtype: str = "float32",
                   max_tokens: int = 16384) -> MatmulShape:
    """The step's dominant matmul: its tokens (at most `max_tokens`, so a probe call stays
    short) x hidden x the widest per-token projection (the MLP's intermediate size, or the
    experts' for MoE-only configs)."""
    width = getattr(cfg, "intermediate_size", 0) or getattr(cfg, "moe_intermediate_size", 0)
    return MatmulShape(max(1, min(tokens, max_tokens)), cfg.hidden_size,
                       max(width, cfg.hidden_size), dtype)


def matmul_call(shape: MatmulShape) -> Callable[[], jax.Array]:
    """A zero-argument call running the compiled matmul of `shape` once (inputs placed once)."""
    dtype = jnp.dtype(shape.dtype)
    a = jax.random.normal(jax.random.key(0), (shape.m, shape.k), dtype)
    b = jax.random.normal(jax.random.key(1), (shape.k, shape.n), dtype)
    compiled = jax.jit(jnp.matmul).lower(a, b).compile()
    return lambda: compiled(a, b)


def matmul_probe(shape: MatmulShape, repeats: int = 5) -> float:
    """FLOP/s of the plain matmul `shape` here and now: the median of `repeats` timed calls after
    one warm-up call. For a fair MFU, time it in the same rounds as the step instead (the benches
    add `matmul_call` as a variant of `jtree.launch.bench.harness.alternate`); this is for one-off use
    (the trainer's summary)."""
    call = matmul_call(shape)
    jax.block_until_ready(call())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - t0)
    return shape.flops / float(np.median(times))


# ----------------------------------------------------------------------------- datasheet peaks

# Dense (no sparsity) peak FLOP/s per chip by dtype. Sources: NVIDIA H100 Tensor Core GPU
# datasheet (SXM column: FP32 67 TF, TF32 495 TF, BF16/FP16 989 TF; PCIe: 51 / 378 / 756) and
# NVIDIA H200 datasheet (SXM, same compute as H100 SXM); Google Cloud TPU documentation, system
# architecture pages (bf16 per chip: v5e 197 TF, v5p 459 TF, v6e 918 TF). TPUs have no float32
# matmul peak of their own (float32 matmuls run as bf16 passes); they get none here.
# Entries are (substring of the device kind, lowercase; {dtype: FLOP/s}); the first match wins,
# so more specific kinds come first.
PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("h100 pcie", {"float32": 51e12, "tf32": 378e12, "bfloat16": 756e12, "float16": 756e12}),
    ("h100", {"float32": 67e12, "tf32": 495e12, "bfloat16": 989e12, "float16": 989e12}),
    ("h200", {"float32": 67e12, "tf32": 495e12, "bfloat16": 989e12, "float16": 989e12}),
    ("tpu v5 lite", {"bfloat16": 197e12}),
    ("tpu v5e", {"bfloat16": 197e12}),
    ("tpu v5p", {"bfloat16": 459e12}),
    ("tpu v5", {"bfloat16": 459e12}),
    ("tpu v6 lite", {"bfloat16": 918e12}),
    ("tpu v6e", {"bfloat16": 918e12}),
)


def datasheet_peak(device_kind: str, dtype: str) -> float | None:
    """The datasheet's dense peak FLOP/s of one `device_kind` chip (jax's `Device.device_kind`)
    for matmuls in `dtype`, or None when the table has no entry (every CPU)."""
    kind = device_kind.lower()
    for key, peaks in PEAKS:
        if key in kind:
            return peaks.get(jnp.dtype(dtype).name)
    return None


# ----------------------------------------------------------------------------- one step's MFU


@dataclasses.dataclass(frozen=True)
class Utilization:
    """A step's model FLOPs, its achieved FLOP/s and the two ceilings."""

    model_flops: float
    step_s: float
    matmul_flops_per_s: float  # same process, same device, the dominant shape
    matmul: MatmulShape
    peak_flops_per_s: float | None  # datasheet (None on CPU or an unknown device)

    @property
    def achieved(self) -> float:
        return self.model_flops / self.step_s

    @property
    def mfu(self) -> float:
        """Achieved FLOP/s over the same-process matmul's."""
        return self.achieved / self.matmul_flops_per_s

    @property
    def mfu_peak(self) -> float | None:
        return None if self.peak_flops_per_s is None else self.achieved / self.peak_flops_per_s

    def describe(self) -> str:
        peak = ("" if self.mfu_peak is None else
                f", {self.mfu_peak:.1%} of the datasheet peak "
                f"{self.peak_flops_per_s / 1e12:.0f} TFLOP/s")
        return (f"model {self.model_flops / 1e9:.1f} GFLOP/step, {self.achieved / 1e9:.1f} "
                f"GFLOP/s = MFU {self.mfu:.1%} of a plain matmul here "
                f"({self.matmul.describe()}: {self.matmul_flops_per_s / 1e9:.1f} GFLOP/s)"
                + peak)

    def as_dict(self) -> dict[str, Any]:
        return {"model_flops": self.model_flops, "step_s": self.step_s,
                "achieved_flops_per_s": self.achieved,
                "matmul_flops_per_s": self.matmul_flops_per_s,
                "matmul_shape": dataclasses.asdict(self.matmul), "mfu": self.mfu,
                "peak_flops_per_s": self.peak_flops_per_s, "mfu_peak": self.mfu_peak}


def device_peak(dtype: str) -> float | None:
    """`datasheet_peak` of jax's first device (None on CPU)."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        return None
    return datasheet_peak(device.device_kind, dtype)


def mfu_from_rounds(model_flops_: float, step_times: np.ndarray, matmul: MatmulShape,
                    matmul_times: np.ndarray) -> float:
    """Median over rounds of (model FLOP/s of the step) / (matmul FLOP/s) with both timed in the
    same round (`jtree.launch.bench.harness.alternate`): the MFU that both sides' shared load cancels
    from."""
    per_round = (model_flops_ / np.asarray(step_times)) / (matmul.flops / np.asarray(matmul_times))
    return float(np.median(per_round))


def utilization_fields(key: str, flops: float, step_times: Sequence[float],
                       matmul: MatmulShape, matmul_times: Sequence[float], peak: float | None,
                       xla_flops: float | None = None) -> dict[str, Any]:
    """One step variant's utilization, as the step benches report it (`key` prefixes the
    names): model FLOPs (`model_flops`), achieved FLOP/s (median step time), MFU against the
    same rounds' matmul (`mfu_from_rounds`), against the datasheet `peak` where there is one,
    and XLA's own FLOP count of the compiled step where the bench has one (None for a step of
    several device calls). One helper so that every bench's MFU columns mean the same."""
    achieved = flops / float(np.median(step_times))
    return {f"{key}_model_flops": flops, f"{key}_flops_per_s": achieved,
            f"{key}_mfu": mfu_from_rounds(flops, np.asarray(step_times), matmul,
                                          np.asarray(matmul_times)),
            f"{key}_mfu_peak": None if peak is None else achieved / peak,
            f"{key}_xla_flops": xla_flops}


def run_utilization(model_cfg: Any, history: list[dict[str, Any]], dtype: str = "float32",
                    n_devices: int | None = None) -> Utilization | None:
    """A training run's utilization from its step records (`jtree.training.report.step_record`):
    model FLOPs of the steps that did not compile over their device seconds, per device (the
    work splits over `n_devices`, default every device), against a plain matmul probed now at
    the dominant shape of one device's share of a median step. None without such records (or
    records without the work counts)."""
    steady = [r for r in history if not r["compiles"]] or history
    if not steady or "n_computed_pairs" not in steady[0]:
        return None
    fm = FlopModel.for_config(model_cfg)
    n_devices = n_devices or jax.device_count()
    flops = [model_flops(fm, Work(r["n_computed_tokens"], r["n_computed_pairs"],
                                  r["n_scored_tokens"])) / n_devices for r in steady]
    tokens = int(np.median([r["n_computed_tokens"] for r in steady])) // n_devices
    shape = dominant_shape(tokens, model_cfg, jnp.dtype(dtype).name)
    return Utilization(float(np.mean(flops)), float(np.mean([r["device_s"] for r in steady])),
                       matmul_probe(shape), shape, device_peak(dtype))
