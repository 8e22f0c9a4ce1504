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


def test_auto_mode_logs_each_steps_choice_and_trains_like_tree_mode(capsys):
    """`run.mode=auto` on the sample trees (POR ~0.6): every step says which mode it chose and
    why, and the losses are those of a tree-mode run (both modes are exact)."""
    common = ["--config", "configs/tiny.yaml", "run.steps=2", "data.trees_per_step=2",
              "model.num_hidden_layers=1", "model.hidden_size=32", "model.intermediate_size=64",
              "run.compare_baseline=false"]
    losses = {}
    for mode in ("auto", "tree"):
        assert main(common + [f"run.mode={mode}"]) == 0
        out = capsys.readouterr().out
        losses[mode] = [float(x) for x in re.findall(r"^step +\d+ +loss +([\d.]+)", out, re.M)]
        if mode == "auto":
            reasons = re.findall(r"auto mode: (tree|baseline) \(predicted gain ([\d.]+)x", out)
            assert len(reasons) == 2 and all(m == "tree" for m, _ in reasons), out
    assert losses["auto"] == losses["tree"]
