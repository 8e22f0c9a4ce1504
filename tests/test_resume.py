"""Exact resume: 2N uninterrupted steps == N steps, SIGKILL right after the checkpoint, resume, N
more. Same per-step losses and same final parameters, bit for bit (same program, same machine),
including the data order (grain iterator state in the checkpoint, restored with a worker process
feeding the resumed run)."""

import signal

import jax
import numpy as np
import orbax.checkpoint as ocp

from launch.train import main
from tests.run_util import finish, launch, read_metrics, tiny_overrides, write_groups

N = 3


def _params(ckpt_dir, step):
    state = ocp.StandardCheckpointer().restore(ckpt_dir / str(step) / "state")
    return jax.tree_util.tree_leaves(state["params"])


def test_killed_run_resumes_exactly(tmp_path):
    data = write_groups(tmp_path / "groups.jsonl")
    common = tiny_overrides(data, **{"run.steps": 2 * N, "checkpoint.every": N})

    straight = tmp_path / "straight"
    assert main(["--config", "configs/tiny.yaml", *common, f"checkpoint.dir={straight}",
                 f"run.metrics_jsonl={straight}/metrics.jsonl"]) == 0

    resumed = tmp_path / "resumed"
    args = ["--config", "configs/tiny.yaml", *common, f"checkpoint.dir={resumed}",
            f"run.metrics_jsonl={resumed}/metrics.jsonl", "data.worker_count=1"]
    log = tmp_path / "killed"
    code, out, err = finish(launch(args + [f"run.kill_after_checkpoint={N}"], log), log)
    assert code == -signal.SIGKILL, err[-3000:]
    assert f"checkpoint {N} committed" in out
    assert [r["step"] for r in read_metrics(resumed / "metrics.jsonl")][:N] == list(range(N))

    log = tmp_path / "again"
    code, out, err = finish(launch(args + ["--resume"], log), log)
    assert code == 0, err[-3000:]
    assert f"(step {N})" in out

    a, b = read_metrics(straight / "metrics.jsonl"), read_metrics(resumed / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(2 * N))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["n_tree_tokens"] for r in a] == [r["n_tree_tokens"] for r in b]
    assert len({r["loss"] for r in a}) == 2 * N  # the steps really differ
    for x, y in zip(_params(straight, 2 * N), _params(resumed, 2 * N)):
        np.testing.assert_array_equal(x, y)
