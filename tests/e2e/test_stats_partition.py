import json

import numpy as np

from jtree.cli import main
from jtree.trees.jsonl import read_sequence_groups
from jtree.trees.plot import node_layout, overlap_curve
from tests.strategies import explicit_tree, random_forest


def test_stats_with_capacity_reports_every_method(sample_groups, tmp_path, capsys):
    out = tmp_path / "s.json"
    assert main(["stats", str(sample_groups), "--capacity", "600", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "partition, capacity 600" in text and "dp_multi" in text
    data = json.loads(out.read_text())
    assert data["capacity"] == 600
    trees = read_sequence_groups(sample_groups)
    for tree, entry in zip(trees, data["trees"]):
        h = entry["partition"]["heuristic"]
        assert h["n_computed"] >= tree.n_tree_tokens
        assert h["err"] <= tree.stats().por + 1e-12
        assert h["parts"] == 1 or tree.n_tree_tokens > 600
        multi = entry["partition"]["dp_multi"]
        if "refused" not in multi:
            assert multi["n_computed"] <= min(h["n_computed"],
                                              entry["partition"]["dp_single"]["n_computed"])
    total = data["total"]["partition"]["heuristic"]
    assert total["n_computed"] == sum(e["partition"]["heuristic"]["n_computed"]
                                      for e in data["trees"])


def test_stats_plot_writes_a_png(sample_groups, tmp_path, capsys):
    png = tmp_path / "tree.png"
    assert main(["stats", str(sample_groups), "--capacity", "600", "--methods", "heuristic",
                 "--plot", str(png), "--plot-tree", "3"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000


def test_stats_capacity_below_a_path_names_tree_and_path(sample_groups, capsys):
    assert main(["stats", str(sample_groups), "--capacity", "100"]) == 2
    err = capsys.readouterr().err
    assert "tree 0: path" in err and "more than capacity=100" in err


def test_stats_unknown_method(sample_groups, capsys):
    assert main(["stats", str(sample_groups), "--capacity", "600", "--methods", "best"]) == 2
    assert "--methods: 'best'" in capsys.readouterr().err


def test_overlap_curve_areas_are_flat_and_tree_tokens():
    rng = np.random.default_rng(0)
    for _ in range(20):
        tree = explicit_tree(random_forest(rng, max_nodes=10))
        baseline, counts = overlap_curve(tree)
        s = tree.stats()
        assert baseline.sum() == s.n_flat_tokens and counts.sum() == s.n_tree_tokens
        assert np.all(counts <= baseline) and baseline[0] == tree.n_paths
        start, y = node_layout(tree)
        has_parent = tree.parents >= 0
        assert np.all(start[has_parent] > start[tree.parents[has_parent]])


def test_stats_redundancy_free_computes_every_tree_token_once(sample_groups, tmp_path, capsys):
    out = tmp_path / "s.json"
    # the duplicating heuristic cannot hold long paths
    assert main(["stats", str(sample_groups), "--capacity", "100", "--method",
                 "redundancy_free,heuristic", "--json", str(out)]) == 2
    assert main(["stats", str(sample_groups), "--capacity", "100", "--method", "redundancy_free",
                 "--json", str(out)]) == 0
    assert "redundancy_free" in capsys.readouterr().out
    data = json.loads(out.read_text())
    for tree, entry in zip(read_sequence_groups(sample_groups), data["trees"]):
        r = entry["partition"]["redundancy_free"]
        assert r["n_computed"] == tree.n_tree_tokens
        assert abs(r["err"] - tree.stats().por) < 1e-12
        assert r["parts"] >= -(-tree.n_tree_tokens // 100)
    assert data["total"]["partition"]["redundancy_free"]["n_computed"] == data["total"][
        "n_tree_tokens"]
