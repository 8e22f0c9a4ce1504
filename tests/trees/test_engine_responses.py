"""Engine responses into trace turns (`jtree.trees.engine_responses`), on responses built in the
shapes the engines' own code produces:

- vLLM's OpenAI-compatible server, the release line whose `SamplingParams` has
  `routed_experts_prompt_start` (`CompletionResponseChoice` read in
  vllm/entrypoints/openai/completion/protocol.py at vllm-project/vllm commit 002032ee; the chat
  choice carries `routed_experts` alike, `prompt_token_ids` on the response):
  `return_tokens_as_token_ids` gives "token_id:<id>" strings, `return_token_ids` adds
  `token_ids` and `prompt_token_ids`; completions' `logprobs` {tokens, token_logprobs,
  top_logprobs, text_offset}, chat completions' `logprobs.content` [{token, logprob, bytes,
  top_logprobs}], `usage`,
  `finish_reason` (`stop`, `length`, `abort`, chat's `tool_calls`), and `routed_experts`: base64
  `np.save` bytes of a uint16 array (tokens - 1 - start, num_hidden_layers, k);
- SGLang 0.5 native `/generate` with `return_logprob` (the tokenizer manager's `meta_info`;
  `GenerateReqInput.routed_experts_start_len` in python/sglang/srt/managers/io_struct.py at
  sgl-project/sglang commit f11d231c: the rows cover positions [start, tokens - 1)):
  `output_token_logprobs` [[logprob, token_id, text|null]] (tuples from the offline
  `Engine.generate`), `input_token_logprobs`, `prompt_tokens`, `finish_reason` {"type", ...},
  top-level `output_ids`, and `routed_experts`: base64 of raw int32 (tokens - 1 - start) x
  num_hidden_layers x k, -1 on dense layers.

The routing oracle: the expert ids of the token at absolute position p, hidden layer l, slot s
are 100 p + 10 l + s, so every row says where it belongs.
"""

import base64
import io
import json

import numpy as np
import pytest

from jtree.trees.engine_responses import sglang_generate_turn, vllm_chat_turn, vllm_completion_turn
from jtree.trees.traces import read_rollout, read_traces

PROMPT = [1, 2, 3, 4, 5]

VLLM_COMPLETION = {
    "id": "cmpl-7", "object": "text_completion", "created": 1, "model": "qwen3",
    "choices": [{
        "index": 0, "text": " Paris.", "finish_reason": "stop", "stop_reason": None,
        "token_ids": [10, 11], "prompt_token_ids": PROMPT, "prompt_logprobs": None,
        "routed_experts": None,
        "logprobs": {"text_offset": [0, 6], "token_logprobs": [-0.25, -1.5],
                     "tokens": ["token_id:10", "token_id:11"],
                     "top_logprobs": [{"token_id:10": -0.25}, {"token_id:11": -1.5}]},
    }],
    "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
}

VLLM_CHAT = {
    "id": "chatcmpl-3", "object": "chat.completion", "created": 1, "model": "qwen3",
    "prompt_token_ids": PROMPT + [10, 11, 20, 21],
    "choices": [{
        "index": 0, "finish_reason": "stop", "token_ids": [12, 13],
        "message": {"role": "assistant", "content": "Done.", "tool_calls": []},
        "logprobs": {"content": [
            {"token": "token_id:12", "logprob": -0.5, "bytes": [68, 111],
             "top_logprobs": [{"token": "token_id:12", "logprob": -0.5, "bytes": [68, 111]}]},
            {"token": "token_id:13", "logprob": -0.0, "bytes": [110, 101], "top_logprobs": []},
        ]},
    }],
    "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11},
}

SGLANG = {
    "text": " Lyon.", "output_ids": [16, 17],
    "meta_info": {
        "id": "b1", "finish_reason": {"type": "stop", "matched": 151645},
        "prompt_tokens": 5, "completion_tokens": 2, "cached_tokens": 3,
        "input_token_logprobs": [[None, 3, None], [-2.0, 4, None], [-0.75, 5, None]],
        "output_token_logprobs": [[-0.125, 16, None], [-0.5, 17, None]],
    },
}

# The model's layer map: hidden layer 1 is dense (`mlp_only_layers: [1]`), 0 and 2 are MoE.
SPARSE = [True, False, True]
K = 2


def _with(response, *keys_and_value):
    """A deep copy of `response` with one nested field replaced."""
    out = json.loads(json.dumps(response))
    *keys, last, value = keys_and_value
    target = out
    for k in keys:
        target = target[k]
    target[last] = value
    return out


