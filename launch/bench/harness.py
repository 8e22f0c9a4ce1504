"""What every bench script under `launch/` shares: the alternating timer, the output files, the
common flags.

Timing. On a shared machine the load changes while a bench runs, so variants are never timed in
separate loops: `alternate` runs one call of every variant per round (in a shuffled order), and a
comparison is the median over rounds of the ratio of two variants' times *in the same round* (both
saw the same load), with a bootstrap interval that says whether it is beyond noise; medians of the
times are reported too. Warm-up rounds (compiles, first-touch of memory) are timed separately
and left out of the medians.

Outputs. A bench named `NAME` (its module, e.g. `bench_gdn`) writes `OUT/NAME.json` (everything
it measured, with the machine and its arguments), `OUT/NAME.md` (the table it printed) and, where
a plot says more than the table, `OUT/NAME.png`; `--out OUT` (default `bench_out`) is the same
flag with the same meaning in every bench. Plots use matplotlib's Agg backend (files, no display),
chosen here only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jtree.training.host_allocator import configure_host_malloc

DEFAULT_OUT = "bench_out"
ATTENTION_IMPLS = ("cpu", "xla", "auto")  # --attention: the block-sparse CPU kernels, or `auto`


# ----------------------------------------------------------------------------- timing


def minor_faults() -> int:
    """Minor page faults of this process so far: a call that maps fresh memory for its
    temporaries pays one per 4 KiB page (see `jtree.training.host_allocator`)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@dataclasses.dataclass
class Timings:
    """Per-variant measurements of `alternate`, one entry per timed round (same order)."""

    wall: dict[str, list[float]]  # seconds, wall clock
    cpu: dict[str, list[float]]  # seconds of process CPU time (less sensitive to other jobs)
    faults: dict[str, list[int]]  # minor page faults during the call
    first_s: dict[str, float]  # the first warm-up call's seconds (compiles included, if any)
    first_result: dict[str, Any]  # what the first warm-up call returned

    @property
    def rounds(self) -> int:
        return len(next(iter(self.wall.values()), []))

    def median(self, name: str) -> float:
        """Median wall seconds of one variant."""
        return float(np.median(self.wall[name]))

    def ratios(self, num: str, den: str, *, cpu: bool = False) -> np.ndarray:
        """time(num) / time(den) of every round (both measured in the same round)."""
        times = self.cpu if cpu else self.wall
        return np.asarray(times[num]) / np.asarray(times[den])

    def ratio(self, num: str, den: str, *, cpu: bool = False) -> float:
        """Median over rounds of time(num) / time(den): e.g. ratio("baseline", "tree") is the
        tree's speedup."""
        return float(np.median(self.ratios(num, den, cpu=cpu)))

    def ratio_interval(self, num: str, den: str, *, level: float = 0.95, resamples: int = 2000,
                       seed: int = 0) -> tuple[float, float]:
        """A bootstrap interval of `ratio(num, den)`: the rounds resampled with replacement
        `resamples` times, the central `level` share of the resampled medians. A comparison of
        two variants that do the same work reads about 1.0 with run-to-run noise; the interval
        says whether a measured difference is bigger than that noise (`compare`)."""
        r = self.ratios(num, den)
        draws = np.random.default_rng(seed).integers(0, len(r), size=(resamples, len(r)))
        medians = np.median(r[draws], axis=1)
        tail = 100 * (1 - level) / 2
        return float(np.percentile(medians, tail)), float(np.percentile(medians, 100 - tail))

    def compare(self, num: str, den: str, *, level: float = 0.95) -> str:
        """"faster" when den is faster than num with the whole `ratio_interval` above 1,
        "slower" when it is below 1, "parity" when it holds 1 (no difference the rounds can
        tell from noise)."""
        low, high = self.ratio_interval(num, den, level=level)
        return "faster" if low > 1 else "slower" if high < 1 else "parity"

    def medians_ms(self) -> dict[str, float]:
        return {name: 1e3 * self.median(name) for name in self.wall}


def alternate(runs: Mapping[str, Callable[[], Any]], rounds: int, *, warmup: int = 1,
              max_rounds: int | None = None, budget_s: float = 0.0) -> Timings:
    """Time the variants `runs` (name -> call; its result is waited for) in alternating rounds.

    `warmup` untimed rounds first (the first one's times and results are kept in `first_s` /
    `first_result`), then at least `rounds` timed rounds, more while `budget_s` seconds of timed
    rounds have not passed, at most `max_rounds` (default `rounds`).

    Every timed round runs the variants in a new order (a permutation from a fixed seed): a call
    runs a little slower or faster depending on what ran just before it (caches, the allocator),
    and with a fixed order that bias would sit in every round's ratio. Shuffled, it averages out:
    the same step measured as two variants then reads 1.0 within noise."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    max_rounds = rounds if max_rounds is None else max(rounds, max_rounds)
    first_s: dict[str, float] = {}
    first_result: dict[str, Any] = {}
    for i in range(warmup):
        for name, run in runs.items():
            t0 = time.perf_counter()
            result = jax.block_until_ready(run())
            if i == 0:
                first_s[name], first_result[name] = time.perf_counter() - t0, result
    wall: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    faults: dict[str, list[int]] = {name: [] for name in runs}
    t_start = time.perf_counter()
    order = np.random.default_rng(0)
    names = list(runs)
    done = 0
    while done < max_rounds and (done < rounds or time.perf_counter() - t_start < budget_s):
        for i in order.permutation(len(names)):
            name = names[i]
            t0, c0, f0 = time.perf_counter(), time.process_time(), minor_faults()
            jax.block_until_ready(runs[name]())
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            faults[name].append(minor_faults() - f0)
        done += 1
    return Timings(wall, cpu, faults, first_s, first_result)


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """XLA's buffer assignment of a compiled executable (not a process RSS)."""

    temp_bytes: int  # temporaries
    peak_bytes: int  # arguments + outputs + temporaries, less what outputs alias

    @classmethod
    def of(cls, compiled: Any) -> CompiledMemory:
        m = compiled.memory_analysis()
        temp = int(getattr(m, "temp_size_in_bytes", 0) or 0)
        return cls(temp, int(m.argument_size_in_bytes + m.output_size_in_bytes + temp
                             - m.alias_size_in_bytes))


