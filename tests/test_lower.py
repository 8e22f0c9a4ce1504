"""The sharded train step (data x tensor parallel, optax update) lowers for TPU and CUDA on this
CPU machine (`launch/lower_step.py`); nothing is compiled for or run on the chips."""

import os
import subprocess
import sys

import pytest

WORKTREE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_tiny_step_lowers_for_accelerators(platform):
    env = dict(os.environ, PYTHONPATH=WORKTREE)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "launch.lower_step", "--config", "configs/tiny.yaml", "--platform",
         platform, "--devices", "4", "mesh.model=2", "data.seq_len=128",
         "model.num_hidden_layers=1"],
        cwd=WORKTREE, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"for {platform}:" in proc.stdout and "mesh data=2 x model=2" in proc.stdout
    assert "all_reduce" in proc.stdout  # tensor- and data-parallel collectives are in the module
