"""Records a run cannot train on: each names its `file:line` (and record id) and the field or key
to change, and under `on_bad_record="skip"` is skipped and counted like any bad record. A path
longer than a row (only where the run's mode trains whole paths in rows), a byte that is not
UTF-8, a field that is not a number, and an old log-probability above 0."""

import json

import pytest

from jtree.training.tree_files import load_trees
from jtree.trees.chat import ByteTokenizer, conversation_tree
from jtree.trees.tree import TrajectoryTree
from tests.run_util import VOCAB


def _write(path, records) -> str:
    path.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n"
                              for r in records))
    return str(path)


GOOD_TREE = {"parents": [-1, 0, 0], "segments": [[1, 2], [3], [4]]}
LONG_TREE = {"id": "chat-17", "parents": [-1, 0], "segments": [[1] * 6, [2] * 5]}


def test_a_path_longer_than_a_row_names_record_length_row_and_the_ways_out(tmp_path):
    path = _write(tmp_path / "t.jsonl", [GOOD_TREE, LONG_TREE, GOOD_TREE])
    with pytest.raises(ValueError) as e:
        load_trees(path, "trees", vocab_size=VOCAB, max_path_len=8)
    assert str(e.value) == (
        f'{path}:2 (id "chat-17"): path 0 has 11 tokens, more than a row holds '
        "(data.seq_len=8); raise data.seq_len, or train with run.mode=redundancy_free, which "
        "splits long paths")
    trees, report = load_trees(path, "trees", vocab_size=VOCAB, max_path_len=8,
                               on_bad_record="skip")
    assert (report.n_lines, report.n_trees, report.n_bad) == (3, 2, 1)
    assert report.first_errors[0].startswith(f'{path}:2 (id "chat-17"): path 0 has 11 tokens')
    # a mode that splits long paths (max_path_len None) trains it
    trees, report = load_trees(path, "trees", vocab_size=VOCAB)
    assert report.n_bad == 0 and trees[1].path_lengths.tolist() == [11]


def test_a_long_sequence_of_a_group_names_its_line_and_group_and_skips_the_group(tmp_path):
    path = _write(tmp_path / "g.jsonl", [
        {"group": "a", "tokens": [1, 2, 3]},
        {"group": "b", "tokens": [4, 5]},
        {"group": "a", "tokens": [1, 2, 3, 4, 5, 6, 7, 8, 9]},
    ])
    with pytest.raises(ValueError, match=rf'^{path}:3 \(id "a"\): path 1 has 9 tokens, more than '
                                         r"a row holds \(data.seq_len=8\)"):
        load_trees(path, "groups", vocab_size=VOCAB, max_path_len=8)
    trees, report = load_trees(path, "groups", vocab_size=VOCAB, max_path_len=8,
                               on_bad_record="skip")
    assert (report.n_trees, report.n_bad) == (1, 2)  # both lines of group "a"
    assert trees[0].path_lengths.tolist() == [2]


