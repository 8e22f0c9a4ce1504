"""jtree.training.host_allocator: with freed memory kept, repeated CPU steps stop page-faulting their
temporaries (each process is fresh: the setting must precede the XLA CPU client's threads)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from tests.run_util import WORKTREE

_PROGRAM = """
import json, resource, sys
from jtree.training.host_allocator import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
import jax, jax.numpy as jnp

@jax.jit
def step(x):  # matmul outputs of 16 MiB each that XLA must materialize as temporaries
    y = x @ x
    z = jnp.tanh(y) @ x
    return (jnp.sin(z) @ y).sum()

x = jnp.ones((2048, 2048), jnp.float32) * 1e-3
m = step.lower(x).compile().memory_analysis()
temp = m.temp_size_in_bytes + m.output_size_in_bytes
faults = []
for _ in range(8):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    jax.block_until_ready(step(x))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(json.dumps({"applied": applied, "temp_pages": temp // 4096, "faults": faults[1:]}))
"""


def _run(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROGRAM, mode], cwd=WORKTREE, capture_output=True,
                         env=dict(os.environ, PYTHONPATH=str(WORKTREE), JAX_PLATFORMS="cpu"),
                         text=True, check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="glibc malloc only")
def test_kept_memory_stops_per_step_page_faults():
    default, keep = _run("default"), _run("keep")
    assert keep["applied"] and not default["applied"]
    pages = default["temp_pages"]
    assert pages > 10_000
    if min(default["faults"]) < pages // 2:
        pytest.skip("this platform's allocator already reuses freed memory: nothing to compare")
    # Once the heap holds a step's temporaries (a few runs: worker threads' allocations interleave
    # differently at first), a run reuses them instead of faulting them in again.
    assert min(keep["faults"][2:]) < pages // 20, (keep, default)


def test_host_malloc_policy_leaves_malloc_alone_off_cpu_and_rejects_unknown_settings():
    """`run.host_malloc`: `auto` keeps freed memory only on the CPU backend (an accelerator's
    runtime caches its own buffers), `default` never; anything else is a config error. (The
    branches that apply mallopt run in fresh processes above and in `jtree.launch.train`.)"""
    from jtree.training.host_allocator import configure_host_malloc
    assert configure_host_malloc("auto", "tpu") is False
    assert configure_host_malloc("auto", "gpu") is False
    assert configure_host_malloc("default", "cpu") is False
    with pytest.raises(ValueError, match="run.host_malloc"):
        configure_host_malloc("always", "cpu")


_STARTS_NO_BACKEND = """
import json, sys
from jax._src import xla_bridge
from jtree.training.host_allocator import configure_host_malloc, platform_before_start
from jtree.launch.bench.harness import apply_host_malloc
import argparse
platform = platform_before_start()
kept = configure_host_malloc("auto")
bench_kept = apply_host_malloc(argparse.Namespace(host_malloc="keep"))
print(json.dumps({"platform": platform, "kept": kept, "bench_kept": bench_kept,
                  "started": xla_bridge.backends_are_initialized()}))
"""


def test_policy_decides_without_starting_a_backend():
    """`auto` must not start jax's CPU client to learn the platform: its worker threads would
    get their own malloc arenas first, and keeping freed memory would come too late (the step
    page-faulted 100k+ times per run while `configure_host_malloc` called
    `jax.default_backend()`)."""
    out = subprocess.run([sys.executable, "-c", _STARTS_NO_BACKEND], cwd=WORKTREE,
                         capture_output=True, text=True, check=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(WORKTREE), JAX_PLATFORMS="cpu"))
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["platform"] == "cpu" and got["started"] is False, got
    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert got["kept"] is glibc and got["bench_kept"] is glibc, got
