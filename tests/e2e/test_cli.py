import json
import re
import subprocess
import sys

import pytest

from jtree.cli import main
from tests.run_util import WORKTREE, read_metrics, tiny_overrides, write_groups


def test_stats_prints_and_writes_json(sample_groups, tmp_path, capsys):
    out = tmp_path / "s.json"
    assert main(["stats", str(sample_groups), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "total" in text and "POR" in text
    data = json.loads(out.read_text())
    assert len(data["trees"]) == 32
    assert 0.5 < data["total"]["por"] < 0.8


def test_bad_file_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"group": 0, "tokens": [1, -1]}\n')
    assert main(["stats", str(bad)]) == 2
    assert "bad.jsonl:1: tokens[1] = -1 is negative" in capsys.readouterr().err


@pytest.mark.parametrize("line, args, error", [
    ('{"group": 0, "tokens": [1, 2, true]}', [], "tokens[2]: expected an integer, got true"),
    ('{"group": 0, "tokens": [1, 2], "weight": "2"}', [], 'weight: expected a number, got "2"'),
    ('{"group": null, "tokens": [1, 2]}', [], "group: expected a string or an integer"),
    ('{"group": 0, "tokens": [1, 600]}', ["--vocab-size", "512"],
     "tokens[1] = 600 is outside the vocabulary (size 512)"),
    ('{"group": 0, "tokens": [1, 2], "old_logprobs": [-1.0, 0.5]}', [],
     "old_logprobs[1] = 0.5 is above 0"),
])
def test_stats_refuses_what_training_refuses(tmp_path, capsys, line, args, error):
    """`jtree stats` reads a file as a run does (`jtree.training.tree_files.load_trees`)."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text(line + "\n")
    assert main(["stats", str(bad), *args]) == 2
    assert f"bad.jsonl:1: {error}" in capsys.readouterr().err


def test_train_runs_a_tiny_config(few_groups_file, tmp_path, capsys):
    """`jtree train` reaches the trainer with the launcher's arguments: config, overrides."""
    metrics = tmp_path / "metrics.jsonl"
    assert main(["train", "--config", "configs/tiny.yaml", *tiny_overrides(few_groups_file, **{
        "run.steps": 2, "data.trees_per_step": 2, "data.micro_batches": 1,
        "run.metrics_jsonl": metrics})]) == 0
    out = capsys.readouterr().out
    assert len(re.findall(r"^step +\d+/\d+ +loss +[\d.]+ ", out, re.M)) == 2
    assert "summary: steps 0-1" in out
    records = read_metrics(metrics)
    assert [r["step"] for r in records] == [0, 1]
    assert records[0]["compiles"] >= 1 and records[0]["compile_s"] > 0  # kept apart
    assert records[1]["compiles"] == 0


def test_train_says_which_attention_kernel_auto_runs(tmp_path, capsys):
    """On CPU with a compiler `auto` runs the faster of the C++ kernel and `xla` (measured per
    shape class), and the run's model line says so; the summary reports the utilization."""
    data = write_groups(tmp_path / "groups.jsonl", n_groups=2)
    assert main(["train", "--config", "configs/tiny.yaml", *tiny_overrides(data, **{
        "run.steps": 1, "data.trees_per_step": 2, "data.micro_batches": 1,
        "runtime.attention_impl": "auto"})]) == 0
    out = capsys.readouterr().out
    assert "backend cpu, attention auto (cpu or xla: the faster, measured);" in out
    assert re.search(r"utilization: model [\d.]+ GFLOP/step, [\d.]+ GFLOP/s = MFU [\d.]+% of a "
                     r"plain matmul here \(\[\d+, \d+\] x \[\d+, \d+\] float32", out)


def test_train_resume_without_a_checkpoint_dir_is_a_clear_error(few_groups_file, tmp_path, capsys):
    assert main(["train", "--config", "configs/tiny.yaml", "--resume",
                 *tiny_overrides(few_groups_file)]) == 2
    assert ("jtree train: error: ValueError: --resume: checkpoint.dir is not set"
            in capsys.readouterr().err)


@pytest.mark.parametrize("command", [["-m", "jtree.cli", "train"], ["-m", "jtree.launch.train"]],
                         ids=["jtree_train", "jtree.launch.train"])
def test_train_help_prints_a_usage_line(command):
    """Both entry points take the same arguments."""
    done = subprocess.run([sys.executable, *command, "--help"], cwd=WORKTREE, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert re.match(r"usage: .*\[--config CONFIG\] \[--resume\]", done.stdout)
    assert "overrides" in done.stdout