def _rows(start: int, stop: int, dense: int) -> np.ndarray:
    """The engine's rows for positions start..stop-1: [positions, hidden layers, K], the oracle's
    ids, `dense` on the dense layer."""
    rows = np.array([[[100 * p + 10 * layer + s for s in range(K)] if sparse else [dense] * K
                      for layer, sparse in enumerate(SPARSE)] for p in range(start, stop)])
    return rows.reshape(stop - start, len(SPARSE), K)


def vllm_routing(start: int, stop: int) -> str:
    """vLLM's encoding: `np.save` of a uint16 array, base64 (dense layers hold 0)."""
    buf = io.BytesIO()
    np.save(buf, _rows(start, stop, 0).astype(np.uint16))
    return base64.b64encode(buf.getvalue()).decode()


def sglang_routing(start: int, stop: int) -> str:
    """SGLang's encoding: the raw bytes of an int32 array, base64 (dense layers hold -1)."""
    return base64.b64encode(_rows(start, stop, -1).astype(np.int32).tobytes()).decode()


def expected_routing(n_prompt: int, n_output: int, start: int) -> tuple[list, list]:
    """Per token (prompt, then output) the MoE layers' ids the oracle gives its position, -1
    before `start` and on the last sampled token."""
    rows = [[[100 * p + 10 * layer + s for s in range(K)] for layer in (0, 2)]
            if start <= p < n_prompt + n_output - 1 else [[-1] * K] * 2
            for p in range(n_prompt + n_output)]
    return rows[:n_prompt], rows[n_prompt:]


def test_each_adapter_gives_the_turn_the_engine_saw():
    assert vllm_completion_turn(VLLM_COMPLETION, PROMPT) == {
        "prompt_ids": PROMPT, "output_ids": [10, 11], "output_logprobs": [-0.25, -1.5],
        "finish_reason": "stop"}
    assert vllm_chat_turn(VLLM_CHAT, PROMPT + [10, 11, 20, 21]) == {
        "prompt_ids": PROMPT + [10, 11, 20, 21], "output_ids": [12, 13],
        "output_logprobs": [-0.5, -0.0], "finish_reason": "stop"}
    assert sglang_generate_turn(SGLANG, PROMPT) == {
        "prompt_ids": PROMPT, "output_ids": [16, 17], "output_logprobs": [-0.125, -0.5],
        "finish_reason": "stop"}


def test_the_engine_s_prompt_is_the_prompt():
    # vLLM completions without return_token_ids: usage counts the single prompt.
    plain = {"choices": [{"index": 0, "text": "x", "finish_reason": "length",
                          "logprobs": {"tokens": ["token_id:10"], "token_logprobs": [-0.1]}}],
             "usage": {"prompt_tokens": 6, "completion_tokens": 1, "total_tokens": 7}}
    assert vllm_completion_turn(plain, [1, 2, 3, 4, 5, 6])["prompt_ids"] == [1, 2, 3, 4, 5, 6]
    # Chat: the server's rendering is the prompt, with or without the caller's ids.
    assert vllm_chat_turn(VLLM_CHAT)["prompt_ids"] == PROMPT + [10, 11, 20, 21]
    # SGLang's offline Engine.generate gives its log-prob entries as tuples.
    offline = _with(SGLANG, "meta_info", "output_token_logprobs", [])
    offline["meta_info"]["output_token_logprobs"] = [(-0.125, 16, None), (-0.5, 17, None)]
    offline["meta_info"]["input_token_logprobs"] = [(None, 3, None), (-2.0, 4, None),
                                                    (-0.75, 5, None)]
    assert sglang_generate_turn(offline, PROMPT)["output_logprobs"] == [-0.125, -0.5]


def test_finish_reasons_are_kept_as_the_trace_records_them():
    def vllm(reason):
        return vllm_completion_turn(_with(VLLM_COMPLETION, "choices", 0, "finish_reason",
                                          reason), PROMPT)["finish_reason"]

    def chat(reason):
        return vllm_chat_turn(_with(VLLM_CHAT, "choices", 0, "finish_reason",
                                    reason))["finish_reason"]

    def sglang(reason):
        return sglang_generate_turn(_with(SGLANG, "meta_info", "finish_reason", reason),
                                    PROMPT)["finish_reason"]

    assert [vllm("stop"), vllm("length"), vllm("abort")] == ["stop", "length", "abort"]
    assert chat("tool_calls") == "stop"  # the model stopped to call a tool
    assert [sglang({"type": "length", "length": 2}), sglang({"type": "abort", "message": "x"})] \
        == ["length", "abort"]


