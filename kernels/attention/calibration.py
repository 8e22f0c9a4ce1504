"""`auto` by measurement: which of the available attention implementations is faster for a class
of shapes, timed once on the device at hand.

On CPU two implementations run the same block-sparse schedule: the multi-threaded C++ `cpu`
kernel and the plain-XLA `xla` block loop. Which one is faster depends on the machine (the C++
kernel is compiled for its vector width and runs one thread per CPU; XLA runs the loop on one
thread) and on the shape (head_dim, work items per thread), so `auto` times both on a
representative call of the call's shape class and keeps the faster
(`jtree.kernels.tree_attention.resolve_impl`).

- `ShapeClass`: backend, dtype, head_dim (and v's: MLA), q and kv heads, rows and S rounded up to
  powers of two; the measured call is that class's representative (`rows x S`, with rows cut so that
  it holds at most `MAX_TOKENS` tokens) on a synthetic tree mask (`synthetic_end`).
- `pick_fastest`: the smallest time wins; equal times go to the earlier candidate in the given
  order (deterministic).
- `measure`: fwd + bwd of each candidate, one warm-up call (compiles) then the median of
  `repeats` calls.
- `decide`: the decision for a class, read from the on-disk store when a process on this machine
  already made it, else measured now and stored.

Only calls of at least `MIN_TOKENS` (1024) tokens are measured: from there the kernels' gap is a
real share of a step and repays a calibration; smaller calls (attention a small share of their
step, and the many tiny calls of tests and toy runs) keep the static rule.

Decisions persist so that a run, its resume and a second identical run on the same machine run the
same kernel (the kernels differ in float32 last bits, so a run that measured the other way round
would not be bitwise identical). The store is a directory (`store_dir`:
`JTREE_ATTENTION_CALIBRATION_DIR`, else `$XDG_CACHE_HOME/jtree/attention_calibration`, else
`~/.cache/jtree/attention_calibration`) of one small JSON file per key (`decision_file`): the shape
class and the machine signature (`machine_signature`: CPU model, the CPUs this process may run on,
the jax version, the candidates and the C++ kernel's build key), so another machine, jax build, CPU
count or kernel source measures anew. A file is created whole and only once (a temp file hard-linked
to its name: first writer wins), so processes that calibrate the same class at once all run the
first stored decision: a process that loses the race reads and runs the winner's. A directory that
cannot be written logs one warning and the process keeps its own measurement. Delete a file (or the
directory) to measure again, e.g. after the machine's load changed for good.

The per-process cache is the caller's (`tree_attention` keeps one decision per shape class in
front of the store: the same shape class always runs the same kernel within a run).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jtree.kernels.cpu.library import cpu_identity

MAX_TOKENS = 4096  # rows x S of the measured call, at most (keeps a calibration to a second or two)
# Calls of fewer tokens (rows x S) keep the static rule. From about 1024 tokens on the kernels'
# gap is a real share of a training step (1.5-2x on 1 x 1280 and 1 x 2752 calls) and one
# calibration (a second or so, once per shape class and machine with the store) is repaid; below
# it attention is a small share of the step, and the many tiny calls of tests and toy runs
# would each pay a measurement for nothing.
MIN_TOKENS = 1024
REPEATS = 3
STORE_ENV = "JTREE_ATTENTION_CALIBRATION_DIR"

log = logging.getLogger(__name__)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class ShapeClass:
    """The shapes one measurement decides for."""

    backend: str
    dtype: str
    head_dim: int
    q_heads: int
    kv_heads: int
    rows: int  # a power of two >= the call's rows
    seq: int  # a power of two >= the call's S (at least 64)
    value_head_dim: int  # v's head dim (MLA: not head_dim)

    @classmethod
    def of(cls, backend: str, dtype: Any, rows: int, seq: int, q_heads: int, kv_heads: int,
           head_dim: int, value_head_dim: int | None = None) -> ShapeClass:
        return cls(backend, jnp.dtype(dtype).name, int(head_dim), int(q_heads), int(kv_heads),
                   _pow2(rows), max(64, _pow2(seq)), int(value_head_dim or head_dim))

    def representative(self) -> tuple[int, int]:
        """(rows, S) of the measured call: the class's rows x S, rows halved while it holds more
        than `MAX_TOKENS` tokens, then S halved (at least 64)."""
        rows, seq = self.rows, self.seq
        while rows > 1 and rows * seq > MAX_TOKENS:
            rows //= 2
        while seq > 64 and rows * seq > MAX_TOKENS:
            seq //= 2
        return rows, seq

    def describe(self) -> str:
        dims = (f"{self.head_dim}" if self.value_head_dim == self.head_dim else
                f"{self.head_dim} (v {self.value_head_dim})")
        return (f"head_dim {dims}, {self.q_heads}/{self.kv_heads} q/kv heads, rows <= "
                f"{self.rows} x S <= {self.seq}, {self.dtype}, {self.backend}")


def pick_fastest(timings: Mapping[str, float], order: Sequence[str]) -> str:
    """The candidate of `order` with the smallest time in `timings` (seconds); equal times go to
    the one earlier in `order`. Candidates missing from `timings` are never picked."""
    timed = [name for name in order if name in timings]
    if not timed:
        raise ValueError(f"pick_fastest: no timings for any of {list(order)}")
    return min(timed, key=lambda name: (timings[name], order.index(name)))


def synthetic_end(rows: int, seq: int) -> np.ndarray:
    """[rows, seq] `end` of one tree per row: a shared prefix of an eighth of the row, then seven
    branches (chains) of an eighth each (POR 0.75 over its 7 paths, about a sixth of the causal
    square's pairs); query i sees key j iff j <= i < end[j]."""
    eighth = max(1, seq // 8)
    j = np.arange(seq)
    branch_end = np.minimum(seq, (j // eighth + 1) * eighth)
    end = np.where(j < eighth, seq, branch_end).astype(np.int32)
    end[-1] = seq
    return np.broadcast_to(end, (rows, seq)).copy()


CALIBRATION_EVENT = "/jtree/attention/calibration_duration"  # the seconds `measure` took


def measure(shape: ShapeClass, candidates: Sequence[str],
            run: Callable[[str, jax.Array, jax.Array, jax.Array, np.ndarray], jax.Array],
            repeats: int = REPEATS) -> dict[str, float]:
    """Median seconds of fwd + bwd of `run(impl, q, k, v, end)` for every candidate at the
    class's representative shape (random operands, `synthetic_end`), outside any trace."""
    rows, seq = shape.representative()
    dtype = jnp.dtype(shape.dtype)
    start = time.perf_counter()
    with jax.ensure_compile_time_eval():
        keys = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(keys[0], (rows, seq, shape.q_heads, shape.head_dim), dtype)
        k = jax.random.normal(keys[1], (rows, seq, shape.kv_heads, shape.head_dim), dtype)
        v = jax.random.normal(keys[2], (rows, seq, shape.kv_heads, shape.value_head_dim), dtype)
        end = synthetic_end(rows, seq)
        times = {}
        for name in candidates:
            def loss(q, k, v, name=name):
                return jnp.sum(run(name, q, k, v, end).astype(jnp.float32) ** 2)

            grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            jax.block_until_ready(grad(q, k, v))  # compiles
            samples = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(grad(q, k, v))
                samples.append(time.perf_counter() - t0)
            times[name] = float(np.median(samples))
    # A trainer that keeps compile time out of step time reports this apart
    # (jtree.training.compile_log listens for the event).
    jax.monitoring.record_event_duration_secs(CALIBRATION_EVENT, time.perf_counter() - start)
    return times


@dataclasses.dataclass(frozen=True)
class Decision:
    """The kernel a shape class runs, the timings (seconds) it rests on, and where it came from
    (for the log line: measured now, or read from a file of the store)."""

    choice: str
    times: dict[str, float]
    origin: str


def store_dir() -> Path:
    """The directory of stored decisions: `JTREE_ATTENTION_CALIBRATION_DIR` if set, else the
    user's cache directory (`$XDG_CACHE_HOME` or `~/.cache`) under jtree/attention_calibration."""
    if os.environ.get(STORE_ENV):
        return Path(os.environ[STORE_ENV])
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "jtree" / "attention_calibration"


def machine_signature(candidates: Sequence[str],
                      builds: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What a decision is valid for beyond its shape class: the CPU model, the CPUs this process
    may run on (the `cpu` kernel runs one thread per CPU), the jax version (XLA's code), the
    candidates compared and the builds of the compiled ones (`builds`: name -> build key), so a
    changed kernel is measured again rather than judged by its old build's times."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu_identity()[0], "cpus": cpus, "jax": jax.__version__,
            "candidates": list(candidates), "builds": dict(builds or {})}


def _key(shape: ShapeClass, machine: Mapping[str, Any]) -> dict[str, Any]:
    """What a decision is for: its shape class and machine (the file's name hashes it, the file
    holds it)."""
    return {"shape": dataclasses.asdict(shape), "machine": dict(machine)}


def decision_file(directory: Path, shape: ShapeClass, machine: Mapping[str, Any]) -> Path:
    """The file of the decision for `shape` on `machine`: named by a hash of both."""
    key = json.dumps(_key(shape, machine), sort_keys=True)
    return directory / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def read_decision(path: Path, candidates: Sequence[str]) -> Decision | None:
    """The decision stored in `path`, or None when there is none (or it names no candidate)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("choice") not in candidates:
        return None
    return Decision(record["choice"], dict(record.get("times", {})), f"read from {path}")


_warned: set[str] = set()  # store directories this process already warned about


def store_decision(path: Path, decision: Decision, record: Mapping[str, Any],
                   candidates: Sequence[str]) -> Decision:
    """Store `decision` in `path` unless a decision is there already, and return the one stored
    (first writer wins: the file appears whole, by a hard link from a temp file, and only once).
    `record` (the key) goes into the file for whoever reads it. A directory that cannot be
    written warns once and returns `decision`."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({**record, "choice": decision.choice, "times": decision.times}, f,
                          sort_keys=True, indent=1)
            os.link(tmp, path)
            return dataclasses.replace(decision, origin=f"{decision.origin}, stored in {path}")
        except FileExistsError:
            stored = read_decision(path, candidates)
            if stored is None:
                raise
            return dataclasses.replace(stored, origin=(
                f"{decision.origin} ({decision.choice}), but another process stored its "
                f"decision first: {stored.origin}"))
        finally:
            os.unlink(tmp)
    except OSError as error:
        if str(path.parent) not in _warned:
            _warned.add(str(path.parent))
            log.warning("attention calibration: cannot store decisions in %s (%s); this "
                        "process keeps its own measurements, so another run may pick another "
                        "kernel", path.parent, error)
        return decision


def decide(shape: ShapeClass, candidates: Sequence[str],
           run: Callable[[str, jax.Array, jax.Array, jax.Array, np.ndarray], jax.Array],
           builds: Mapping[str, str] | None = None) -> Decision:
    """The kernel for `shape` among `candidates` (compiled ones with their `builds`): the stored
    decision for this machine when there is one, else measured now (`measure`, `pick_fastest`)
    and stored (`store_decision`)."""
    machine = machine_signature(candidates, builds)
    path = decision_file(store_dir(), shape, machine)
    stored = read_decision(path, candidates)
    if stored is not None:
        return stored
    times = measure(shape, candidates, run)
    rows, seq = shape.representative()
    measured = Decision(pick_fastest(times, candidates), times, "measured now")
    record = {**_key(shape, machine), "representative": [rows, seq]}
    return store_decision(path, measured, record, candidates)
