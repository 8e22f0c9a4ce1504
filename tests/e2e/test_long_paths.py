"""A path longer than a row through the launcher: in tree mode it stops the run naming the
record, the length and the two ways out, or with `data.on_bad_record=skip` is skipped and counted;
`run.mode=redundancy_free` splits long paths, so there it is no bad record."""

import json
import re

from jtree.launch.train import main
from tests.run_util import tiny_overrides, write_groups


def _data_with_a_long_group(tmp_path):
    data = write_groups(tmp_path / "groups.jsonl", n_groups=4)
    with open(data, "a") as f:
        f.write(json.dumps({"group": "long", "tokens": [3] * 200}) + "\n")
    return data, sum(1 for _ in open(data))


def test_tree_mode_names_the_long_record_or_skips_it(tmp_path, capsys):
    data, n_lines = _data_with_a_long_group(tmp_path)
    args = ["--config", "configs/tiny.yaml",
            *tiny_overrides(data, **{"run.steps": 0, "data.trees_per_step": 2})]
    assert main(args) == 2  # a user error: one line naming the record, length and ways out
    err = capsys.readouterr().err
    assert re.search(rf'ValueError: {data}:{n_lines} \(id "long"\): path 0 has 200 '
                     r"tokens, more than a row holds \(data.seq_len=128\); "
                     r"raise data.seq_len, or train with run.mode=redundancy_free", err), err
    assert main(args + ["data.on_bad_record=skip"]) == 0
    out = capsys.readouterr().out
    assert "data: 4 trees" in out and f"skipped 1 bad record(s), first: {data}:{n_lines}" in out


def test_redundancy_free_mode_keeps_the_long_record(tmp_path, capsys):
    data, _ = _data_with_a_long_group(tmp_path)
    assert main(["--config", "configs/tiny.yaml",
                 *tiny_overrides(data, **{"run.steps": 0, "data.trees_per_step": 2,
                                          "data.micro_batches": 1, "run.mode": "redundancy_free",
                                          "runtime.attention_impl": "xla"})]) == 0
    out = capsys.readouterr().out
    assert "data: 5 trees" in out and "bad record(s)" not in out
