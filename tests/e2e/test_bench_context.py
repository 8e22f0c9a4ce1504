"""The context-parallel balance bench on a tiny config: the table, JSON and plot are written and
the balanced split is no worse than the even one (no timing: it is planning only)."""

import json

from jtree.launch import bench_context


def test_bench_context_quick_writes_its_outputs(tmp_path):
    report = bench_context.main(["--config", "configs/tiny.yaml", "--context", "4", "--quick",
                                 "--out", str(tmp_path)])
    assert {p.name for p in tmp_path.iterdir()} == {
        "bench_context.json", "bench_context.md", "bench_context.png"}
    assert json.loads((tmp_path / "bench_context.json").read_text())["context"] == 4
    assert report["worst_balanced_ratio"] <= report["worst_even_ratio"]
    assert len(report["devices"]) == 4
    for row in report["summary"]:
        assert sum(row["tokens"]) == row["tree_tokens"]
