"""MoE token dispatch (`expert_dispatch="all_to_all"`, jtree.models.moe) equals the single-device
block: output, routing, loss (router load-balancing loss included) and every gradient, float32,
on 2 and 4 expert shards, with the router biased so that every assignment goes to one shard and
with replayed experts (routing replay);
and a whole tiny MoE train step with it equals the single-device step.

The meshes run in a subprocess (`tests/moe_dispatch_worker.py`, 8 forced host devices; train-step
cases as `tests/mesh_worker.py` runs them). Tolerances as in docs/design.md: 1e-5 relative.
"""

import json
import os
import subprocess
import sys

import pytest

from jtree.config.runtime import RuntimeConfig
from tests.run_util import WORKTREE


def run_worker(cases: list[str]) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(WORKTREE))
    proc = subprocess.run([sys.executable, "-m", "tests.moe_dispatch_worker", *cases],
                          cwd=WORKTREE, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["case"] for r in results] == cases
    return results


def check(result: dict) -> None:
    if result["case"].startswith("layer:"):
        assert result["out_rel_l2"] <= 1e-5, result
        assert result["probs_rel_l2"] <= 1e-5 and result["same_experts"], result
        assert result["loss_rel"] <= 1e-5, result
        assert result["grads_rel_l2"] <= 1e-5, result
        assert result["sharded_leaves"] > 0, result  # the experts really were split
        if ":uneven:" in result["case"]:
            assert result["first_shard_share"] > 0.9, result
        return
    for key in ("loss_rel", "grad_norm_rel", "grads_rel_l2", "params_rel_l2"):
        assert result[key] <= 1e-5, result
    assert result["model_sharded"] > 0, result  # the experts really were split


def test_dispatch_equals_one_device_on_2_and_4_expert_shards():
    # (gptoss: gpt-oss's block, router and expert biases and the clamped SwiGLU)
    # (gptoss...:psum:tiled: the GPU form of the experts' matmul, `expert_matmul="tiled"`, against
    # the single-device block on `ragged_dot`: other devices' tiles skipped, gradients summed
    # over the right mesh axes)
    cases = ["layer:moe:uneven:2", "layer:shared:uneven:4", "layer:moe:replay:4",
             "layer:gptoss:replay:4", "layer:gptoss:replay:4:psum:tiled", "moe_a2a:tree:sft:4x1x2"]
    for result in run_worker(cases):
        check(result)


@pytest.mark.slow
def test_dispatch_every_block_routing_and_mesh():
    cases = [f"layer:{kind}:{routing}:{shards}" for kind in ("moe", "shared")
             for routing in ("random", "uneven") for shards in (2, 4)]
    cases += ["layer:shared:uneven:2:psum:tiled", "layer:moe:random:4:all_to_all:tiled"]
    cases += ["moe_a2a:baseline:sft:2x1x4", "moe_a2a:tree:ppo:2x1x4", "next_a2a:tree:sft:4x1x2",
              "next_a2a:baseline:sft:2x1x4", "moe_a2a:tree:sft:2x2x2"]
    for result in run_worker(cases):
        check(result)


def test_unknown_expert_dispatch_is_refused():
    with pytest.raises(ValueError, match="expert_dispatch: 'ragged'"):
        RuntimeConfig(expert_dispatch="ragged")
