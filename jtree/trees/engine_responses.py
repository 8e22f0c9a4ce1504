"""One turn of an engine trace (`jtree.trees.traces`) from one inference engine response and the
prompt ids the caller sent: the output tokens as ids, never re-encoded from text, with their
sampling log-probs, the engine's finish reason and, where asked for, its routed experts.

The shapes read (docs/rl.md, "Engine traces"; the test fixtures name the engine versions):

- vLLM's OpenAI-compatible server, asked for `logprobs` with `return_tokens_as_token_ids` (the
  request field or `--return-tokens-as-token-ids`), so that every token is the string
  `"token_id:<id>"`. Completions: `choices[i].logprobs` = `{"tokens": [...], "token_logprobs":
  [...], "top_logprobs": ..., "text_offset": ...}`; chat completions: `choices[i].logprobs.content`
  = `[{"token", "logprob", "bytes", "top_logprobs"}]`. With `return_token_ids` a choice also holds
  `token_ids`, and `prompt_token_ids` sits on the choice (completions) or the response (chat).
  `choices[i].routed_experts` (`--enable-return-routed-experts`): a base64 `.npy` of shape
  (tokens - 1 - start, num_hidden_layers, k), row j routing the token at position start + j of
  prompt + output, start the request's `routed_experts_prompt_start`.
- SGLang's native `/generate` (and its offline `Engine.generate`, whose log-prob entries are
  tuples) with `return_logprob`: `meta_info.output_token_logprobs` = `[[logprob, token_id,
  text|null], ...]`, `meta_info.input_token_logprobs` the same for the prompt from
  `logprob_start_len` on, `meta_info.prompt_tokens`, `meta_info.finish_reason` = `{"type": ...}`,
  `output_ids`; `meta_info.routed_experts` (`--enable-return-routed-experts`): base64 raw int32
  rows, one per position from the request's `routed_experts_start_len` to tokens - 1, each
  num_hidden_layers x k.

The engine's prompt is the truth: the prompt the engine counted (`usage.prompt_tokens`,
`meta_info.prompt_tokens`) or returned (`prompt_token_ids`) must be the ids the turn records, else
the engine saw another prompt (a truncated one: vLLM's `truncate_prompt_tokens`, SGLang's
`--allow-auto-truncate`) and the turn is refused. Neither engine has a routing row for the last
sampled token (it was never run through the model): it gets -1, the trainer's own routing. Rows
of dense layers are dropped through the model's layer map (`sparse_layers`, one bool per hidden
layer: `Qwen3MoeConfig.sparse_layers()`), since a trace's routing holds the MoE layers only.

Errors are one line naming the record (`record`, the caller's `file:line`) and the field.
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jtree.trees import json_values as jv
from jtree.trees.path_data import preview

_TOKEN_ID_PREFIX = "token_id:"
_LOGPROB = "a log-probability"
_SGLANG_ENTRY = "[logprob, token_id, text]"
# The engines' finish reasons as a trace records them (`jtree.trees.traces.FINISH_REASONS`): a
# chat turn that ends in tool calls has stopped as the model chose.
_VLLM_FINISH = {"stop": "stop", "tool_calls": "stop", "length": "length", "abort": "abort"}
_SGLANG_FINISH = ("stop", "length", "abort")


def _naming_record(adapter: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """`adapter` whose errors begin with its `record` keyword (the caller's `file:line`), so that
    a refused response in a file of thousands is found from the message alone."""

    @functools.wraps(adapter)
    def named(*args: Any, record: str = "", **kwargs: Any) -> dict[str, Any]:
        try:
            return adapter(*args, **kwargs)
        except ValueError as e:
            if not record:
                raise
            raise ValueError(f"{record}: {e}") from None

    return named


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


def _prompt_count(count: Any, prompt_ids: Sequence[int], at: str, how: str) -> None:
    """Refuse a prompt the engine counted otherwise than the ids the turn records: it generated
    from another prompt (`how`: the engine setting that truncates one)."""
    if jv.integer(count, at) != len(prompt_ids):
        raise ValueError(f"{at}: the engine read a prompt of {count} tokens, the turn records "
                         f"{len(prompt_ids)} ids (a truncated prompt: {how})")


def _finish(reason: Any, known: Sequence[str], at: str) -> str:
    if reason not in known:
        raise ValueError(f"{at}: {jv.shown(reason)} is not a finish reason of a finished turn "
                         f"({', '.join(known)})")
    return reason


def _routing_rows(start: int, n_prompt: int, n_output: int, at: str) -> int:
    """How many rows an engine sends from position `start` on: one per token but the last
    sampled one; `start` inside the prompt, as both engines require."""
    if not 0 <= start <= n_prompt:
        raise ValueError(f"{at}: routing start {start} outside the prompt of {n_prompt} tokens")
    return n_prompt + n_output - 1 - start


def _placed_routing(rows: np.ndarray, start: int, n_prompt: int, n_output: int,
                    sparse_layers: Sequence[bool], at: str) -> tuple[list[Any], list[Any]]:
    """The engine's routing rows [positions start .. n_prompt + n_output - 2, hidden layers, k]
    as a turn's `prompt_routed_experts` and `routed_experts` (MoE layers only): row j routes the
    token at position start + j; a position before `start` and the last sampled token, which
    no row covers, get -1 (the trainer's routing)."""
    total = n_prompt + n_output
    n_rows = _routing_rows(start, n_prompt, n_output, at)
    if rows.ndim != 3 or rows.shape[0] != n_rows or rows.shape[1] != len(sparse_layers):
        raise ValueError(f"{at}: routing of shape {list(rows.shape)}, expected "
                         f"[{n_rows}, {len(sparse_layers)}, k] (positions {start} to "
                         f"{total - 2} of {n_prompt} prompt + {n_output} output tokens, one row "
                         "per hidden layer)")
    moe = rows[:, np.asarray(sparse_layers, bool)].astype(np.int64)
    placed = np.full((total, *moe.shape[1:]), -1, np.int64)
    placed[start:total - 1] = moe
    return placed[:n_prompt].tolist(), placed[n_prompt:].tolist()


def _decoded(text: Any, at: str) -> bytes:
    if not isinstance(text, str):
        raise jv.refuse(at, "a base64 string", text)
    try:
        return base64.b64decode(text, validate=True)
    except binascii.Error:
        raise ValueError(f"{at}: not base64") from None


def _vllm_routing(encoded: Any, at: str) -> np.ndarray:
    """vLLM's routed experts: a base64 `.npy` array [rows, hidden layers, k] of integers."""
    raw = _decoded(encoded, at)
    try:
        rows = np.load(io.BytesIO(raw), allow_pickle=False)
    except ValueError as e:
        raise ValueError(f"{at}: not an .npy array ({e})") from None
    if rows.dtype.kind not in "iu":
        raise ValueError(f"{at}: expert ids of dtype {rows.dtype}, expected integers")
    return rows


def _sglang_routing(encoded: Any, n_hidden: int, n_rows: int, at: str) -> np.ndarray:
    """SGLang's routed experts: base64 raw int32, `n_rows` rows of `n_hidden` layers x k."""
    raw = _decoded(encoded, at)
    per_row = n_rows * n_hidden
    if len(raw) % 4 or not per_row or (len(raw) // 4) % per_row:
        raise ValueError(f"{at}: {len(raw)} bytes are not int32 rows of {n_rows} tokens x "
                         f"{n_hidden} hidden layers x k")
    return np.frombuffer(raw, np.int32).reshape(n_rows, n_hidden, -1)


def _turn(prompt_ids: Sequence[int], output_ids: list[int], logprobs: list[float], finish: str,
          routed: tuple[list[Any], list[Any]] | None) -> dict[str, Any]:
    turn: dict[str, Any] = {"prompt_ids": [int(t) for t in prompt_ids],
                            "output_ids": output_ids, "output_logprobs": logprobs,
                            "finish_reason": finish}
    if routed is not None:
        turn["prompt_routed_experts"], turn["routed_experts"] = routed
    return turn


def _vllm_turn(chosen: Any, at: str, prompt_ids: Sequence[int], ids: list[int],
               lps: list[float], sparse_layers: Sequence[bool] | None,
               routed_start: int) -> dict[str, Any]:
    """What both vLLM endpoints share once the output tokens are read: the output ids checked,
    the finish reason and the routed experts."""
    _agree(chosen.get("token_ids"), ids, f"{at}.token_ids")
    finish = _VLLM_FINISH.get(_finish(chosen.get("finish_reason"), tuple(_VLLM_FINISH),
                                      f"{at}.finish_reason"))
    routed = None
    if chosen.get("routed_experts") is not None:
        where = f"{at}.routed_experts"
        if sparse_layers is None:
            raise ValueError(f"{where}: given, but no sparse_layers (the model's layer map) "
                             "to read them with")
        routed = _placed_routing(_vllm_routing(chosen["routed_experts"], where), routed_start,
                                 len(prompt_ids), len(ids), sparse_layers, where)
    return _turn(prompt_ids, ids, lps, finish, routed)


@_naming_record
def vllm_completion_turn(response: dict[str, Any], prompt_ids: Sequence[int], *,
                         choice: int = 0, sparse_layers: Sequence[bool] | None = None,
                         routed_start: int = 0) -> dict[str, Any]:
    """A turn from a vLLM `/v1/completions` response to `prompt_ids` (sent as the prompt). The
    prompt is checked against the choice's `prompt_token_ids` (`return_token_ids`), else against
    `usage.prompt_tokens`, which counts the one prompt of a single-prompt request (a request of
    several prompts needs `return_token_ids`). `sparse_layers` (the model's layer map) reads
    the choice's `routed_experts`, which start at `routed_start` (the request's
    `routed_experts_prompt_start`). `record`: the caller's `file:line`, which errors begin
    with."""
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
    if chosen.get("prompt_token_ids") is not None:
        _agree(chosen["prompt_token_ids"], prompt_ids, f"{at}.prompt_token_ids")
    else:
        _prompt_count(_field(_field(response, "usage", "usage"), "prompt_tokens",
                             "usage.prompt_tokens"), prompt_ids, "usage.prompt_tokens",
                      "truncate_prompt_tokens; several prompts in one request need "
                      "return_token_ids")
    return _vllm_turn(chosen, at, prompt_ids, ids, lps, sparse_layers, routed_start)


@_naming_record
def vllm_chat_turn(response: dict[str, Any], prompt_ids: Sequence[int] | None = None, *,
                   choice: int = 0, sparse_layers: Sequence[bool] | None = None,
                   routed_start: int = 0) -> dict[str, Any]:
    """A turn from a vLLM `/v1/chat/completions` response requested with `return_token_ids`:
    its prompt is the engine's `prompt_token_ids` (the server's rendering of the conversation,
    which a caller's rendering may not match), required, and checked against
    `usage.prompt_tokens` and against `prompt_ids` where the caller gives them. `sparse_layers`,
    `routed_start` and `record` as for `vllm_completion_turn`."""
    at = f"choices[{choice}]"
    engine_prompt = jv.integers(_field(response, "prompt_token_ids", "prompt_token_ids"),
                                "prompt_token_ids")
    if prompt_ids is not None:
        _agree(engine_prompt, prompt_ids, "prompt_token_ids")
    usage = response.get("usage")
    if usage is not None and usage.get("prompt_tokens") is not None:
        _prompt_count(usage["prompt_tokens"], engine_prompt, "usage.prompt_tokens",
                      "truncate_prompt_tokens")
    chosen = _field(_field(response, "choices", "choices"), choice, at)
    content = _field(_field(chosen, "logprobs", f"{at}.logprobs"), "content",
                     f"{at}.logprobs.content")
    ids, lps = [], []
    for i, entry in enumerate(content):
        ids.append(_token_id(_field(entry, "token", f"{at}.logprobs.content[{i}].token"),
                             f"{at}.logprobs.content[{i}].token"))
        lps.append(jv.number(entry.get("logprob"), f"{at}.logprobs.content[{i}].logprob",
                             _LOGPROB))
    return _vllm_turn(chosen, at, engine_prompt, ids, lps, sparse_layers, routed_start)


def _sglang_entry(entry: Any, at: str) -> list[Any]:
    """One SGLang log-prob entry as a list: a JSON list from the server, a tuple from the
    offline `Engine.generate`."""
    entry = list(entry) if isinstance(entry, tuple) else jv.json_list(entry, at, _SGLANG_ENTRY)
    if len(entry) < 2:
        raise jv.refuse(at, _SGLANG_ENTRY, entry)
    return entry


@_naming_record
def sglang_generate_turn(response: dict[str, Any], prompt_ids: Sequence[int], *,
                         sparse_layers: Sequence[bool] | None = None,
                         routed_start: int = 0) -> dict[str, Any]:
    """A turn from an SGLang `/generate` response (or an offline `Engine.generate` result) to
    `{"input_ids": prompt_ids, "return_logprob": true, ...}`; its `meta_info.prompt_tokens`
    must count `prompt_ids`. `sparse_layers` (the model's layer map) reads
    `meta_info.routed_experts`, which start at `routed_start` (the request's
    `routed_experts_start_len`). `record`: the caller's `file:line`, which errors begin with."""
    meta = _field(response, "meta_info", "meta_info")
    _prompt_count(_field(meta, "prompt_tokens", "meta_info.prompt_tokens"), prompt_ids,
                  "meta_info.prompt_tokens", "--allow-auto-truncate")
    entries = _field(meta, "output_token_logprobs", "meta_info.output_token_logprobs")
    ids, lps = [], []
    for i, entry in enumerate(entries):
        at = f"meta_info.output_token_logprobs[{i}]"
        entry = _sglang_entry(entry, at)
        lps.append(jv.number(entry[0], f"{at}[0]", _LOGPROB))
        ids.append(jv.integer(entry[1], f"{at}[1]"))
    _agree(response.get("output_ids"), ids, "output_ids")
    inputs = meta.get("input_token_logprobs")
    if inputs is not None:  # the prompt's tail from logprob_start_len on
        if len(inputs) > len(prompt_ids):
            raise ValueError(f"meta_info.input_token_logprobs: {len(inputs)} entries for a prompt "
                             f"of {len(prompt_ids)} ids")
        tail = prompt_ids[len(prompt_ids) - len(inputs):]
        _agree([_sglang_entry(e, f"meta_info.input_token_logprobs[{i}]")[1]
                for i, e in enumerate(inputs)], tail, "meta_info.input_token_logprobs")
    finish = _finish(_field(_field(meta, "finish_reason", "meta_info.finish_reason"), "type",
                            "meta_info.finish_reason.type"), _SGLANG_FINISH,
                     "meta_info.finish_reason.type")
    routed = None
    if meta.get("routed_experts") is not None:
        where = "meta_info.routed_experts"
        if sparse_layers is None:
            raise ValueError(f"{where}: given, but no sparse_layers (the model's layer map) "
                             "to read them with")
        n_rows = _routing_rows(routed_start, len(prompt_ids), len(ids), where)
        rows = _sglang_routing(meta["routed_experts"], len(sparse_layers), n_rows, where)
        routed = _placed_routing(rows, routed_start, len(prompt_ids), len(ids), sparse_layers,
                                 where)
    return _turn(prompt_ids, ids, lps, finish, routed)
