"""Multi-host start-up: `jax.distributed.initialize` from environment variables.

`JTREE_COORDINATOR` (host:port of process 0), `JTREE_NUM_PROCESSES` and `JTREE_PROCESS_ID` start
an explicit cluster (what `launch/local_multihost.sh` sets for several CPU processes on one
machine). `JTREE_DISTRIBUTED=auto` lets jax discover the cluster itself (Cloud TPU pods, SLURM).
Nothing set: one process. CPU processes exchange collectives through gloo.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import jax

ENV_VARS = ("JTREE_COORDINATOR", "JTREE_NUM_PROCESSES", "JTREE_PROCESS_ID")


def initialize_from_env(env: Mapping[str, str] | None = None) -> bool:
    """Join the cluster described by the environment; True when running multi-process. Call it
    before anything touches a jax device."""
    env = os.environ if env is None else env
    given = [v for v in ENV_VARS if env.get(v)]
    if env.get("JTREE_DISTRIBUTED") == "auto":
        _cpu_collectives_over_gloo()
        jax.distributed.initialize()
        return True
    if not given:
        return False
    if len(given) != len(ENV_VARS):
        missing = sorted(set(ENV_VARS) - set(given))
        raise ValueError(f"multi-host launch: {', '.join(missing)} not set (need all of {ENV_VARS})")
    try:
        num, pid = int(env["JTREE_NUM_PROCESSES"]), int(env["JTREE_PROCESS_ID"])
    except ValueError:
        raise ValueError("JTREE_NUM_PROCESSES and JTREE_PROCESS_ID must be integers") from None
    if not 0 <= pid < num:
        raise ValueError(f"JTREE_PROCESS_ID={pid} is not in [0, {num})")
    _cpu_collectives_over_gloo()
    jax.distributed.initialize(env["JTREE_COORDINATOR"], num_processes=num, process_id=pid)
    return True


def _cpu_collectives_over_gloo() -> None:
    """Cross-process collectives for CPU devices (jax 0.10 needs the option; versions where it
    is gone or the default do not)."""
    if hasattr(jax.config, "jax_cpu_collectives_implementation"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
