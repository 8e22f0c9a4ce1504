"""The typed reading of JSON values that every record reader shares (sequence groups, explicit
trees, chat, engine traces and engine responses).

Python's `json` hands back `true` as a `bool`, which is an `int`, and numpy turns `"0.5"`, `true`
or `null` into numbers without a word; so a value is checked here, against the JSON type its
field documents, before anything converts it. The rules:

- ids and 0/1 masks are integers, and `true` / `false` are not integers;
- numbers are integers or floats (not booleans), and a string holding a number is not a number;
- a group is a string or an integer.

A violation raises one ValueError naming the field as the reader passes it (`file:line: field`)
with the index inside a list, and the value as it is written in the file:
`data.jsonl:3: tokens[2]: expected an integer, got true`. Ranges (ids below the vocabulary, masks
of 0 and 1, finite numbers, old log-probs <= 0) are the tree builder's checks
(`jtree.trees.path_data`), which the readers run next.
"""

from __future__ import annotations

import json
from typing import Any


def shown(value: Any) -> str:
    """`value` as the JSON text it was read from, cut to 60 characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def refuse(what: str, expected: str, value: Any) -> ValueError:
    """The one-line error of a field `what` that does not hold `expected`."""
    return ValueError(f"{what}: expected {expected}, got {shown(value)}")


def is_integer(value: Any) -> bool:
    """A JSON integer: `int`, and not `bool` (which Python counts as one)."""
    return type(value) is int


def is_number(value: Any) -> bool:
    """A JSON number: an integer or a float, not a boolean and not a string."""
    return type(value) is int or type(value) is float


def integer(value: Any, what: str) -> int:
    if not is_integer(value):
        raise refuse(what, "an integer", value)
    return value


def number(value: Any, what: str, expected: str = "a number") -> float:
    """`value` as a float; `expected` names what the field holds in the error."""
    if not is_number(value):
        raise refuse(what, expected, value)
    return float(value)


def string(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise refuse(what, "a string", value)
    return value


def json_list(value: Any, what: str, expected: str = "a list") -> list[Any]:
    if not isinstance(value, list):
        raise refuse(what, expected, value)
    return value


def json_object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise refuse(what, "an object", value)
    return value


def integers(value: Any, what: str, depth: int = 1) -> list[Any]:
    """A list of integers (`depth` 1) or of such lists (`depth` 2: a tree's segments); the first
    wrong entry is named by its indices."""
    items = json_list(value, what, "a list of integers" if depth == 1 else "a list")
    if depth > 1:
        for i, item in enumerate(items):
            integers(item, f"{what}[{i}]", depth - 1)
    elif not all(type(x) is int for x in items):  # one pass in C on the usual, valid list
        i = next(i for i, x in enumerate(items) if not is_integer(x))
        raise refuse(f"{what}[{i}]", "an integer", items[i])
    return items


def integer_leaves(value: Any, what: str) -> Any:
    """Lists nested to any depth whose every entry is an integer (routed experts, whose shape is
    checked beside the model's: `jtree.trees.routed_experts`); the first other entry is named by
    its indices."""
    if isinstance(value, list):
        for i, item in enumerate(value):
            integer_leaves(item, f"{what}[{i}]")
    else:
        integer(value, what)
    return value


def numbers(value: Any, what: str) -> list[Any]:
    """A list of numbers; the first entry that is not one is named by its index."""
    items = json_list(value, what, "a list of numbers")
    if not all(is_number(x) for x in items):
        i = next(i for i, x in enumerate(items) if not is_number(x))
        raise refuse(f"{what}[{i}]", "a number", items[i])
    return items


def number_or_numbers(value: Any, what: str) -> Any:
    """A number, or a list of numbers (an advantage per token, a reward per turn)."""
    if is_number(value):
        return value
    if isinstance(value, list):
        return numbers(value, what)
    raise refuse(what, "a number or a list of numbers", value)


def group(value: Any, what: str) -> str | int:
    """A group id: lines (or rollouts) with equal ids merge into one tree, so it must be a value
    that compares exactly: a string or an integer."""
    if not (isinstance(value, str) or is_integer(value)):
        raise refuse(what, "a string or an integer", value)
    return value
