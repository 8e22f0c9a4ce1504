"""Wrong JSON types in every record format: one field of a valid record at a time is replaced by a
value of another JSON type, and the file is read as training (and `jtree stats`) reads it. It is
refused in one line naming `file:line` and the field, or, only where the docs allow that type,
read into the same trees as the canonical value."""

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jtree.trees.json_values import group, integer, integers, number, number_or_numbers
from jtree.training.tree_files import load_trees

VOCAB = 300  # above the byte tokenizer's 260, so that chat files read too

# Replacements the docs allow, by (format, field): a number's list form (a per-token advantage,
# per-turn rewards) and a group given as a string.
ALLOWED = {("groups", "advantage", "list"), ("groups", "reward", "list"),
           ("trees", "advantage", "list"), ("trees", "reward", "list"),
           ("groups", "group", "numeric string"), ("traces", "group", "numeric string")}
# The readers call a tree's paths `path i`.
FIELD_NAMES = {"paths": "path"}

ids = st.integers(0, VOCAB - 1)
token_lists = st.lists(ids, min_size=1, max_size=4)
floats = st.floats(-3, 3, allow_nan=False).map(lambda x: round(x, 3))
logprobs = st.floats(-5, 0, allow_nan=False).map(lambda x: round(x, 3))
weights = st.floats(0, 2, allow_nan=False).map(lambda x: round(x, 3))


@st.composite
def path_fields(draw, length: int) -> dict:
    """The optional per-path fields of a path of `length` tokens (all present, so that every
    path of a tree has them)."""
    return {"loss_mask": draw(st.lists(st.integers(0, 1), min_size=length, max_size=length)),
            "advantage": draw(floats | st.lists(floats, min_size=length, max_size=length)),
            "reward": draw(floats | st.lists(floats, min_size=1, max_size=3)),
            "old_logprobs": draw(st.lists(logprobs, min_size=length, max_size=length)),
            "weight": draw(weights)}


@st.composite
def group_files(draw) -> list[dict]:
    lines = []
    for tokens in draw(st.lists(token_lists, min_size=1, max_size=3)):
        lines.append({"group": 7, "tokens": tokens, **draw(path_fields(len(tokens)))})
    return lines


@st.composite
def tree_files(draw) -> list[dict]:
    n = draw(st.integers(1, 4))
    parents = [-1] + [draw(st.integers(-1, i - 1)) for i in range(1, n)]
    segments = [draw(token_lists) for _ in range(n)]
    paths = []
    for node in draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=2)):
        length, at = 0, node
        while at >= 0:
            length, at = length + len(segments[at]), parents[at]
        paths.append({"node": node, **draw(path_fields(length))})
    return [{"parents": parents, "segments": segments, "paths": paths}]


text = st.text("abc xyz", min_size=1, max_size=5)


@st.composite
def chat_files(draw) -> list[dict]:
    assistant = {"role": "assistant", "content": draw(text)}
    if draw(st.booleans()):
        assistant["reasoning_content"] = draw(text)
    return [{"messages": [{"role": "system", "content": draw(text)},
                          {"role": "user", "content": draw(text)}, assistant,
                          {"role": "tool", "content": draw(text)},
                          {"role": "assistant", "content": draw(text)}]}]


@st.composite
def trace_files(draw) -> list[dict]:
    routed = draw(st.booleans())
    records = []
    for _ in range(draw(st.integers(1, 2))):
        turns, before = [], []
        for _ in range(draw(st.integers(1, 2))):  # each prompt extends the turns before it
            prompt, output = before + draw(token_lists), draw(token_lists)
            turn = {"prompt_ids": prompt, "output_ids": output, "reward": draw(floats),
                    "output_logprobs": draw(st.lists(logprobs, min_size=len(output),
                                                     max_size=len(output)))}
            if routed:
                turn["routed_experts"] = [[[0, 1]]] * len(output)
                turn["prompt_routed_experts"] = [[[1, 2]]] * len(prompt)
            if draw(st.booleans()):
                turn["finish_reason"] = draw(st.sampled_from(["stop", "length"]))
            turns.append(turn)
            before = prompt + output
        records.append({"group": 3, "turns": turns, "reward": draw(floats),
                        "weight": draw(weights)})
    return records


def field_paths(value, path=()):
    """The path (keys and indices) of every value inside `value`, the value's own included."""
    if path:
        yield path
    items = value.items() if isinstance(value, dict) else (
        enumerate(value) if isinstance(value, list) else ())
    for key, item in items:
        yield from field_paths(item, (*path, key))


