import re

import pytest

from launch.train import main
from tests.run_util import tiny_overrides, write_groups


def test_demo_job_runs_end_to_end(capsys):
    """The `make demo` job on a shrunken model: per-step lines, equivalence and speedup."""
    rc = main(["--config", "configs/tiny.yaml", "run.steps=2", "data.trees_per_step=2",
               "data.micro_batches=2", "model.num_hidden_layers=1", "model.hidden_size=32",
               "model.intermediate_size=64", "run.timing_repeats=1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert len(re.findall(r"^step +\d+ +loss +[\d.]+ .*tokens/s .*POR", out, re.M)) == 2
    diff = float(re.search(r"equivalence: .* = ([\d.e+-]+)", out).group(1))
    assert diff <= 1e-5
    assert re.search(r"speedup [\d.]+x", out)


@pytest.mark.parametrize("compare", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["train", "with_baseline_check"])
def test_qwen3_next_job_runs_with_chunk_tables(tmp_path, capsys, compare):
    """The launcher on a one-layer Qwen3-Next (Gated DeltaNet + MoE with shared expert, router
    loss on): the pipeline adds GDN chunk tables and the step trains; the slow variant also checks
    that the tree log-probs equal the per-path baseline's (three more compiles)."""
    data = write_groups(tmp_path / "groups.jsonl", n_groups=4)
    rc = main(["--config", "configs/tiny.yaml", *tiny_overrides(data, **{
        "model.architecture": "qwen3_next", "model.layer_types": "[linear_attention]",
        "model.num_experts": 4, "model.moe_intermediate_size": 16,
        "model.shared_expert_intermediate_size": 16, "model.output_router_logits": "true",
        "model.router_aux_loss_coef": 0.1, "data.gdn_chunk_size": 8, "run.steps": 1,
        "data.micro_batches": 1, "run.compare_baseline": str(compare).lower(),
        "run.timing_repeats": 1, "model.tie_word_embeddings": "false"})])
    out = capsys.readouterr().out
    assert rc == 0
    assert "model: qwen3_next" in out
    assert len(re.findall(r"^step +0 +loss +[\d.]+ ", out, re.M)) == 1
    if compare:
        diff = float(re.search(r"equivalence: .* = ([\d.e+-]+)", out).group(1))
        assert diff <= 1e-5
