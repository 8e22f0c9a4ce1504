"""Keep freed host memory in the process, so a CPU step does not page-fault its buffers every time.

On the CPU backend XLA allocates a step's temporaries (activations kept for the backward, gradient
buffers: hundreds of MiB) with `malloc` on its worker threads and frees them when the step ends.
glibc serves allocations that large with a fresh `mmap` (worker-thread arenas cannot hold them) and
returns them with `munmap`, so every step page-faults and zeroes all of its temporaries again:
measured on the proj bench shape (2-core EPYC, `launch/bench/step.py`), ~144k minor faults and ~0.3 s
of kernel time per step at 563 MiB of temporaries, about 10% of a 3 s step. That cost follows a
step's memory, not its FLOPs, so it also skews tree-vs-baseline comparisons toward the mode with
more memory per FLOP. GPU and TPU runtimes keep a caching allocator and never pay it.

`keep_freed_memory` makes glibc behave like a caching allocator: one arena (the brk heap, which
can hold any size), no `mmap` for large blocks, and no trimming of freed memory back to the OS.
The process then keeps its peak host memory for its lifetime (as device allocators do). It must be
called before the XLA CPU client starts its threads (before the first computation); elsewhere
than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import pkgutil
import platform
from importlib.metadata import entry_points

# mallopt parameter numbers from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_NEVER_TRIM = 2**31 - 1  # the largest int mallopt accepts: freed memory is never returned


def keep_freed_memory() -> bool:
    """Configure glibc malloc to reuse freed memory instead of unmapping it (see the module
    docstring). Returns whether it applied (False off Linux/glibc or if `mallopt` refused)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    mallopt = ctypes.CDLL(name).mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in (
        (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _NEVER_TRIM)))


def platform_before_start() -> str:
    """The platform jax will run on, found without starting a backend (`jax.default_backend()`
    would start the CPU client's threads, after which `keep_freed_memory` comes too late): the
    first of `JAX_PLATFORMS` when set, else "accelerator" when a PJRT plugin (the `jax_plugins`
    namespace or entry points) or libtpu is installed, else "cpu"."""
    import jax  # the config, not a backend

    chosen = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS", "")
    if chosen:
        return chosen.split(",")[0].strip()
    spec = importlib.util.find_spec("jax_plugins")
    plugins = spec is not None and any(pkgutil.iter_modules(spec.submodule_search_locations))
    if plugins or any(entry_points(group="jax_plugins")) or importlib.util.find_spec("libtpu"):
        return "accelerator"
    return "cpu"


def configure_host_malloc(setting: str, backend: str | None = None) -> bool:
    """The `run.host_malloc` policy: `keep` applies `keep_freed_memory`, `default` leaves malloc
    as it is, `auto` keeps freed memory when the computations run on the CPU `backend` (where the
    step's temporaries are host memory; accelerator runtimes cache their own; None: decided by
    `platform_before_start`). Returns whether freed memory is kept. Call it before the first
    computation, and before anything starts a jax backend."""
    if setting not in ("auto", "keep", "default"):
        raise ValueError(f"run.host_malloc: {setting!r} is not one of auto, keep, default")
    if setting == "auto" and backend is None:
        backend = platform_before_start()
    if setting == "keep" or (setting == "auto" and backend == "cpu"):
        return keep_freed_memory()
    return False
