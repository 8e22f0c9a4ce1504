"""One turn of an engine trace (`jtree.trees.traces`) from one inference engine response and the
prompt ids the caller sent: the output tokens as ids, never re-encoded from text, with their
sampling log-probs.

The shapes read (docs/rl.md, "Engine traces"):

- vLLM's OpenAI-compatible server, asked for `logprobs` with `return_tokens_as_token_ids` (the
  request field or `--return-tokens-as-token-ids`), so that every token is the string
  `"token_id:<id>"` (vLLM's protocol.py: the field's description; serving_completion.py /
  serving_chat.py build the strings). Completions: `choices[i].logprobs` =
  `{"tokens": [...], "token_logprobs": [...], "top_logprobs": ..., "text_offset": ...}`; chat
  completions: `choices[i].logprobs.content` = `[{"token", "logprob", "bytes", "top_logprobs"}]`.
  With `return_token_ids` a choice also holds `token_ids`, and `prompt_token_ids` sits on the
  choice (completions) or the response (chat); where present they are checked against.
- SGLang's native `/generate` with `return_logprob` (docs.sglang.io, "SGLang Native APIs" and
  "Sampling Parameters"): `meta_info.output_token_logprobs` = `[[logprob, token_id, text|null],
  ...]`, `meta_info.input_token_logprobs` the same for the prompt from `logprob_start_len` on (the
  first logprob null), and `output_ids` in recent versions; the latter two, where present, are
  checked against.

Errors name the response field. A mismatch between the ids the caller sent and those the engine
reports means the engine did not see the tokens the trace would claim.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jtree.trees import json_values as jv
from jtree.trees.path_data import preview

_TOKEN_ID_PREFIX = "token_id:"
_LOGPROB = "a log-probability"
_SGLANG_ENTRY = "[logprob, token_id, text]"


def _field(obj: Any, key: str | int, at: str) -> Any:
    """`obj[key]`, or an error naming the field `at` (a JSON path)."""
    try:
        value = obj[key]
    except (KeyError, IndexError, TypeError):
        value = None
    if value is None:
        raise ValueError(f"{at}: missing")
    return value


def _token_id(token: Any, at: str) -> int:
    if not isinstance(token, str) or not token.startswith(_TOKEN_ID_PREFIX):
        raise ValueError(f"{at}: {preview(token)} is not a 'token_id:<id>' string (ask vLLM for "
                         "return_tokens_as_token_ids)")
    digits = token[len(_TOKEN_ID_PREFIX):]
    if not digits.isdigit():
        raise ValueError(f"{at}: {preview(token)} is not a 'token_id:<id>' string")
    return int(digits)


def _agree(reported: Any, expected: Sequence[int], at: str) -> None:
    """Refuse ids the engine reports that differ from the ones the turn records."""
    if reported is None:
        return
    reported = list(reported)
    if reported != list(expected):
        pos = next((i for i, (a, b) in enumerate(zip(reported, expected)) if a != b),
                   min(len(reported), len(expected)))
        raise ValueError(f"{at}: the engine reports {len(reported)} ids, differing from the "
                         f"{len(expected)} the turn records at position {pos}")


def _turn(prompt_ids: Sequence[int], output_ids: list[int], logprobs: list[float]
          ) -> dict[str, Any]:
    return {"prompt_ids": [int(t) for t in prompt_ids], "output_ids": output_ids,
            "output_logprobs": logprobs}


def vllm_completion_turn(response: dict[str, Any], prompt_ids: Sequence[int], *,
                         choice: int = 0) -> dict[str, Any]:
    """A turn from a vLLM `/v1/completions` response to `prompt_ids` (sent as the prompt)."""
    at = f"choices[{choice}]"
    chosen = _field(_field(response, "choices", "choices"), choice, at)
    logprobs = _field(chosen, "logprobs", f"{at}.logprobs")
    tokens = _field(logprobs, "tokens", f"{at}.logprobs.tokens")
    values = _field(logprobs, "token_logprobs", f"{at}.logprobs.token_logprobs")
    if len(values) != len(tokens):
        raise ValueError(f"{at}.logprobs.token_logprobs: {len(values)} values for "
                         f"{len(tokens)} tokens")
    ids = [_token_id(t, f"{at}.logprobs.tokens[{i}]") for i, t in enumerate(tokens)]
    lps = [jv.number(v, f"{at}.logprobs.token_logprobs[{i}]", _LOGPROB)
           for i, v in enumerate(values)]
    _agree(chosen.get("token_ids"), ids, f"{at}.token_ids")
    _agree(chosen.get("prompt_token_ids"), prompt_ids, f"{at}.prompt_token_ids")
    return _turn(prompt_ids, ids, lps)


def vllm_chat_turn(response: dict[str, Any], prompt_ids: Sequence[int], *,
                   choice: int = 0) -> dict[str, Any]:
    """A turn from a vLLM `/v1/chat/completions` response; `prompt_ids` are the ids of the
    rendered conversation the engine generated from (its `prompt_token_ids` when it returns
    them, which are then checked)."""
    at = f"choices[{choice}]"
    chosen = _field(_field(response, "choices", "choices"), choice, at)
    content = _field(_field(chosen, "logprobs", f"{at}.logprobs"), "content",
                     f"{at}.logprobs.content")
    ids, lps = [], []
    for i, entry in enumerate(content):
        ids.append(_token_id(_field(entry, "token", f"{at}.logprobs.content[{i}].token"),
                             f"{at}.logprobs.content[{i}].token"))
        lps.append(jv.number(entry.get("logprob"), f"{at}.logprobs.content[{i}].logprob",
                             _LOGPROB))
    _agree(chosen.get("token_ids"), ids, f"{at}.token_ids")
    _agree(response.get("prompt_token_ids"), prompt_ids, "prompt_token_ids")
    return _turn(prompt_ids, ids, lps)


def sglang_generate_turn(response: dict[str, Any], prompt_ids: Sequence[int]
                         ) -> dict[str, Any]:
    """A turn from an SGLang `/generate` response to `{"input_ids": prompt_ids,
    "return_logprob": true, ...}`."""
    meta = _field(response, "meta_info", "meta_info")
    entries = _field(meta, "output_token_logprobs", "meta_info.output_token_logprobs")
    ids, lps = [], []
    for i, entry in enumerate(entries):
        at = f"meta_info.output_token_logprobs[{i}]"
        if len(jv.json_list(entry, at, _SGLANG_ENTRY)) < 2:
            raise jv.refuse(at, _SGLANG_ENTRY, entry)
        lps.append(jv.number(entry[0], f"{at}[0]", _LOGPROB))
        ids.append(jv.integer(entry[1], f"{at}[1]"))
    _agree(response.get("output_ids"), ids, "output_ids")
    inputs = meta.get("input_token_logprobs")
    if inputs is not None:  # the prompt's tail from logprob_start_len on
        if len(inputs) > len(prompt_ids):
            raise ValueError(f"meta_info.input_token_logprobs: {len(inputs)} entries for a prompt "
                             f"of {len(prompt_ids)} ids")
        tail = prompt_ids[len(prompt_ids) - len(inputs):]
        _agree([_field(e, 1, f"meta_info.input_token_logprobs[{i}][1]")
                for i, e in enumerate(inputs)], tail, "meta_info.input_token_logprobs")
    return _turn(prompt_ids, ids, lps)
