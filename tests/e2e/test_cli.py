import json

from jtree.cli import main


def test_stats_prints_and_writes_json(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert main(["stats", "data/sample_groups.jsonl", "--json", str(out)]) == 0
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
