"""Chat data in every command: `jtree stats` and `jtree compare-torch` read conversations as
training does (`--format chat --tokenizer ...`), a file of another format is refused in one line
naming `--format`, and the plot of a conversation marks where each message starts."""

import json

import numpy as np
import pytest

from jtree.cli import main
from jtree.trees.chat import ByteTokenizer, conversation_tree
from jtree.trees.plot import node_boundaries, node_layout

CHAT = {"messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "two and two"},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "Bye"},
]}


def write_chats(path, n=3):
    """`n` conversations: CHAT with a different first user message each."""
    with open(path, "w") as f:
        for i in range(n):
            rec = json.loads(json.dumps(CHAT))
            rec["messages"][1]["content"] = "Hi" + "!" * i
            f.write(json.dumps(rec) + "\n")
    return path


def test_stats_reads_chat_files(tmp_path, capsys):
    data = write_chats(tmp_path / "chat.jsonl")
    out = tmp_path / "s.json"
    assert main(["stats", str(data), "--format", "chat", "--tokenizer", "bytes",
                 "--capacity", "256", "--methods", "heuristic", "--json", str(out)]) == 0
    assert "total" in capsys.readouterr().out
    report = json.loads(out.read_text())
    want = conversation_tree(json.loads(data.read_text().splitlines()[0]), ByteTokenizer())
    assert len(report["trees"]) == 3
    assert report["trees"][0]["n_tree_tokens"] == want.n_tree_tokens
    assert report["trees"][0]["n_paths"] == 3 and report["trees"][0]["n_nodes"] == want.n_nodes
    assert report["total"]["partition"]["heuristic"]["parts"] >= 3


@pytest.mark.parametrize("given, record, found", [
    ("groups", CHAT, "chat"),
    ("chat", {"group": 0, "tokens": [1, 2]}, "groups"),
    ("trees", {"group": 0, "tokens": [1, 2]}, "groups"),
])
def test_a_file_of_another_format_is_refused_naming_the_option(tmp_path, capsys, given, record,
                                                                 found):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(record) + "\n")
    assert main(["stats", str(data), "--format", given]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"d.jsonl:1: a {found!r} record" in err and f"set --format={found}" in err


def test_chat_plot_marks_every_message_boundary(tmp_path):
    """A conversation is a chain of nodes on one row: one tick where each message starts (the
    bars alone would draw one flat bar), and the picture is written."""
    plain = json.loads(json.dumps(CHAT))
    del plain["messages"][4]["reasoning_content"]
    tree = conversation_tree(plain, ByteTokenizer())
    ticks = node_boundaries(tree)
    lengths = [len(s) for s in tree.segments]
    assert tree.parents.tolist() == list(range(-1, len(lengths) - 1))  # a chain
    np.testing.assert_array_equal(ticks[:, 0], np.cumsum(lengths)[:-1])
    assert np.all(ticks[:, 1] == node_layout(tree)[1][0])  # all on the conversation's row

    data = write_chats(tmp_path / "chat.jsonl", n=1)
    png = tmp_path / "chat.png"
    assert main(["stats", str(data), "--format", "chat", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_think_turn_boundaries_include_its_branch():
    """With reasoning, the trained turn is a leaf branch beside the turn later messages see: its
    start is marked on its own row, at the same position as its reasoning-free sibling."""
    tree = conversation_tree(CHAT, ByteTokenizer())
    start, y = node_layout(tree)
    ticks = node_boundaries(tree)
    children = np.flatnonzero(tree.parents >= 0)
    np.testing.assert_array_equal(ticks, np.stack([start[children], y[children]], 1))
    siblings = [u for u in children if (tree.parents == tree.parents[u]).sum() == 2]
    assert len(siblings) == 2 and start[siblings[0]] == start[siblings[1]]
    assert y[siblings[0]] != y[siblings[1]]


def test_compare_torch_reads_chat_files(tmp_path, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.torch_util import TOL, write_qwen3_checkpoint

    hf_dir = write_qwen3_checkpoint(tmp_path / "hf", tie=True, bias=False, seed=2,
                                vocab_size=ByteTokenizer().vocab_size)
    data = write_chats(tmp_path / "chat.jsonl", n=2)
    out = tmp_path / "r.json"
    code = main(["compare-torch", "--hf-dir", str(hf_dir), "--data", str(data), "--format", "chat",
                 "--tokenizer", "bytes", "--attention-impl", "reference", "--json", str(out)])
    assert code == 0, capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["paths"] == 6 and report["failures"] == []
    assert report["max_abs_logprobs"] <= TOL and report["max_rel_grad"] <= TOL