def wrong_values(canonical):
    """(kind, value) replacements of `canonical` by a value of another JSON type."""
    out = [("bool", True), ("bool", False), ("null", None), ("list", [canonical]),
           ("object", {"value": canonical})]
    if not isinstance(canonical, str):
        number = canonical if isinstance(canonical, (int, float)) else 1
        out.append(("numeric string", str(number)))
    if isinstance(canonical, int):
        out.append(("float", float(canonical)))
    return out


def replaced(records: list[dict], path: tuple, value) -> list[dict]:
    """A copy of `records` with the value at `path` (line, keys...) replaced; a group id on
    every line of the file (the lines of one group stay one group)."""
    out = json.loads(json.dumps(records))
    lines = range(len(out)) if path[1:] == ("group",) else [path[0]]
    for line in lines:
        node = out[line]
        for key in path[1:-1]:
            node = node[key]
        node[path[-1]] = value
    return out


def read(records: list[dict], fmt: str):
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "data.jsonl"
        file.write_text("".join(json.dumps(r) + "\n" for r in records))
        try:
            return load_trees(file, fmt, vocab_size=VOCAB)[0], None
        except ValueError as e:
            return None, str(e).replace(str(file), "data.jsonl")


def same_trees(a, b) -> bool:
    def arrays(t):
        per_path = [t.path_tokens(p) for p in range(t.n_paths)]
        for name in ("loss_masks", "advantages", "old_logprobs", "turn_rewards",
                     "routed_experts"):
            per_path += list(getattr(t, name) or ())
        return [t.parents, t.path_nodes, t.weights, *t.segments, *per_path]

    return len(a) == len(b) and all(
        len(arrays(x)) == len(arrays(y))
        and all(np.array_equal(u, v) for u, v in zip(arrays(x), arrays(y)))
        for x, y in zip(a, b))


def check_every_replacement(records: list[dict], fmt: str, data) -> None:
    canonical, error = read(records, fmt)
    assert error is None, error
    paths = [p for r, record in enumerate(records) for p in field_paths(record, (r,))
             if len(p) > 1 and p[1] != "id"]
    path = data.draw(st.sampled_from(paths), label="field")
    at = records[path[0]]
    for key in path[1:]:
        at = at[key]
    field = next(k for k in reversed(path) if isinstance(k, str))
    for kind, value in wrong_values(at):
        trees, error = read(replaced(records, path, value), fmt)
        if error is not None:
            line = 1 if path[1:] == ("group",) else path[0] + 1
            assert error.startswith(f"data.jsonl:{line}"), (kind, error)
            assert FIELD_NAMES.get(field, field) in error, (kind, error)
        else:
            whole_field = isinstance(path[-1], str)  # not an entry of a list
            assert whole_field and (fmt, field, kind) in ALLOWED, (path, kind, value)
            assert same_trees(trees, canonical), (path, kind, value)


STRATEGIES = {"groups": group_files(), "trees": tree_files(), "chat": chat_files(),
              "traces": trace_files()}


@pytest.mark.parametrize("fmt", list(STRATEGIES))
@settings(max_examples=200)  # one field per example: enough that every field is drawn
@given(data=st.data())
def test_a_wrong_json_type_is_refused_by_name_or_read_as_documented(fmt, data):
    check_every_replacement(data.draw(STRATEGIES[fmt], label="records"), fmt, data)


@pytest.mark.parametrize("call, message", [
    (lambda: integers([1, 2, True], "data.jsonl:3: tokens"),
     "data.jsonl:3: tokens[2]: expected an integer, got true"),
    (lambda: number("0.5", "data.jsonl:1: advantage"),
     'data.jsonl:1: advantage: expected a number, got "0.5"'),
    (lambda: number_or_numbers([0.5, None], "x:1: advantage"),
     "x:1: advantage[1]: expected a number, got null"),
    (lambda: group(None, "x:1: group"), "x:1: group: expected a string or an integer, got null"),
    (lambda: group([1], "x:1: group"), "x:1: group: expected a string or an integer, got [1]"),
    (lambda: group(1.0, "x:1: group"), "x:1: group: expected a string or an integer, got 1.0"),
    (lambda: integer(False, "x:1: node"), "x:1: node: expected an integer, got false"),
])
def test_messages_name_the_field_and_show_the_value_as_written(call, message):
    with pytest.raises(ValueError) as e:
        call()
    assert str(e.value) == message
