"""The bench harness (`jtree.launch.bench.harness`): rounds alternate the variants in shuffled orders,
comparisons are medians of same-round ratios (with a bootstrap interval), and every bench's
outputs are named and written one way."""

import json

import numpy as np
import pytest

from jtree.launch.bench.harness import Column, Output, Timings, alternate, figure, markdown_table


def test_rounds_alternate_the_variants_after_the_warmup():
    calls = []

    def variant(name):
        def run():
            calls.append(name)
            return len(calls)
        return run

    timings = alternate({"a": variant("a"), "b": variant("b"), "c": variant("c")}, 6, warmup=1)
    # The warm-up round in the given order, then every variant once per round, in an order that
    # changes from round to round (so no variant always follows the same one).
    assert calls[:3] == ["a", "b", "c"]
    rounds = [tuple(calls[i:i + 3]) for i in range(3, len(calls), 3)]
    assert len(rounds) == 6 and all(sorted(r) == ["a", "b", "c"] for r in rounds)
    assert len(set(rounds)) > 1
    assert timings.rounds == 6 and timings.first_result == {"a": 1, "b": 2, "c": 3}
    assert set(timings.first_s) == {"a", "b", "c"}
    assert all(len(timings.wall[k]) == len(timings.cpu[k]) == len(timings.faults[k]) == 6
               for k in "abc")


def test_budget_adds_rounds_up_to_the_maximum():
    timings = alternate({"a": lambda: None}, 1, warmup=0, max_rounds=3, budget_s=60.0)
    assert timings.rounds == 3
    assert alternate({"a": lambda: None}, 2, warmup=0, max_rounds=5).rounds == 2
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        alternate({"a": lambda: None}, 0)


def test_ratio_is_the_median_of_same_round_ratios_not_the_ratio_of_medians():
    # Round 2 ran under load (both variants slow): paired, its ratio is still 2.
    t = Timings(wall={"tree": [1.0, 10.0, 1.2], "base": [2.0, 20.0, 3.0]},
                cpu={"tree": [1.0, 1.0, 1.0], "base": [3.0, 3.0, 3.0]},
                faults={"tree": [0] * 3, "base": [0] * 3}, first_s={}, first_result={})
    assert t.ratio("base", "tree") == pytest.approx(2.0)
    assert t.median("base") / t.median("tree") == pytest.approx(2.5)
    assert t.ratio("base", "tree", cpu=True) == pytest.approx(3.0)
    assert t.ratios("base", "tree").tolist() == pytest.approx([2.0, 2.0, 2.5])
    assert t.medians_ms() == pytest.approx({"tree": 1200.0, "base": 3000.0})


def _paired(tree: list[float], ratios: np.ndarray) -> Timings:
    """Rounds where "base" took `ratios` times as long as "tree"."""
    return Timings(wall={"base": list(np.asarray(tree) * ratios), "tree": list(tree)},
                   cpu={}, faults={}, first_s={}, first_result={})


def test_ratio_interval_brackets_the_median_and_tells_noise_from_a_difference():
    rng = np.random.default_rng(1)
    base = list(1 + rng.random(31))  # the load changes from round to round
    noise = 1 + 0.02 * rng.standard_normal(31)
    same, faster, slower = (_paired(base, noise * f) for f in (1.0, 1.1, 0.9))
    low, high = same.ratio_interval("base", "tree")
    assert low < same.ratio("base", "tree") < high and low < 1 < high
    assert same.compare("base", "tree") == "parity"
    assert faster.compare("base", "tree") == "faster"
    assert faster.ratio_interval("base", "tree")[0] > 1
    assert slower.compare("base", "tree") == "slower"
    assert slower.ratio_interval("base", "tree")[1] < 1
    # Deterministic (a fixed seed), and a wider level gives a wider interval.
    assert same.ratio_interval("base", "tree") == (low, high)
    wide = same.ratio_interval("base", "tree", level=0.999)
    assert wide[0] <= low and high <= wide[1]


def test_output_writes_name_json_md_png(tmp_path):
    fig, ax = figure(1, (4, 3))
    ax.plot([0, 1], [1, 2])
    rows = [{"x": np.float32(1.5), "n": np.int64(3)}, {"x": 2.0}]
    table = markdown_table(rows, [Column("x", "x", "{:.1f}"), Column("n", "n"),
                                  Column("2n", "", cell=lambda r: str(2 * r.get("n", 0)))])
    assert table.splitlines() == ["| x | n | 2n |", "| --- | --- | --- |", "| 1.5 | 3 | 6 |",
                                  "| 2.0 | - | 0 |"]
    written = Output(tmp_path / "run", "bench_x").write({"rows": rows, "a": np.arange(2)},
                                                       table=table, fig=fig)
    assert [p.name for p in written] == ["bench_x.json", "bench_x.md", "bench_x.png"]
    assert json.loads(written[0].read_text()) == {"rows": [{"x": 1.5, "n": 3}, {"x": 2.0}],
                                                  "a": [0, 1]}
    assert written[1].read_text() == table + "\n"
    assert written[2].stat().st_size > 1000
