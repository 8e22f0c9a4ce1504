"""The step builders of a run (`jtree.training.run_data.StepBuilders`): each mode is laid out by one builder,
made once, so the run's pipeline and the end-of-run baseline check use the same steps at the same
shapes."""

from jtree.config import load_config
from jtree.training.run_data import StepBuilders, load_training_trees
from jtree.training.step_builders import all_units, rows_for_run, step_indices
from tests.run_util import tiny_overrides, write_groups


def test_builders_are_made_once_and_only_trained_modes_take_the_configured_rows(tmp_path):
    data = write_groups(tmp_path / "groups.jsonl", n_groups=6)
    cfg = load_config("configs/tiny.yaml", tiny_overrides(data, **{
        "run.mode": "tree", "data.rows_per_micro_batch": 3, "run.steps": 2}))
    trees, _ = load_training_trees(cfg)
    builders = StepBuilders(cfg, trees, n_data=1, shards=(0,))
    assert builders.rows == {"tree": 3}  # the trained mode, built up front
    tree = builders["tree"]
    assert builders["tree"] is tree

    baseline = builders["baseline"]  # built on first use, at the rows that hold the run's steps
    assert builders["baseline"] is baseline
    d = cfg.data
    units = all_units(trees, "baseline", d.seq_len, d.partition_method)
    assert builders.rows["baseline"] == rows_for_run(units, d.seq_len, d.trees_per_step,
                                                     d.micro_batches, d.shuffle_seed, 2)
    first = step_indices(len(trees), d.trees_per_step, d.shuffle_seed)[0]
    shapes = {m: builders[m](first)["inputs"].tokens.shape for m in ("tree", "baseline")}
    assert shapes["tree"] == (d.micro_batches, 3, d.seq_len)
    assert shapes["baseline"] == (d.micro_batches, builders.rows["baseline"], d.seq_len)


def test_auto_mode_trains_both_layouts():
    cfg = load_config("configs/tiny.yaml", ["run.mode=auto", "run.steps=1"])
    trees, _ = load_training_trees(cfg)
    assert set(StepBuilders(cfg, trees, n_data=1, shards=(0,)).rows) == {"tree", "baseline"}


def test_prune_zero_gradient_applies_grpo_advantages_and_counts_saved_tokens(tmp_path, capsys):
    """Groups whose rewards all agree get GRPO advantage 0: with `data.prune_zero_gradient` such
    a group is left out of its step and counted; a KL term makes every path count again."""
    import json
    path = tmp_path / "g.jsonl"
    groups = {0: ([[1, 2, 3, 4], [1, 2, 5, 6], [1, 7]], [1.0, 1.0, 1.0]),  # all equal: zero
              1: ([[1, 2, 3, 8], [1, 2, 9]], [0.0, 1.0])}
    path.write_text("".join(json.dumps({"group": g, "tokens": s, "reward": r}) + "\n"
                            for g, (seqs, rs) in groups.items() for s, r in zip(seqs, rs)))
    base = tiny_overrides(path, **{"run.mode": "tree", "run.steps": 1, "data.trees_per_step": 2,
                                   "data.micro_batches": 1, "objective.kind": "ppo",
                                   "objective.advantage": "grpo",
                                   "data.prune_zero_gradient": True})
    cfg = load_config("configs/tiny.yaml", base)
    trees, _ = load_training_trees(cfg)
    info = StepBuilders(cfg, trees, n_data=1, shards=(0,))["tree"](
        step_indices(len(trees), 2, cfg.data.shuffle_seed)[0])["info"]
    assert int(info["n_pruned_tokens"]) == 7  # group 0's tree: [1,2] [3,4] [5,6] [7]
    assert "7 of 12 tree tokens" in capsys.readouterr().out
    cfg = load_config("configs/tiny.yaml", base + ["objective.kl_coef=0.1"])
    builder = StepBuilders(cfg, trees, n_data=1, shards=(0,))["tree"]
    assert "nothing to prune (objective.kl_coef > 0" in capsys.readouterr().out
    assert int(builder(step_indices(len(trees), 2, 0)[0])["info"]["n_pruned_tokens"]) == 0
