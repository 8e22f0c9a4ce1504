import re

from launch.train import main


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
