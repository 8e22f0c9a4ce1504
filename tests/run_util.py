"""Small training runs for end-to-end tests: a tiny dataset, a tiny config, subprocess launch, and
the repository root (`WORKTREE`) that subprocesses run from and import the worktree from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from jtree.trees.synthetic import AgentShape, agent_rollout_group
from jtree.trees.jsonl import write_sequence_groups

WORKTREE = Path(__file__).resolve().parent.parent
VOCAB = 64
# How every test process compiles: XLA:CPU's backend (LLVM) optimization at level 1. The tests'
# programs are tiny and most are compiled once, so compiling is most of the suites' time; level 1
# compiles them about 1.3x faster than the default. The HLO program is the same; only LLVM's work
# on its loops changes, which moves float results within rounding: `compare-torch` on Qwen3-Next
# (tests/hf/test_hf_moe_next_checkpoint.py) measured a largest relative gradient difference to
# PyTorch of 6.9e-5 at the default level, 5.0e-5 at 1, and 1.2e-4 at 0, past its 1e-4 tolerance,
# so level 0 is kept to the mesh workers, which compare jtree with itself. tests/conftest.py sets
# it for the session; `launch` and `xla_flags` pass it to subprocesses.
CODEGEN_XLA_FLAGS = "--xla_backend_optimization_level=1"


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a test subprocess: the session's code generation, and `devices` forced
    host devices when given."""
    forced = f" --xla_force_host_platform_device_count={devices}" if devices else ""
    return CODEGEN_XLA_FLAGS + forced


def write_groups(path: Path, n_groups: int = 12, seed: int = 0) -> Path:
    """Branching agent-rollout groups small enough for a 128-token row."""
    rng = np.random.default_rng(seed)
    shape = AgentShape(vocab_size=VOCAB, system_len=16, task_len=6, turns=2, assistant_len=8,
                       tool_len=6, rollouts=4, think_len=4)
    write_sequence_groups(path, [agent_rollout_group(rng, shape) for _ in range(n_groups)])
    return path


def tiny_overrides(data: Path, **extra: object) -> list[str]:
    base = {
        "data.path": str(data), "data.seq_len": 128, "data.trees_per_step": 4,
        "data.micro_batches": 2, "model.vocab_size": VOCAB, "model.hidden_size": 32,
        "model.intermediate_size": 64, "model.num_hidden_layers": 1,
        "model.num_attention_heads": 4, "model.num_key_value_heads": 2, "model.head_dim": 8,
        "runtime.attention_impl": "reference", "optim.learning_rate": 1e-2,
        "optim.warmup_steps": 1, "run.compare_baseline": False, "run.log_every": 1,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def launch(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `python -m jtree.launch.train ARGS` from the worktree, output to `log`.out/.err (files,
    not pipes: a killed run's data workers must not keep the test waiting for end-of-file).
    The run compiles as the tests do (`CODEGEN_XLA_FLAGS`); `env` may add its own XLA_FLAGS
    (e.g. `xla_flags(devices)`), which replace the session's."""
    full_env = dict(os.environ, XLA_FLAGS=CODEGEN_XLA_FLAGS)
    full_env.update(PYTHONPATH=str(WORKTREE), **(env or {}))
    with open(f"{log}.out", "w") as out, open(f"{log}.err", "w") as err:
        return subprocess.Popen([sys.executable, "-m", "jtree.launch.train", *args], cwd=WORKTREE,
                                env=full_env, stdout=out, stderr=err)


def finish(proc: subprocess.Popen, log: Path, timeout: float = 600) -> tuple[int, str, str]:
    """Wait for a `launch` process: (return code, stdout, stderr)."""
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return code, Path(f"{log}.out").read_text(), Path(f"{log}.err").read_text()


def run_worker(module: str, cases: list[str], timeout: float = 1700) -> list[dict]:
    """Run `python -m MODULE CASES...` (a worker that prints one JSON line per case, e.g. with
    forced host devices) from the worktree: its results, checked to be one per case, in order."""
    env = dict(os.environ, PYTHONPATH=str(WORKTREE))
    proc = subprocess.run([sys.executable, "-m", module, *cases], cwd=WORKTREE, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["case"] for r in results] == cases
    return results


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def checkpoint_params(ckpt_dir: Path, step: int, part: str = "params") -> dict[str, np.ndarray]:
    """The parameters (or another `part` of the train state: "opt_state") of
    `jtree.training.checkpoint` checkpoint `step` under `ckpt_dir` (whatever mesh wrote them), read
    onto this process's first device: {leaf path: array}."""
    import jax
    import orbax.checkpoint as ocp

    path = Path(ckpt_dir) / str(step) / "state"
    checkpointer = ocp.StandardCheckpointer()
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree_util.tree_map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
        checkpointer.metadata(path).item_metadata)
    leaves = checkpointer.restore(path, target)[part]
    return {jax.tree_util.keystr(k): np.asarray(a)
            for k, a in jax.tree_util.tree_leaves_with_path(leaves)}

# The fields of a metrics record that measure time (and the compiles a step waited for: a resumed
# run compiles at its first step), so differ between identical runs; every other field is computed.
TIMING_FIELDS = frozenset({"tokens_per_s", "tree_tokens_per_s", "host_s", "device_s", "compiles",
                           "compile_s"})


def computed_metrics(records: list[dict]) -> list[dict]:
    """Metrics records without their `TIMING_FIELDS`: what identical runs must agree on bit for
    bit."""
    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in records]