def test_a_long_conversation_is_a_bad_record_of_a_chat_file(tmp_path):
    short = {"messages": [{"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "Hello"}]}
    long = {"id": 7, "messages": [{"role": "user", "content": "x" * 300},
                                  {"role": "assistant", "content": "y"}]}
    path = _write(tmp_path / "c.jsonl", [short, long])
    with pytest.raises(ValueError, match=rf"^{path}:2 \(id 7\): path 0 has 3\d\d tokens, more "
                                         r"than a row holds \(data.seq_len=256\); raise "
                                         r"data.seq_len, or train with run.mode=redundancy_free"):
        load_trees(path, "chat", vocab_size=None, max_path_len=256)
    trees, report = load_trees(path, "chat", vocab_size=None, max_path_len=256,
                               on_bad_record="skip")
    assert (report.n_trees, report.n_bad) == (1, 1)


@pytest.mark.parametrize("fmt, good", [
    ("trees", GOOD_TREE), ("groups", {"group": 0, "tokens": [1]}),
    ("chat", {"messages": [{"role": "assistant", "content": "ok"}]}),
])
def test_a_byte_that_is_not_utf8_is_a_bad_record_at_its_line(tmp_path, fmt, good):
    bad = json.dumps(good).encode().replace(b"{", b'{"\xff": 1, ', 1)
    path = _write(tmp_path / "x.jsonl", [good, bad, good])
    with pytest.raises(ValueError, match=rf"^{path}:2: not UTF-8 \(byte 0xff at column 3\)$"):
        load_trees(path, fmt, vocab_size=None)
    trees, report = load_trees(path, fmt, vocab_size=None, on_bad_record="skip")
    assert (report.n_lines, report.n_bad) == (3, 1)
    assert len(trees) == (1 if fmt == "groups" else 2)  # the two good lines form one group


def test_utf8_text_of_a_chat_is_read_as_utf8(tmp_path):
    rec = {"messages": [{"role": "user", "content": "héllo ✓"},
                        {"role": "assistant", "content": "日本"}]}
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps(rec, ensure_ascii=False) + "\n", encoding="utf-8")
    trees, _ = load_trees(path, "chat", vocab_size=None)
    assert trees[0].n_tree_tokens == conversation_tree(rec, ByteTokenizer()).n_tree_tokens


def test_a_field_that_is_not_a_number_is_named(tmp_path):
    tree = dict(GOOD_TREE, paths=[{"node": 1, "advantage": 1.0}, {"node": 2, "advantage": "high"}])
    path = _write(tmp_path / "t.jsonl", [tree])
    with pytest.raises(ValueError, match=rf"^{path}:1: path 1: advantage: expected a number or a "
                                         r'list of numbers, got "high"$'):
        load_trees(path, "trees", vocab_size=VOCAB)
    path = _write(tmp_path / "g.jsonl", [{"group": 0, "tokens": [1, 2], "advantage": 1.0},
                                         {"group": 0, "tokens": [1, 3], "advantage": "high"}])
    with pytest.raises(ValueError, match=rf"^{path}:2: advantage: expected a number or a list of "
                                         r'numbers, got "high"$'):
        load_trees(path, "groups", vocab_size=VOCAB)
    path = _write(tmp_path / "w.jsonl", [dict(GOOD_TREE, paths=[{"node": 1, "weight": 1},
                                                                {"node": 2, "weight": "x"}])])
    with pytest.raises(ValueError, match=rf'^{path}:1: path 1: weight: expected a number, '
                                         r'got "x"$'):
        load_trees(path, "trees", vocab_size=VOCAB)
    with pytest.raises(ValueError, match=r"^sequence 0: tokens: expected numbers"):
        TrajectoryTree.from_sequences([[1, [2, 3]]])


def test_an_old_logprob_above_zero_names_record_path_and_field(tmp_path):
    paths = [{"node": 1, "old_logprobs": [0.0, -1.0, -2.0]},
             {"node": 2, "old_logprobs": [0.0, -1.0, 0.5]}]
    path = _write(tmp_path / "t.jsonl", [dict(GOOD_TREE, paths=paths), GOOD_TREE])
    with pytest.raises(ValueError, match=rf"^{path}:1: path 1: old_logprobs\[2\] = 0.5 is above 0 "
                                         r"\(a log-probability is <= 0\)$"):
        load_trees(path, "trees", vocab_size=VOCAB)
    trees, report = load_trees(path, "trees", vocab_size=VOCAB, on_bad_record="skip")
    assert (report.n_trees, report.n_bad) == (1, 1)
    path = _write(tmp_path / "g.jsonl", [{"group": 0, "tokens": [1, 2], "old_logprobs": [0, 0.5]}])
    with pytest.raises(ValueError, match=rf"^{path}:1: old_logprobs\[1\] = 0.5 is above 0"):
        load_trees(path, "groups", vocab_size=VOCAB)


def test_old_logprobs_at_zero_within_rounding_or_at_the_unscored_first_token_are_accepted():
    t = TrajectoryTree.from_sequences([[1, 2, 3]], old_logprobs=[[9.0, 0.0, 5e-4]])
    assert t.old_logprobs[0].tolist() == pytest.approx([9.0, 0.0, 5e-4])
    with pytest.raises(ValueError, match=r"sequence 0: old_logprobs\[1\] = nan is not finite"):
        TrajectoryTree.from_sequences([[1, 2, 3]], old_logprobs=[[0.0, float("nan"), -1.0]])


def test_a_lone_surrogate_in_a_chat_message_names_the_message_field(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"messages": [{"role": "assistant", "content": "a\\ud800b"}]}\n')
    with pytest.raises(ValueError, match=rf"^{path}:1: messages\[0\]\.content: not valid Unicode"):
        load_trees(path, "chat", vocab_size=None)
