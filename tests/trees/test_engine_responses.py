"""Engine responses into trace turns (`jtree.trees.engine_responses`), on example responses
written from the engines' documentation:

- vLLM OpenAI-compatible server (vLLM v0.10-0.11 protocol: `return_tokens_as_token_ids` gives
  "token_id:<id>" strings; `return_token_ids` adds `token_ids` and `prompt_token_ids`),
  completions' `logprobs` {tokens, token_logprobs, top_logprobs, text_offset} and chat
  completions' `logprobs.content` [{token, logprob, bytes, top_logprobs}];
- SGLang native `/generate` with `return_logprob` (docs.sglang.io "SGLang Native APIs"):
  `meta_info.output_token_logprobs` [[logprob, token_id, text|null]], `input_token_logprobs`
  (first logprob null) and the top-level `output_ids`.
"""

import json

import pytest

from jtree.trees.engine_responses import sglang_generate_turn, vllm_chat_turn, vllm_completion_turn
from jtree.trees.traces import read_traces

PROMPT = [1, 2, 3, 4, 5]

VLLM_COMPLETION = {
    "id": "cmpl-7", "object": "text_completion", "created": 1, "model": "qwen3",
    "choices": [{
        "index": 0, "text": " Paris.", "finish_reason": "stop", "stop_reason": None,
        "token_ids": [10, 11], "prompt_token_ids": PROMPT,
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


def test_each_adapter_gives_the_turn_the_engine_saw():
    assert vllm_completion_turn(VLLM_COMPLETION, PROMPT) == {
        "prompt_ids": PROMPT, "output_ids": [10, 11], "output_logprobs": [-0.25, -1.5]}
    assert vllm_chat_turn(VLLM_CHAT, PROMPT + [10, 11, 20, 21]) == {
        "prompt_ids": PROMPT + [10, 11, 20, 21], "output_ids": [12, 13],
        "output_logprobs": [-0.5, -0.0]}
    assert sglang_generate_turn(SGLANG, PROMPT) == {
        "prompt_ids": PROMPT, "output_ids": [16, 17], "output_logprobs": [-0.125, -0.5]}


def test_adapted_turns_make_a_trace_that_reads_into_a_tree(tmp_path):
    first = vllm_completion_turn(VLLM_COMPLETION, PROMPT)
    tool = [20, 21]
    second = vllm_chat_turn(VLLM_CHAT, first["prompt_ids"] + first["output_ids"] + tool)
    records = [{"group": "q1", "reward": 1.0, "turns": [first, second]},
               {"group": "q1", "reward": 0.0, "turns": [sglang_generate_turn(SGLANG, PROMPT)]}]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    [tree] = read_traces(path)
    assert tree.path_tokens(0).tolist() == PROMPT + [10, 11, 20, 21, 12, 13]
    assert tree.loss_masks[0].tolist() == [0] * 5 + [1, 1, 0, 0, 1, 1]
    assert tree.old_logprobs[0].tolist() == [0] * 5 + [-0.25, -1.5, 0, 0, -0.5, 0]
    assert tree.path_tokens(1).tolist() == PROMPT + [16, 17]


def _with(response, *keys_and_value):
    """A deep copy of `response` with one nested field replaced."""
    out = json.loads(json.dumps(response))
    *keys, last, value = keys_and_value
    target = out
    for k in keys:
        target = target[k]
    target[last] = value
    return out


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
    (lambda: vllm_chat_turn(_with(VLLM_CHAT, "choices", 0, "logprobs", "content", 1, "logprob",
                                  None), PROMPT + [10, 11, 20, 21]),
     r"choices\[0\]\.logprobs\.content\[1\]\.logprob: expected a log-probability"),
    (lambda: vllm_chat_turn(VLLM_CHAT, PROMPT), r"^prompt_token_ids: the engine reports 9 ids"),
    (lambda: sglang_generate_turn(_with(SGLANG, "output_ids", [16, 18]), PROMPT),
     r"^output_ids: .* at position 1"),
    (lambda: sglang_generate_turn(SGLANG, [1, 2, 3, 4, 6]),
     r"meta_info\.input_token_logprobs: .* at position 2"),
    (lambda: sglang_generate_turn(_with(SGLANG, "meta_info", "output_token_logprobs", 0,
                                        [-0.125]), PROMPT),
     r"meta_info\.output_token_logprobs\[0\]: expected \[logprob, token_id, text\]"),
    (lambda: sglang_generate_turn(_with(SGLANG, "meta_info", "output_token_logprobs", 1,
                                        [-0.5, True, None]), PROMPT),
     r"^meta_info\.output_token_logprobs\[1\]\[1\]: expected an integer, got true$"),
    (lambda: vllm_completion_turn(_with(VLLM_COMPLETION, "choices", 0, "logprobs",
                                        "token_logprobs", [-0.25, "-1.5"]), PROMPT),
     r'token_logprobs\[1\]: expected a log-probability, got "-1\.5"$'),
])
def test_a_response_that_does_not_fit_names_the_field(call, match):
    with pytest.raises(ValueError, match=match):
        call()
