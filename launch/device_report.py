"""What the sections of `jtree.launch.device_check` share: the report they fill (each section run on its
own, its failure recorded as its error's first line), datasheet peaks, and whether a kernel ran
natively or in an interpreter."""

from __future__ import annotations

import dataclasses
import importlib
import re
import time
import traceback
from collections.abc import Callable
from typing import Any

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
    native = {"pallas_tpu": "tpu", "pallas_mosaic_gpu": "gpu", "pallas_triton": "gpu",
              "mosaic_gpu_blackwell": "gpu", "triton_lang": "gpu"}
    return "interpreted" if impl in native and native[impl] != platform else "native"


dispatch = importlib.import_module("jtree.kernels.tree_attention")  # the module: its registry
