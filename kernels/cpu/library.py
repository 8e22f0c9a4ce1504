"""The C++ library of the CPU backend's kernels (`kernels/cpu/`): compiled on first use,
cached, loaded once per process.

Every `cpu/*.cc` source (with the `cpu/*.h` headers they share) is compiled into one shared library
with the system C++ compiler (`CXX`, default `g++`) against the FFI headers jaxlib ships, for this
machine (`-march=native`), and cached under `$JTREE_KERNEL_CACHE` (default
`~/.cache/jtree/kernels`) by a hash of the sources, flags, compiler, jax version and CPU (model
and instruction set: `build_key`). The kernels register their own FFI handlers from `library()`:
`jtree.kernels.attention.cpu` (tree attention) and `jtree.kernels.weight_grad` (linear layers'
weight gradients).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import jax

_DIR = Path(__file__).parent
_CPUINFO = Path("/proc/cpuinfo")
# -ffast-math's parts, spelled out: given at link time, -ffast-math (or its
# -funsafe-math-optimizations) also links GCC's crtfastmath.o, whose constructor sets the CPU's
# flush-to-zero and denormals-are-zero modes for the whole process when the library loads, so
# numpy and XLA would silently flush subnormal floats to zero after the first `cpu` kernel call.
_FAST_MATH = ("-fno-math-errno", "-fno-signed-zeros", "-fno-trapping-math", "-fassociative-math",
              "-freciprocal-math", "-ffinite-math-only", "-fno-rounding-math",
              "-fno-signaling-nans", "-fcx-limited-range", "-fexcess-precision=fast")
_FLAGS = ("-O3", "-march=native", *_FAST_MATH, "-std=c++20", "-shared", "-fPIC", "-pthread")


def _sources() -> list[Path]:
    return sorted(_DIR.glob("*.cc"))


def cpu_identity() -> tuple[str, str]:
    """(model name, instruction set flags) of this machine's CPU, from `_CPUINFO` (the platform's
    processor name and no flags where there is none). The flags belong to a build's identity:
    virtual machines often report one generic model name over hosts with and without AVX-512,
    and a `-march=native` library built on one would stop with an illegal instruction on the
    other if a shared home directory handed it over."""
    fields: dict[str, str] = {}
    try:
        with open(_CPUINFO, encoding="utf-8") as f:
            for line in f:  # the first processor's lines; every processor repeats them
                key, sep, value = line.partition(":")
                if sep and key.strip() in ("model name", "flags"):
                    fields.setdefault(key.strip(), value.strip())
                    if len(fields) == 2:
                        break
    except OSError:
        pass
    model = fields.get("model name") or platform.processor() or platform.machine()
    return model, fields.get("flags", "")


def build_key() -> str:
    """What identifies this machine's build of the library: a hash of the sources and headers,
    flags, compiler, FFI headers, jax version and CPU (`cpu_identity`). It is the library's file
    name, and part of `auto`'s stored attention decisions, so a changed kernel is measured again."""
    cxx = os.environ.get("CXX", "g++")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                                 check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise RuntimeError(f"the CPU kernels' library needs a C++ compiler ({cxx!r}: {e}); "
                           "set CXX, or use attention impl 'xla'") from None
    texts = [p.read_text() for p in sorted(_DIR.glob("*.h")) + _sources()]
    return hashlib.sha256("\0".join((*texts, " ".join(_FLAGS), version, jax.ffi.include_dir(),
                                     jax.__version__, *cpu_identity())).encode()).hexdigest()[:16]


def _compile() -> Path:
    """The library for this machine: cached, else compiled (atomically, so concurrent processes
    may race safely)."""
    cxx = os.environ.get("CXX", "g++")
    key = build_key()
    cache = Path(os.environ.get("JTREE_KERNEL_CACHE",
                                Path.home() / ".cache" / "jtree" / "kernels"))
    lib = cache / f"jtree_cpu-{key}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        built = Path(tmp) / lib.name
        done = subprocess.run([cxx, *_FLAGS, "-isystem", jax.ffi.include_dir(),
                               *map(str, _sources()), "-o", str(built)],
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"the CPU kernels: compiling {_DIR} failed:\n"
                               f"{done.stderr[-4000:]}")
        os.replace(built, lib)
    return lib


def build_error() -> str | None:
    """Why the library cannot run on this machine (no compiler, a failed build), or None when it
    is built (now or before): what `auto` asks before choosing a CPU kernel."""
    try:
        _compile()
    except RuntimeError as e:
        return str(e)
    return None


@functools.cache
def library() -> ctypes.CDLL:
    """The loaded library (compiled or found once per process)."""
    return ctypes.cdll.LoadLibrary(str(_compile()))


def default_threads() -> int:
    """The CPUs this process may run on: the kernels' thread count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
