"""Chat conversations as trees: every assistant turn is a path whose context is the conversation
so far.

A record is `{"messages": [{"role": ..., "content": ..., "reasoning_content": ...}, ...]}` with
roles system, user, assistant, tool. Messages are rendered in the ChatML layout Qwen3 uses
(`<|im_start|>{role}\\n{content}<|im_end|>\\n`) and tokenized one message at a time, so node
boundaries fall on message boundaries; a check makes sure that tokenizing the nodes separately
gives the same tokens as tokenizing each whole path (otherwise the tree would train on token
sequences the model never sees at inference time).

Think-mode: an assistant message with `reasoning_content` is trained with its reasoning
(`<think>\\n...\\n</think>\\n\\n` before the content), while later turns see it without (as
Qwen3's template drops old reasoning). The turn then becomes a leaf branch next to the
reasoning-free node the conversation continues from, which is where the tree shares work.
Each path trains the assistant message it ends with (loss mask 1 after the role header), all
earlier tokens are context.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from jtree.trees import json_values as jv
from jtree.trees.tree import TrajectoryTree

ROLES = ("system", "user", "assistant", "tool")
IM_START, IM_END, THINK, END_THINK = "<|im_start|>", "<|im_end|>", "<think>", "</think>"
SPECIAL_TOKENS = (IM_START, IM_END, THINK, END_THINK)


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes (ids 0-255) plus the ChatML special tokens (ids 256+): for demos and tests,
    no files needed."""

    def __init__(self) -> None:
        self.special = {s: 256 + i for i, s in enumerate(SPECIAL_TOKENS)}
        self.vocab_size = 256 + len(SPECIAL_TOKENS)

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        while text:
            hits = [(text.find(s), s) for s in self.special if s in text]
            if not hits:
                out.extend(text.encode("utf-8"))
                break
            at, special = min(hits)
            out.extend(text[:at].encode("utf-8"))
            out.append(self.special[special])
            text = text[at + len(special):]
        return out


class HFTokenizer:
    """A local Hugging Face `tokenizers` file (tokenizer.json, or a directory holding one)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"tokenizer: {file} does not exist")
        self._tok = _Tokenizer.from_file(str(file))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids


def load_tokenizer(spec: str) -> Tokenizer:
    """`bytes` for the built-in byte tokenizer, else a path to a local tokenizer."""
    return ByteTokenizer() if spec == "bytes" else HFTokenizer(spec)


def _validate(record: Mapping[str, Any], where: str) -> list[Mapping[str, Any]]:
    if set(record) - {"messages", "id"}:
        raise ValueError(f"{where}: unknown field {sorted(set(record) - {'messages', 'id'})[0]!r}")
    messages = record.get("messages")
    if not jv.json_list(messages, f"{where}: messages", "a non-empty list of messages"):
        raise ValueError(f"{where}: messages must be a non-empty list")
    for i, m in enumerate(messages):
        at = f"{where}: messages[{i}]"
        jv.json_object(m, at)
        unknown = set(m) - {"role", "content", "reasoning_content"}
        if unknown:
            raise ValueError(f"{at}: unknown field {sorted(unknown)[0]!r}")
        for field in ("role", "content"):
            if field not in m:
                raise ValueError(f"{at}.{field}: missing")
        if jv.string(m["role"], f"{at}.role") not in ROLES:
            raise ValueError(f"{at}.role: {m['role']!r} is not one of {ROLES}")
        for field in ("content", "reasoning_content"):
            if field in m and not _is_unicode(jv.string(m[field], f"{at}.{field}")):
                raise ValueError(f"{at}.{field}: not valid Unicode (a lone surrogate escape such "
                                 "as \\ud800, which no tokenizer can encode)")
        if "reasoning_content" in m and m["role"] != "assistant":
            raise ValueError(f"{at}.reasoning_content: only assistant messages have reasoning")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: messages: no assistant message to train on")
    return messages


def _is_unicode(text: str) -> bool:
    """Whether `text` encodes as UTF-8: JSON may escape lone surrogates that it cannot."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _render(message: Mapping[str, Any], with_reasoning: bool) -> tuple[str, str]:
    """(role header, body) text of one message; only the body of a trained turn is trained."""
    body = message["content"]
    if with_reasoning and message.get("reasoning_content"):
        body = f"{THINK}\n{message['reasoning_content']}\n{END_THINK}\n\n{body}"
    return f"{IM_START}{message['role']}\n", f"{body}{IM_END}\n"


def conversation_tree(record: Mapping[str, Any], tokenizer: Tokenizer, *, where: str = "record",
                      vocab_size: int | None = None) -> TrajectoryTree:
    """The tree of one conversation (see the module docstring); errors name `where`."""
    messages = _validate(record, where)
    last_assistant = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    parents: list[int] = []
    segments: list[list[int]] = []
    texts: list[str] = []
    path_nodes: list[int] = []
    masks: list[np.ndarray] = []
    chain: list[int] = []  # nodes of the conversation as later turns see it

    def add_node(parent_chain: list[int], header: str, body: str) -> tuple[int, int]:
        head_ids, body_ids = tokenizer.encode(header), tokenizer.encode(body)
        parents.append(parent_chain[-1] if parent_chain else -1)
        segments.append(head_ids + body_ids)
        texts.append(header + body)
        return len(segments) - 1, len(head_ids)

    for i, m in enumerate(messages[: last_assistant + 1]):
        if m["role"] != "assistant":
            node, _ = add_node(chain, *_render(m, with_reasoning=False))
            chain.append(node)
            continue
        trained, head_len = add_node(chain, *_render(m, with_reasoning=True))
        context = sum(len(segments[n]) for n in chain)
        mask = np.zeros(context + len(segments[trained]), np.float32)
        mask[context + head_len:] = 1.0
        path_nodes.append(trained)
        masks.append(mask)
        if m.get("reasoning_content") and i < last_assistant:
            chain.append(add_node(chain, *_render(m, with_reasoning=False))[0])
        else:
            chain.append(trained)
    _check_tokenization(parents, segments, texts, path_nodes, tokenizer, where)
    try:
        return TrajectoryTree.from_nodes(parents, segments, path_nodes=path_nodes,
                                         loss_masks=masks, vocab_size=vocab_size)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _check_tokenization(parents: Sequence[int], segments: Sequence[list[int]],
                        texts: Sequence[str], path_nodes: Sequence[int], tokenizer: Tokenizer,
                        where: str) -> None:
    for p, node in enumerate(path_nodes):
        chain = []
        while node >= 0:
            chain.append(node)
            node = parents[node]
        chain.reverse()
        joined = [t for n in chain for t in segments[n]]
        whole = tokenizer.encode("".join(texts[n] for n in chain))
        if joined != whole:
            at = next((i for i, (a, b) in enumerate(zip(joined, whole)) if a != b),
                      min(len(joined), len(whole)))
            raise ValueError(
                f"{where}: path {p}: tokenizing messages separately differs from tokenizing the "
                f"conversation at token {at} (the tokenizer merges across a message boundary)")