@pytest.mark.parametrize("start", [0, 3, 5])
def test_routed_experts_land_on_their_tokens_in_each_engine_s_encoding(start):
    want_prompt, want_output = expected_routing(5, 2, start)
    vllm = _with(VLLM_COMPLETION, "choices", 0, "routed_experts", vllm_routing(start, 6))
    sglang = _with(SGLANG, "meta_info", "routed_experts", sglang_routing(start, 6))
    for turn in (vllm_completion_turn(vllm, PROMPT, sparse_layers=SPARSE, routed_start=start),
                 sglang_generate_turn(sglang, PROMPT, sparse_layers=SPARSE, routed_start=start)):
        assert turn["prompt_routed_experts"] == want_prompt
        assert turn["routed_experts"] == want_output
        assert turn["routed_experts"][-1] == [[-1, -1], [-1, -1]]  # the last sampled token


def test_a_trace_read_from_adapted_turns_routes_each_position_as_the_engine_did():
    """The trace reader puts every row on its own position: the output's first token gets the
    row of position len(prompt), not the last prompt token's (the rows are prompt + output - 1,
    so "the last len(output) rows" would be one position early), and the prefill rows stay on
    the prompt."""
    turn = vllm_completion_turn(
        _with(VLLM_COMPLETION, "choices", 0, "routed_experts", vllm_routing(0, 6)), PROMPT,
        sparse_layers=SPARSE)
    [routed] = read_rollout("t:1", {"group": "g", "turns": [turn]}).routed
    for p in range(6):  # oracle: position p holds 100 p + 10 layer + slot, layers 0 and 2
        assert routed[p].tolist() == [[100 * p, 100 * p + 1], [100 * p + 20, 100 * p + 21]], p
    assert routed[6].tolist() == [[-1, -1], [-1, -1]]


def test_a_second_turn_s_prefill_routes_the_tokens_its_first_turn_did_not(tmp_path):
    """Turn 2 asks for routing from the last token of turn 1 on (routed_experts_prompt_start),
    as a multi-turn agent does: turn 1's prompt keeps turn 1's prefill rows, its outputs their
    sampling rows, its last output token (no row in turn 1) turn 2's prefill row, the tool output
    turn 2's prefill; in a group, the tokens another rollout generated take that rollout's
    sampling rows over their own prefill."""
    first = vllm_completion_turn(
        _with(VLLM_COMPLETION, "choices", 0, "routed_experts", vllm_routing(0, 6)), PROMPT,
        sparse_layers=SPARSE)
    prompt2 = PROMPT + [10, 11, 20, 21]  # turn 1's tokens, then a tool's output
    second = dict(sglang_generate_turn(
        {"output_ids": [12, 13], "meta_info": {
            "prompt_tokens": 9, "finish_reason": {"type": "stop", "matched": 2},
            "output_token_logprobs": [[-0.5, 12, None], [-0.25, 13, None]],
            "routed_experts": base64.b64encode(
                (_rows(6, 10, -1) + 5000).astype(np.int32).tobytes()).decode()}},
        prompt2, sparse_layers=SPARSE, routed_start=6))
    resampled = sglang_generate_turn(  # another rollout's turn 2 from the same context
        {"output_ids": [14], "meta_info": {
            "prompt_tokens": 9, "finish_reason": {"type": "stop", "matched": 2},
            "output_token_logprobs": [[-0.5, 14, None]],
            "routed_experts": base64.b64encode(
                (_rows(0, 9, -1) + 9000).astype(np.int32).tobytes()).decode()}},
        prompt2, sparse_layers=SPARSE)
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"group": "g", "turns": [first, second]}) + "\n"
                    + json.dumps({"group": "g", "turns": [resampled]}) + "\n")
    [tree] = read_traces(path)

    def oracle(p, offset=0):
        return [[offset + 100 * p, offset + 100 * p + 1],
                [offset + 100 * p + 20, offset + 100 * p + 21]]

    # positions 0-4 turn 1's prompt, 5-6 its outputs, 7-8 the tool, 9-10 turn 2's outputs
    two_turns = [oracle(p) for p in range(6)] + [oracle(p, 5000) for p in (6, 7, 8, 9)] \
        + [[[-1, -1], [-1, -1]]]
    assert tree.routed_experts[0].tolist() == two_turns
    # The resampled turn's prompt: outputs 10, 11 (positions 5, 6) were generated by the first
    # rollout, whose sampling rows they take (position 6: its turn 2 prefill row, as the first
    # rollout carries it); the rest keeps its own prefill (+9000).
    resampled_want = [oracle(p, 9000) for p in range(5)] + two_turns[5:7] \
        + [oracle(p, 9000) for p in (7, 8)] + [[[-1, -1], [-1, -1]]]
    assert tree.routed_experts[1].tolist() == resampled_want


