import json

import numpy as np
import pytest

from jtree.training.tree_files import load_trees
from jtree.trees.chat import ByteTokenizer, HFTokenizer, conversation_tree, load_tokenizer

THREE_TURNS = {"messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "Bye"},
]}

# Hand count with the byte tokenizer: <|im_start|> + "role\n" + content + <|im_end|> + "\n".
SYSTEM, USER_HI, ASSIST_HELLO, USER_SUM, ASSIST_4, USER_THANKS, ASSIST_BYE = (
    1 + 7 + 9 + 2, 1 + 5 + 2 + 2, 1 + 10 + 6 + 2, 1 + 5 + 4 + 2, 1 + 10 + 1 + 2, 1 + 5 + 6 + 2,
    1 + 10 + 3 + 2)
HEADER = 1 + 10  # <|im_start|>assistant\n is context, the rest of a trained turn is trained


def test_three_turn_conversation_is_a_chain_with_one_path_per_assistant_turn():
    tree = conversation_tree(THREE_TURNS, ByteTokenizer())
    assert [len(s) for s in tree.segments] == [SYSTEM, USER_HI, ASSIST_HELLO, USER_SUM, ASSIST_4,
                                              USER_THANKS, ASSIST_BYE]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3, 4, 5]
    assert tree.path_nodes.tolist() == [2, 4, 6]
    p0 = SYSTEM + USER_HI + ASSIST_HELLO
    p1 = p0 + USER_SUM + ASSIST_4
    p2 = p1 + USER_THANKS + ASSIST_BYE
    assert tree.path_lengths.tolist() == [p0, p1, p2]
    n_tree, n_flat = p2, p0 + p1 + p2
    assert (n_tree, n_flat) == (104, 226)
    assert tree.stats().por == pytest.approx(1 - 104 / 226)
    for p, (trained, length) in enumerate([(ASSIST_HELLO, p0), (ASSIST_4, p1), (ASSIST_BYE, p2)]):
        expected = np.zeros(length)
        expected[length - trained + HEADER:] = 1
        np.testing.assert_array_equal(tree.loss_masks[p], expected)
    text = bytes(t for t in tree.path_tokens(0) if t < 256).decode()
    assert text == "system\nBe brief.\nuser\nHi\nassistant\nHello!\n"


def test_reasoning_is_trained_in_its_own_turn_and_dropped_from_later_contexts():
    record = json.loads(json.dumps(THREE_TURNS))
    record["messages"][2]["reasoning_content"] = "greet"
    tree = conversation_tree(record, ByteTokenizer())
    # <think> \n greet \n </think> \n\n before the content: 1 + 1 + 5 + 1 + 1 + 2 tokens.
    with_think = ASSIST_HELLO + 11
    assert [len(s) for s in tree.segments] == [SYSTEM, USER_HI, with_think, ASSIST_HELLO,
                                              USER_SUM, ASSIST_4, USER_THANKS, ASSIST_BYE]
    assert tree.parents.tolist() == [-1, 0, 1, 1, 3, 4, 5, 6]  # think turn: a leaf sibling
    assert tree.path_nodes.tolist() == [2, 5, 7]
    n_tree = 104 + with_think
    n_flat = (SYSTEM + USER_HI + with_think) + (SYSTEM + USER_HI + ASSIST_HELLO + USER_SUM
                                                 + ASSIST_4) + 104
    assert tree.stats().por == pytest.approx(1 - n_tree / n_flat)
    assert int(tree.loss_masks[0].sum()) == with_think - HEADER


def test_tokenizer_that_merges_across_messages_is_rejected():
    class Merging(ByteTokenizer):
        def encode(self, text):  # "\n" followed by <|im_start|> becomes one token
            out = []
            for t in super().encode(text):
                if out and out[-1] == 10 and t == 256:
                    out[-1] = 260
                else:
                    out.append(t)
            return out

    with pytest.raises(ValueError, match=r"conv:3: path 0: tokenizing messages separately differs"):
        conversation_tree(THREE_TURNS, Merging(), where="conv:3")


@pytest.mark.parametrize("messages, match", [
    ([], r"messages must be a non-empty list"),
    ([{"role": "bot", "content": "x"}], r"messages\[0\]\.role: 'bot' is not one of"),
    ([{"role": "user"}], r"messages\[0\]\.content: missing"),
    ([{"role": "user", "content": "x"}], r"messages: no assistant message"),
    ([{"role": "user", "content": "x", "reasoning_content": "y"}, {"role": "assistant",
                                                                   "content": "z"}],
     r"messages\[0\]\.reasoning_content: only assistant"),
])
def test_bad_conversations_name_the_record_and_field(messages, match):
    with pytest.raises(ValueError, match=r"^c\.jsonl:7: " + match):
        conversation_tree({"messages": messages}, ByteTokenizer(), where="c.jsonl:7")


def test_chat_file_with_a_local_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    texts = [m["content"] for m in THREE_TURNS["messages"]] + ["system user assistant"]
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=80, special_tokens=["[UNK]", "<|im_start|>", "<|im_end|>", "<think>",
                                       "</think>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(str(tmp_path))
    assert isinstance(loaded, HFTokenizer)
    (tmp_path / "chat.jsonl").write_text(json.dumps(THREE_TURNS) + "\n")
    trees, report = load_trees(tmp_path / "chat.jsonl", "chat", vocab_size=loaded.vocab_size,
                               tokenizer=str(tmp_path))
    assert report.n_trees == 1 and trees[0].n_paths == 3
    full = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
                   for m in THREE_TURNS["messages"])
    assert trees[0].path_tokens(2).tolist() == loaded.encode(full)
