"""Compiles of a run, counted and timed as they happen.

A step compiles on its first call at each new shape, synchronously, inside the call a trainer
times; without knowing which calls compiled, a run's tokens/s and step medians silently include
compile time. `CompileWatch` listens to jax's own compile events (`jax.monitoring`: tracing,
lowering to MLIR, XLA's backend compile) on the thread that created it (background threads, such
as Orbax's checkpoint writers, are not the step's), so the trainer can log every compile as such,
take its time out of throughput and report it apart. A count of backend compiles is exact: jax
records one event per XLA compile, and none on a cache hit.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import jax

TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
COMPILE_EVENTS = (TRACE_EVENT, LOWER_EVENT, BACKEND_COMPILE_EVENT)


@dataclasses.dataclass(frozen=True)
class Compiles:
    """A count of XLA compiles and the seconds spent tracing, lowering and compiling."""

    n: int = 0
    seconds: float = 0.0

    def __sub__(self, other: Compiles) -> Compiles:
        return Compiles(self.n - other.n, self.seconds - other.seconds)


class CompileWatch:
    """Totals of the compiles on the creating thread while entered (`with CompileWatch() as w`);
    `w.total` read before and after a call gives that call's compiles."""

    def __init__(self) -> None:
        self.total = Compiles()
        self._thread = threading.get_ident()

    def _on_event(self, event: str, duration: float, **_: Any) -> None:
        if event not in COMPILE_EVENTS or threading.get_ident() != self._thread:
            return
        self.total = Compiles(self.total.n + (event == BACKEND_COMPILE_EVENT),
                              self.total.seconds + duration)

    def __enter__(self) -> CompileWatch:
        jax.monitoring.register_event_duration_secs_listener(self._on_event)
        return self

    def __exit__(self, *exc: Any) -> None:
        jax.monitoring.unregister_event_duration_listener(self._on_event)