# ----------------------------------------------------------------------------- flags


def bench_parser(doc: str, *, repeats: int | None, quick: str | None = None
                 ) -> argparse.ArgumentParser:
    """An argument parser with the flags every bench shares: `--out` (the folder for
    `NAME.json|md|png`), `--repeats` (timed rounds; None for a bench that sets its rounds
    otherwise) and, where the bench has a small mode, `--quick` (its help says what it shrinks).
    `doc` (the module docstring) is the help text."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help="folder of the output files NAME.json, NAME.md and NAME.png "
                             f"(default {DEFAULT_OUT})")
    if repeats is not None:
        parser.add_argument("--repeats", type=int, default=repeats,
                            help=f"timed rounds of alternating runs (default {repeats})")
    if quick is not None:
        parser.add_argument("--quick", action="store_true", help=quick)
    return parser


def add_host_malloc_flag(parser: argparse.ArgumentParser) -> None:
    """`--host-malloc keep|default`; `apply_host_malloc` applies it."""
    parser.add_argument("--host-malloc", choices=("keep", "default"), default="keep",
                        help="keep: glibc keeps freed memory (jtree.training.host_allocator), so steps do "
                             "not page-fault their temporaries again every run; default: as is")


def apply_host_malloc(args: argparse.Namespace) -> bool:
    """Apply `--host-malloc` (before anything starts a jax backend); whether freed memory is
    kept."""
    return configure_host_malloc(args.host_malloc)


def add_attention_flag(parser: argparse.ArgumentParser, default: str = "cpu") -> None:
    """`--attention cpu|xla|auto`: the attention kernel of the bench's model."""
    parser.add_argument("--attention", choices=ATTENTION_IMPLS, default=default,
                        help="cpu: the multi-threaded C++ kernel (jtree.kernels.attention.cpu); xla: "
                             "the plain-XLA block loop, one core (jtree.kernels.attention.xla); "
                             "auto: the faster of the two, measured per shape class "
                             "(jtree.kernels.attention.calibration)")


def machine() -> str:
    """The CPU, core count, jax version and backend, and the load average now."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return (f"{cpu}, {os.cpu_count()} cores, jax {jax.__version__} ({jax.default_backend()}), "
            f"load average {os.getloadavg()[0]:.1f}")


# ----------------------------------------------------------------------------- results


@dataclasses.dataclass(frozen=True)
class Column:
    """One column of a results table: its header, and how a row's cell is made (a format
    string applied to `row[key]`, or a function of the whole row)."""

    header: str
    key: str
    fmt: str = "{}"
    cell: Callable[[Mapping[str, Any]], str] | None = None

    def render(self, row: Mapping[str, Any]) -> str:
        if self.cell is not None:
            return self.cell(row)
        value = row.get(self.key)
        return "-" if value is None else self.fmt.format(value)


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column]) -> str:
    lines = ["| " + " | ".join(c.header for c in columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(c.render(r) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def figure(ncols: int, figsize: tuple[float, float]) -> tuple[Any, Any]:
    """A matplotlib figure and its axes (one row of `ncols`), on the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=figsize)


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


@dataclasses.dataclass(frozen=True)
class Output:
    """Where a bench named `name` writes: `folder/name.json|md|png`."""

    folder: Path
    name: str

    @classmethod
    def from_args(cls, args: argparse.Namespace, name: str) -> Output:
        return cls(Path(args.out), name)

    def path(self, suffix: str) -> Path:
        return self.folder / f"{self.name}.{suffix}"

    def write(self, data: Mapping[str, Any], *, table: str | None = None,
              fig: Any = None, dpi: int = 90) -> list[Path]:
        """Write the results (JSON), the table (markdown) and the figure (PNG, then closed);
        returns the paths written."""
        self.folder.mkdir(parents=True, exist_ok=True)
        written = [self.path("json")]
        written[0].write_text(json.dumps(data, indent=1, default=_jsonable))
        if table is not None:
            written.append(self.path("md"))
            written[-1].write_text(table + "\n")
        if fig is not None:
            import matplotlib.pyplot as plt

            fig.tight_layout()
            written.append(self.path("png"))
            fig.savefig(written[-1], dpi=dpi)
            plt.close(fig)
        return written


def run_info(args: argparse.Namespace) -> dict[str, Any]:
    """What every results file starts with: the machine and the bench's arguments."""
    return {"machine": machine(), "args": vars(args)}