@pytest.mark.parametrize("call, match", [
    (lambda: vllm_completion_turn(_with(VLLM_COMPLETION, "choices", 0, "logprobs", "tokens",
                                        [" Paris", "token_id:11"]), PROMPT),
     r"choices\[0\]\.logprobs\.tokens\[0\]: ' Paris' is not a 'token_id:<id>' string"),
    (lambda: vllm_completion_turn(_with(VLLM_COMPLETION, "choices", 0, "logprobs", None), PROMPT),
     r"choices\[0\]\.logprobs: missing"),
    (lambda: vllm_completion_turn(VLLM_COMPLETION, PROMPT[:-1] + [9]),
     r"choices\[0\]\.prompt_token_ids: .* at position 4"),
    (lambda: vllm_completion_turn(_with(VLLM_COMPLETION, "choices", 0, "logprobs",
                                        "token_logprobs", [-0.25]), PROMPT),
     r"token_logprobs: 1 values for 2 tokens"),
    # issue 48's first silent case: truncate_prompt_tokens, no return_token_ids
    (lambda: vllm_completion_turn({"choices": [{"logprobs": {
        "tokens": ["token_id:10"], "token_logprobs": [-0.1]}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 4}}, [1, 2, 3, 4, 5, 6]),
     (r"^usage\.prompt_tokens: the engine read a prompt of 4 tokens, the turn records 6 ids "
      r"\(a truncated prompt: truncate_prompt_tokens")),
    (lambda: vllm_completion_turn(_with(VLLM_COMPLETION, "choices", 0, "prompt_token_ids", None),
                                  PROMPT[:4]),
     r"^usage\.prompt_tokens: the engine read a prompt of 5 tokens, the turn records 4"),
    (lambda: vllm_completion_turn(_with(_with(VLLM_COMPLETION, "choices", 0, "prompt_token_ids",
                                              None), "usage", None), PROMPT),
     r"^usage: missing"),
    (lambda: vllm_chat_turn(_with(VLLM_CHAT, "choices", 0, "logprobs", "content", 1, "logprob",
                                  None), PROMPT + [10, 11, 20, 21]),
     r"choices\[0\]\.logprobs\.content\[1\]\.logprob: expected a log-probability"),
    (lambda: vllm_chat_turn(VLLM_CHAT, PROMPT), r"^prompt_token_ids: the engine reports 9 ids"),
    # issue 48's second silent case: a caller-rendered chat prompt, no engine prompt_token_ids
    (lambda: vllm_chat_turn(_with(_with(VLLM_CHAT, "prompt_token_ids", None), "usage",
                                  "prompt_tokens", 11), list(range(1, 15))),
     r"^prompt_token_ids: missing"),
    (lambda: vllm_chat_turn(_with(VLLM_CHAT, "usage", "prompt_tokens", 7)),
     r"^usage\.prompt_tokens: the engine read a prompt of 7 tokens, the turn records 9 ids"),
    (lambda: vllm_chat_turn(_with(VLLM_CHAT, "choices", 0, "finish_reason", None)),
     r"^choices\[0\]\.finish_reason: null is not a finish reason of a finished turn"),
    (lambda: sglang_generate_turn(_with(SGLANG, "output_ids", [16, 18]), PROMPT),
     r"^output_ids: .* at position 1"),
    (lambda: sglang_generate_turn(SGLANG, [1, 2, 3, 4, 6]),
     r"meta_info\.input_token_logprobs: .* at position 2"),
    # issue 48's third silent case: --allow-auto-truncate
    (lambda: sglang_generate_turn(_with(_with(SGLANG, "meta_info", "prompt_tokens", 4),
                                        "meta_info", "input_token_logprobs", None),
                                  [1, 2, 3, 4, 5, 6, 7]),
     (r"^meta_info\.prompt_tokens: the engine read a prompt of 4 tokens, the turn records 7 "
      r"ids \(a truncated prompt: --allow-auto-truncate\)")),
    (lambda: sglang_generate_turn(_with(SGLANG, "meta_info", "prompt_tokens", None), PROMPT),
     r"^meta_info\.prompt_tokens: missing"),
    (lambda: sglang_generate_turn(_with(SGLANG, "meta_info", "output_token_logprobs", 0,
                                        [-0.125]), PROMPT),
     r"meta_info\.output_token_logprobs\[0\]: expected \[logprob, token_id, text\]"),
    (lambda: sglang_generate_turn(_with(SGLANG, "meta_info", "output_token_logprobs", 1,
                                        [-0.5, True, None]), PROMPT),
     r"^meta_info\.output_token_logprobs\[1\]\[1\]: expected an integer, got true$"),
    (lambda: sglang_generate_turn(_with(SGLANG, "meta_info", "finish_reason", None), PROMPT),
     r"^meta_info\.finish_reason: missing"),
    (lambda: sglang_generate_turn(_with(SGLANG, "meta_info", "finish_reason", {"type": "x"}),
                                  PROMPT),
     r'^meta_info\.finish_reason\.type: "x" is not a finish reason'),
    (lambda: vllm_completion_turn(_with(VLLM_COMPLETION, "choices", 0, "logprobs",
                                        "token_logprobs", [-0.25, "-1.5"]), PROMPT),
     r'token_logprobs\[1\]: expected a log-probability, got "-1\.5"$'),
    # routed experts
    (lambda: vllm_completion_turn(_with(VLLM_COMPLETION, "choices", 0, "routed_experts",
                                        vllm_routing(0, 6)), PROMPT),
     r"^choices\[0\]\.routed_experts: given, but no sparse_layers"),
    (lambda: vllm_completion_turn(_with(VLLM_COMPLETION, "choices", 0, "routed_experts",
                                        vllm_routing(0, 7)), PROMPT, sparse_layers=SPARSE),
     r"^choices\[0\]\.routed_experts: routing of shape \[7, 3, 2\], expected \[6, 3, k\]"),
    (lambda: vllm_completion_turn(_with(VLLM_COMPLETION, "choices", 0, "routed_experts",
                                        vllm_routing(0, 6)), PROMPT, sparse_layers=SPARSE[:2]),
     r"routing of shape \[6, 3, 2\], expected \[6, 2, k\]"),
    (lambda: vllm_completion_turn(_with(VLLM_COMPLETION, "choices", 0, "routed_experts",
                                        vllm_routing(0, 6)), PROMPT, sparse_layers=SPARSE,
                                  routed_start=1),
     r"expected \[5, 3, k\] \(positions 1 to 5"),
    (lambda: vllm_completion_turn(_with(VLLM_COMPLETION, "choices", 0, "routed_experts",
                                        "%%%"), PROMPT, sparse_layers=SPARSE),
     r"^choices\[0\]\.routed_experts: not base64"),
    (lambda: vllm_completion_turn(_with(VLLM_COMPLETION, "choices", 0, "routed_experts",
                                        sglang_routing(0, 6)), PROMPT, sparse_layers=SPARSE),
     r"^choices\[0\]\.routed_experts: not an \.npy array"),
    (lambda: sglang_generate_turn(_with(SGLANG, "meta_info", "routed_experts",
                                        sglang_routing(0, 5)), PROMPT, sparse_layers=SPARSE),
     r"^meta_info\.routed_experts: 120 bytes are not int32 rows of 6 tokens x 3 hidden layers"),
    (lambda: sglang_generate_turn(_with(SGLANG, "meta_info", "routed_experts",
                                        sglang_routing(0, 6)), PROMPT, sparse_layers=SPARSE,
                                  routed_start=6),
     r"^meta_info\.routed_experts: routing start 6 outside the prompt of 5 tokens"),
])
def test_a_response_that_does_not_fit_names_the_field(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_errors_name_the_record_the_caller_passes():
    with pytest.raises(ValueError, match=r"^calls\.jsonl:3: meta_info\.prompt_tokens: the engine "
                                         r"read a prompt of 5 tokens"):
        sglang_generate_turn(_with(SGLANG, "meta_info", "input_token_logprobs", None),
                             PROMPT + [6], record="calls.jsonl:3")
    with pytest.raises(ValueError, match=r"^calls\.jsonl:4: prompt_token_ids: missing$"):
        vllm_chat_turn(_with(VLLM_CHAT, "prompt_token_ids", None), record="calls.jsonl:4")
