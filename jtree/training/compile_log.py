"""Compiles of a run, counted and timed as they happen.

A step compiles on its first call at each new shape, synchronously, inside the call a trainer
times; without knowing which calls compiled, a run's tokens/s and step medians silently include
compile time. `CompileWatch` listens to jax's own compile events (`jax.monitoring`: tracing,
lowering to MLIR, XLA's backend compile) on the thread that created it (background threads, such
as Orbax's checkpoint writers, are not the step's), so the trainer can log every compile as such,
take its time out of throughput and report it apart. A count of backend compiles is exact: jax
records one event per XLA compile, and none on a cache hit.

Compile time is wall time covered by those events, each second counted once: events nest (tracing
a step traces the jitted functions it calls, and each inner trace, lowering and compile records
its own event inside the outer trace's), so a plain sum of their durations overstates the time and
a step's time less that sum could go negative. `auto`'s attention calibration on CPU
(`jtree.kernels.attention.calibration`) times kernels while the step is traced; it records its own
event, and its seconds are reported apart from the compiles they sit inside.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import jax

from jtree.kernels.attention.calibration import CALIBRATION_EVENT

TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
COMPILE_EVENTS = (TRACE_EVENT, LOWER_EVENT, BACKEND_COMPILE_EVENT)


@dataclasses.dataclass(frozen=True)
class Compiles:
    """A count of XLA compiles (every program XLA compiled: the step and the small programs around
    it), the wall seconds spent tracing, lowering and compiling them, `auto`'s attention
    calibration included, and of those the calibration's own seconds."""

    n: int = 0
    seconds: float = 0.0
    calibration_s: float = 0.0

    def __sub__(self, other: Compiles) -> Compiles:
        return Compiles(self.n - other.n, self.seconds - other.seconds,
                        self.calibration_s - other.calibration_s)


class CompileWatch:
    """Totals of the compiles on the creating thread while entered (`with CompileWatch() as w`);
    `w.total` read before and after a call gives that call's compiles."""

    def __init__(self) -> None:
        self.total = Compiles()
        self._thread = threading.get_ident()
        self._covered: list[tuple[float, float]] = []  # disjoint (start, end), by end

    def _cover(self, start: float, end: float) -> float:
        """Add the interval [start, end] to the covered time; the seconds it newly covers. An
        event ends when it is recorded, so every covered interval it overlaps ends after
        `start` and sits at the end of the list."""
        new, merged_start = end - start, start
        while self._covered and self._covered[-1][1] > start:
            s, e = self._covered.pop()
            new -= min(e, end) - max(s, start)
            merged_start = min(merged_start, s)
        self._covered.append((merged_start, end))
        return new

    def _on_event(self, event: str, duration: float, **_: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        if event == CALIBRATION_EVENT:  # inside a trace event, so covered by its seconds
            self.total = dataclasses.replace(
                self.total, calibration_s=self.total.calibration_s + duration)
        elif event in COMPILE_EVENTS:
            now = time.perf_counter()
            self.total = dataclasses.replace(
                self.total, n=self.total.n + (event == BACKEND_COMPILE_EVENT),
                seconds=self.total.seconds + self._cover(now - duration, now))

    def __enter__(self) -> CompileWatch:
        jax.monitoring.register_event_duration_secs_listener(self._on_event)
        return self

    def __exit__(self, *exc: Any) -> None:
        jax.monitoring.unregister_event_duration_listener(self._on_event)
