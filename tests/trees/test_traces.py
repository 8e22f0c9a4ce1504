"""Engine traces (`jtree.trees.traces`): rollouts recorded token-in / token-out become trees whose
every path is written out by hand below (tokens, loss mask, old log-probs, rewards), the drift
rule under both policies, the bad records, and a tiny training run on a traces file."""

import json
from pathlib import Path

import numpy as np
import pytest

from jtree.cli import main as jtree
from jtree.config import load_config
from jtree.training.run_data import load_training_trees
from jtree.training.tree_files import load_trees
from jtree.trees.routed_experts import check_routing, routed_array
from jtree.trees.merge import merge_trees
from jtree.trees.part import TreePart
from jtree.trees.traces import read_rollout, read_traces
from tests.run_util import VOCAB, finish, launch, read_metrics, tiny_overrides

SYSTEM, USER = [1, 2, 3], [4, 5]
ASK = SYSTEM + USER  # the prompt every rollout of the group starts from
TOOL_A, TOOL_B = [20, 21], [22]


def _turn(prompt, output, logprobs=None, **extra):
    turn = {"prompt_ids": prompt, "output_ids": output, **extra}
    if logprobs is not None:
        turn["output_logprobs"] = logprobs
    return turn


def _write(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


# A group of rollouts sharing the system prompt and question. A and B share turn 0 and resample
# turn 1 after the same tool output; C takes another tool output after the same call (a parallel
# branch); D answers differently at once and F repeats D exactly (a duplicate path); E stops
# after A's first turn (a path ending inside the tree); G is a resampled turn recorded from A's
# context, so A's first output is prompt on G's path. Another group shares a first token.
TURN0 = _turn(ASK, [10, 11], [-0.1, -0.2])
AFTER_TOOL_A = ASK + [10, 11] + TOOL_A
ROLLOUTS = [
    {"group": "task", "reward": 1.0, "turns": [TURN0, _turn(AFTER_TOOL_A, [12], [-0.3])]},
    {"group": "task", "reward": 0.0, "turns": [TURN0, _turn(AFTER_TOOL_A, [13, 14], [-0.4, -0.5])]},
    {"group": "task", "reward": 0.5,
     "turns": [TURN0, _turn(ASK + [10, 11] + TOOL_B, [15], [-0.6])]},
    {"group": "task", "reward": 0.0, "turns": [_turn(ASK, [16, 17], [-0.7, -0.8])]},
    {"group": "task", "reward": 0.25, "turns": [TURN0]},
    {"group": "task", "reward": 0.0, "turns": [_turn(ASK, [16, 17], [-0.7, -0.8])]},
    {"group": "task", "reward": 1.0, "turns": [_turn(AFTER_TOOL_A, [18], [-0.9])]},
    {"group": "other", "reward": 0.0, "turns": [_turn([1, 6], [7], [-1.0])]},
]

# Path by path: (tokens, loss mask, old log-probs, reward). Prompt tokens are never trained and
# take the log-prob of a path that generated the same tree token (G's 10, 11), else 0.
EXPECTED_TASK = [
    (ASK + [10, 11] + TOOL_A + [12], [0] * 5 + [1, 1, 0, 0, 1],
     [0] * 5 + [-0.1, -0.2, 0, 0, -0.3], 1.0),
    (ASK + [10, 11] + TOOL_A + [13, 14], [0] * 5 + [1, 1, 0, 0, 1, 1],
     [0] * 5 + [-0.1, -0.2, 0, 0, -0.4, -0.5], 0.0),
    (ASK + [10, 11] + TOOL_B + [15], [0] * 5 + [1, 1, 0, 1], [0] * 5 + [-0.1, -0.2, 0, -0.6], 0.5),
    (ASK + [16, 17], [0] * 5 + [1, 1], [0] * 5 + [-0.7, -0.8], 0.0),
    (ASK + [10, 11], [0] * 5 + [1, 1], [0] * 5 + [-0.1, -0.2], 0.25),
    (ASK + [16, 17], [0] * 5 + [1, 1], [0] * 5 + [-0.7, -0.8], 0.0),
    (ASK + [10, 11] + TOOL_A + [18], [0] * 9 + [1], [0] * 5 + [-0.1, -0.2, 0, 0, -0.9], 1.0),
]


def _check_paths(tree, expected):
    assert tree.n_paths == len(expected)
    for p, (tokens, mask, old, reward) in enumerate(expected):
        assert tree.path_tokens(p).tolist() == tokens, p
        assert tree.loss_masks[p].tolist() == mask, p
        np.testing.assert_allclose(tree.old_logprobs[p], old, atol=1e-7, err_msg=str(p))
        assert tree.rewards[p] == pytest.approx(reward), p
    # each shared prefix is stored once: a tree token per distinct prefix of the paths
    prefixes = {tuple(t[: i + 1]) for t, *_ in expected for i in range(len(t))}
    assert tree.n_tree_tokens == len(prefixes)


def test_a_group_of_rollouts_branches_at_several_levels(tmp_path):
    task, other = read_traces(_write(tmp_path / "t.jsonl", ROLLOUTS), vocab_size=VOCAB)
    _check_paths(task, EXPECTED_TASK)
    assert task.n_tree_tokens == 17 and int(task.node_levels.max()) == 4
    _check_paths(other, [([1, 6, 7], [0, 0, 1], [0, 0, -1.0], 0.0)])
    # every shared token carries one old log-prob on all its paths: nothing to recompute
    assert task.tree_token_values(task.old_logprobs)[1] == 0.0


def test_turn_rewards_are_per_turn_with_the_outcome_on_the_last(tmp_path):
    rec = {"group": 0, "reward": 1.0, "turns": [
        _turn(ASK, [10], reward=0.5), _turn(ASK + [10, 20], [12], reward=0.25)]}
    [tree] = read_traces(_write(tmp_path / "t.jsonl", [rec]))
    assert tree.turn_rewards[0].tolist() == [0.5, 1.25] and tree.old_logprobs is None
    assert tree.loss_masks[0].tolist() == [0] * 5 + [1, 0, 1]


# Turn 1's prompt retokenizes turn 0's output (token 11 became 30, 31); turn 2 extends turn 1.
DRIFTING = {"group": "g", "reward": 1.0, "weight": 2.0, "turns": [
    _turn(ASK, [10, 11], [-0.1, -0.2], reward=0.1),
    _turn(ASK + [10, 30, 31, 20], [12], [-0.3], reward=0.2),
    _turn(ASK + [10, 30, 31, 20, 12, 21], [13], [-0.4], reward=0.3)]}
DRIFT_MESSAGE = ("t.jsonl:1: turns[1].prompt_ids: does not extend turns[0].prompt_ids + "
                 "output_ids: first difference at position 6 (token 30 where turns[0] has 11)")


def test_drift_is_rejected_naming_line_turn_and_position(tmp_path):
    path = _write(tmp_path / "t.jsonl", [DRIFTING])
    with pytest.raises(ValueError) as e:
        read_traces(path)
    assert str(e.value) == (f"{tmp_path}/{DRIFT_MESSAGE} (data.trace_drift / --trace-drift "
                            "branch starts a new path there)")


def test_drift_branches_a_new_path_that_shares_the_tokens_before_the_difference(tmp_path):
    path = _write(tmp_path / "t.jsonl", [DRIFTING])
    [tree] = read_traces(path, drift="branch")
    later = ASK + [10, 30, 31, 20, 12, 21, 13]
    _check_paths(tree, [
        # turn 0 keeps its loss on its own path; the outcome is credited to each path's last turn
        (ASK + [10, 11], [0] * 5 + [1, 1], [0] * 5 + [-0.1, -0.2], 1.1),
        # turns 1 and 2: token 10, generated in turn 0, is context here (log-prob taken over)
        (later, [0] * 9 + [1, 0, 1], [0] * 5 + [-0.1, 0, 0, 0, -0.3, 0, -0.4], 1.5),
    ])
    assert [r.tolist() for r in tree.turn_rewards] == [[1.1], [0.2, 1.3]]
    assert tree.weights.tolist() == [2.0, 2.0]
    assert tree.n_tree_tokens == 6 + 1 + 6  # shared trunk up to position 5, then two branches

    trees, report = load_trees(path, "traces", vocab_size=VOCAB, trace_drift="branch")
    assert report.n_branched == 1 and report.n_bad == 0
    assert report.first_branches[0] == f"{tmp_path}/{DRIFT_MESSAGE}: branched"


def test_a_truncated_context_drifts_where_the_prompt_ends(tmp_path):
    rec = {"group": 0, "turns": [_turn(ASK, [10, 11]), _turn(ASK, [12])]}
    path = _write(tmp_path / "t.jsonl", [rec])
    with pytest.raises(ValueError, match=r"t\.jsonl:1: turns\[1\]\.prompt_ids: .* at position 5 "
                                         r"\(the prompt ends there, inside the 7 tokens of "
                                         r"turns\[0\]\)"):
        read_traces(path)
    [tree] = read_traces(path, drift="branch")
    assert [tree.path_tokens(p).tolist() for p in range(2)] == [ASK + [10, 11], ASK + [12]]
    assert [m.tolist() for m in tree.loss_masks] == [[0] * 5 + [1, 1], [0] * 5 + [1]]


GOOD = {"group": 0, "turns": [_turn(ASK, [10, 11], [-0.1, -0.2])]}


@pytest.mark.parametrize("records, match", [
    ([{"group": 0, "turns": []}], r"t\.jsonl:1: turns: expected a non-empty list"),
    ([{"group": 0, "turns": [_turn(ASK, [])]}], r"t\.jsonl:1: turns\[0\]\.output_ids: tokens is "
                                                r"empty"),
    ([{"turns": [_turn(ASK, [10])]}], r"t\.jsonl:1: missing field 'group'"),
    ([{"group": 0, "turns": [{"prompt_ids": ASK}]}], r"t\.jsonl:1: turns\[0\]: missing field "
                                                     r"'output_ids'"),
    ([GOOD, {"group": 0, "score": 1, "turns": [_turn(ASK, [10])]}],
     r"t\.jsonl:2: unknown field 'score'"),
    ([{"group": 0, "turns": [_turn(ASK, [10], logprobs=[-1.0], logprob=[-1.0])]}],
     r"t\.jsonl:1: turns\[0\]: unknown field 'logprob'"),
    ([{"group": 0, "turns": [_turn(ASK, [10, 11], [-0.1])]}],
     r"t\.jsonl:1: turns\[0\]\.output_logprobs: expected 2 values \(one per token\), got shape"),
    ([{"group": 0, "turns": [_turn(ASK, [10, 11], [-0.1, 0.5])]}],
     r"t\.jsonl:1: turns\[0\]\.output_logprobs\[1\] = 0\.5 is above 0"),
    ([{"group": 0, "turns": [_turn(ASK, [10, VOCAB])]}],
     rf"t\.jsonl:1: turns\[0\]\.output_ids: tokens\[1\] = {VOCAB} is outside the vocabulary"),
    ([{"group": 0, "turns": [_turn([VOCAB + 5], [10])]}],
     r"t\.jsonl:1: turns\[0\]\.prompt_ids: tokens\[0\] = 69 is outside the vocabulary"),
    ([{"group": 0, "turns": [_turn(ASK, [10], [-0.1]), _turn(ASK + [10], [11])]}],
     r"t\.jsonl:1: turns\[1\]\.output_logprobs: missing, but turns\[0\] has it"),
    ([{"group": 0, "turns": [_turn(ASK, [10], routed_experts=[[[1, 2]], [[3, 4]]])]}],
     r"t\.jsonl:1: turns\[0\]\.routed_experts: expected a list of 1 entries"),
    ([{"group": 0, "turns": [_turn(ASK, [10, 11], routed_experts=[[[1, 2]], [[3]]])]}],
     r"t\.jsonl:1: turns\[0\]\.routed_experts: expected every token's entry as \[layers\]\[k\] "
     r"integer expert ids of one shape"),
    ([{"group": 0, "turns": [_turn(ASK, [10, 11], routed_experts=[[1, 2], [3, 4]])]}],
     r"t\.jsonl:1: turns\[0\]\.routed_experts: expected every token's entry as \[layers\]"),
    ([{"group": 0, "turns": [_turn(ASK, [10, 11], routed_experts=[[[1, 2]], [[3, -2]]])]}],
     r"t\.jsonl:1: turns\[0\]\.routed_experts\[1\]: expert ids \[\[3, -2\]\] not all >= 0"),
    ([{"group": 0, "turns": [_turn(ASK, [10, 11], routed_experts=[[[1, 2]], [[3, 3]]])]}],
     r"t\.jsonl:1: turns\[0\]\.routed_experts\[1\]: an expert twice in one layer"),
    ([{"group": 0, "turns": [_turn(ASK, [10], routed_experts=[[[1, 2]]]),
                             _turn(ASK + [10], [11])]}],
     r"t\.jsonl:1: turns\[1\]\.routed_experts: missing, but turns\[0\] has it"),
    ([{"group": 0, "turns": [_turn(ASK, [10], routed_experts=[[[1, 2]]]),
                             _turn(ASK + [10], [11], routed_experts=[[[1, 2, 3]]])]}],
     r"t\.jsonl:1: routed_experts: turns give \[layers\]\[k\] of shapes"),
    ([{"group": 0, "turns": [_turn(ASK, [10], finish_reason="eos")]}],
     r't\.jsonl:1: turns\[0\]\.finish_reason: expected one of stop, length, abort, got "eos"'),
    ([{"group": 0, "turns": [_turn(ASK, [10], routed_experts=[[[1, 2]]],
                                   prompt_routed_experts=[[[1, 2]]] * 4)]}],
     (r"t\.jsonl:1: turns\[0\]\.prompt_routed_experts: expected a list of 5 entries \(one "
      r"per prompt token\)")),
    ([{"group": 0, "turns": [_turn(ASK, [10], prompt_routed_experts=[[[1, 2]]] * 5)]}],
     r"t\.jsonl:1: turns\[0\]\.prompt_routed_experts: given without routed_experts"),
    ([{"group": 0, "turns": [_turn(ASK, [10], routed_experts=[[[1, 2]]],
                                   prompt_routed_experts=[[[1, 2, 3]]] * 5)]}],
     r"t\.jsonl:1: routed_experts: turns give \[layers\]\[k\] of shapes"),
    ([{"group": 0, "reward": [1.0], "turns": [_turn(ASK, [10])]}],
     r"t\.jsonl:1: reward: expected a number"),
    ([GOOD, {"group": 0, "turns": [_turn(ASK, [12])]}],
     r"t\.jsonl:2: old_logprobs is missing but other paths of the tree have it"),
])
def test_bad_records_name_line_turn_and_field(tmp_path, records, match):
    path = _write(tmp_path / "t.jsonl", records)
    with pytest.raises(ValueError, match=match):
        load_trees(path, "traces", vocab_size=VOCAB)


# A group whose rollouts the engine ended differently: A's second turn hit the length limit
# after B's shared first turn (a branch below a truncated turn's sibling), C was cut at once.
FINISHED = [
    {"group": "f", "reward": 0.0, "turns": [
        _turn(ASK, [10, 11], [-0.1, -0.2], finish_reason="stop"),
        _turn(AFTER_TOOL_A, [12, 13], [-0.3, -0.4], finish_reason="length")]},
    {"group": "f", "reward": 1.0, "turns": [
        _turn(ASK, [10, 11], [-0.1, -0.2], finish_reason="stop"),
        _turn(AFTER_TOOL_A, [14], [-0.5], finish_reason="stop")]},
    {"group": "f", "reward": 0.0, "turns": [_turn(ASK, [16, 17], [-0.7, -0.8],
                                                  finish_reason="length")]},
]


@pytest.mark.parametrize("policy, masks", [
    ("train", [[0] * 5 + [1, 1, 0, 0, 1, 1], [0] * 5 + [1, 1, 0, 0, 1], [0] * 5 + [1, 1]]),
    # DAPO's overlong masking: the cut turn is context only, the rest of its rollout trains
    ("mask", [[0] * 5 + [1, 1, 0, 0, 0, 0], [0] * 5 + [1, 1, 0, 0, 1], [0] * 7]),
    ("drop", [[0] * 5 + [1, 1, 0, 0, 1]]),
])
def test_a_length_truncated_turn_is_trained_masked_or_dropped(tmp_path, policy, masks):
    path = _write(tmp_path / "t.jsonl", FINISHED)
    [tree] = read_traces(path, truncated=policy)
    assert [m.tolist() for m in tree.loss_masks] == masks
    _, report = load_trees(path, "traces", vocab_size=VOCAB, truncated=policy)
    assert report.n_truncated == 2 and report.truncated == policy
    assert report.n_dropped == (2 if policy == "drop" else 0)
    if policy == "drop":
        assert report.first_dropped[0] == (f"{path}:1: turns[1].finish_reason: 'length' "
                                           "(data.truncated=drop)")


def test_an_aborted_turn_is_refused_or_dropped_never_trained(tmp_path):
    aborted = {"group": "f", "turns": [_turn(ASK, [10, 11], [-0.1, -0.2], finish_reason="stop"),
                                       _turn(AFTER_TOOL_A, [12], [-0.3], finish_reason="abort")]}
    path = _write(tmp_path / "t.jsonl", [FINISHED[1], aborted])
    message = (f"{path}:2: turns[1].finish_reason: 'abort' (the engine stopped the turn before "
               "it finished)")
    with pytest.raises(ValueError) as e:
        load_trees(path, "traces", vocab_size=VOCAB)
    assert str(e.value) == f"{message}; data.aborted=drop leaves such rollouts out"
    [tree], report = load_trees(path, "traces", vocab_size=VOCAB, aborted="drop")
    assert tree.n_paths == 1 and report.n_dropped == 1 and report.first_dropped == (message,)
    _, report = load_trees(path, "traces", vocab_size=VOCAB, on_bad_record="skip")
    assert report.n_bad == 1  # refused: a bad record, skipped and counted
    with pytest.raises(ValueError, match=r"t\.jsonl: no usable records \(0 bad, 1 dropped\); "
                                         r"first dropped: .*'abort'"):
        load_trees(_write(tmp_path / "t.jsonl", [aborted]), "traces", vocab_size=VOCAB,
                   aborted="drop")


def test_the_run_logs_what_it_did_with_truncated_and_aborted_turns(tmp_path, capsys):
    data = _write(tmp_path / "traces.jsonl", FINISHED)
    cfg = load_config("configs/tiny.yaml", tiny_overrides(data, **{"data.format": "traces"}))
    load_training_trees(cfg)
    assert ("; 2 trace turn(s) cut at the engine's length limit (data.truncated=mask: not "
            "trained, kept as context)") in capsys.readouterr().out
    capsys.readouterr()
    # jtree stats reads as the run does: C's one turn was cut, so dropping leaves one rollout
    assert jtree(["stats", str(data), "--format", "traces", "--truncated", "drop"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].split()[:2] == ["total", "1"]
    with pytest.raises(ValueError, match=r"data\.truncated: 'cut' is not one of"):
        load_config("configs/tiny.yaml", tiny_overrides(data, **{"data.truncated": "cut"}))
    with pytest.raises(ValueError, match=r"data\.aborted: 'skip' is not one of"):
        load_config("configs/tiny.yaml", tiny_overrides(data, **{"data.aborted": "skip"}))


def test_a_skipped_bad_record_is_counted_and_the_rest_trains(tmp_path):
    bad = {"group": 0, "turns": [_turn(ASK, [10, 11], [-0.1, -0.2]),
                                 _turn(ASK + [12], [13], [-0.3])]}
    path = _write(tmp_path / "t.jsonl", [GOOD, bad, dict(GOOD, group=1)])
    trees, report = load_trees(path, "traces", vocab_size=VOCAB, on_bad_record="skip")
    assert (report.n_lines, report.n_trees, report.n_bad) == (3, 2, 1)
    assert report.first_errors[0].startswith(f"{path}:2: turns[1].prompt_ids: does not extend")


def test_a_log_prob_within_the_tolerance_and_routed_experts_are_accepted(tmp_path):
    rec = {"group": 0, "turns": [_turn(ASK, [10, 11], [5e-4, -0.2],
                                       routed_experts=[[[1, 0], [2, 3]], [[2, 1], [0, 3]]])]}
    [tree] = read_traces(_write(tmp_path / "t.jsonl", [rec]))
    assert tree.old_logprobs[0][5] == pytest.approx(5e-4)


def test_routed_experts_sit_on_each_path_s_output_tokens():
    # Two turns, then a drifted third (a new path): each path routes its own run's outputs.
    turns = [_turn(ASK, [10], routed_experts=[[[1, 0]]]),
             _turn(ASK + [10] + TOOL_A, [11, 12], routed_experts=[[[2, 3]], [[0, 3]]]),
             _turn(ASK + [13], [14], routed_experts=[[[3, 1]]])]
    rollout = read_rollout("t.jsonl:1", {"group": 0, "turns": turns}, drift="branch")
    none = [[-1, -1]]
    np.testing.assert_array_equal(rollout.routed[0], [none] * 5 + [[[1, 0]]] + [none] * 2
                                  + [[[2, 3]], [[0, 3]]])
    np.testing.assert_array_equal(rollout.routed[1], [none] * 6 + [[[3, 1]]])


def test_the_group_tree_carries_each_path_s_routing_with_prompt_copies_filled(tmp_path):
    """In the tree a prompt token takes the routing of the first path that generated it (as
    its old log-prob does); a rollout without routed experts routes itself (-1); parts, merges
    and the baseline's paths carry each path's routing."""
    none = [[-1, -1]]
    recs = [{"group": 0, "turns": [_turn(ASK, [10, 11], routed_experts=[[[1, 0]], [[2, 3]]])]},
            {"group": 0, "turns": [_turn(ASK + [10, 11] + TOOL_A, [12],
                                         routed_experts=[[[0, 3]]])]},
            {"group": 0, "turns": [_turn(ASK + [10], [13])]},  # no routed experts
            {"group": 1, "turns": [_turn(ASK, [14])]}]
    a, b = read_traces(_write(tmp_path / "t.jsonl", recs))
    # Written out: path 1 repeats path 0's outputs in its prompt; path 2 repeats token 10.
    expected = [[none] * 5 + [[[1, 0]], [[2, 3]]],
                [none] * 5 + [[[1, 0]], [[2, 3]]] + [none] * 2 + [[[0, 3]]],
                [none] * 5 + [[[1, 0]]] + [none]]
    for got, want in zip(a.routed_experts, expected):
        np.testing.assert_array_equal(got, want)
    assert b.routed_experts is None
    part = TreePart.from_paths(a, [2, 1])
    np.testing.assert_array_equal(part.routed_experts[0], expected[2])
    np.testing.assert_array_equal(a.path_as_tree(1).routed_experts[0], expected[1])
    merged = merge_trees([b, a])  # b's path routes itself
    np.testing.assert_array_equal(merged.routed_experts[0], [none] * 6)
    np.testing.assert_array_equal(merged.routed_experts[3], expected[2])
    other = dict(recs[2], turns=[_turn(ASK + [10], [13], routed_experts=[[[1, 0], [2, 3]]])])
    with pytest.raises(ValueError, match=r"t2\.jsonl:3: routed_experts: \[layers\]\[k\] of "
                                         r"shape \[2, 2\], but .*t2\.jsonl:1 \(same group\) "
                                         r"gives \[1, 2\]"):
        read_traces(_write(tmp_path / "t2.jsonl", [*recs[:2], other]))


def test_expert_ids_are_checked_against_the_model():
    routed = routed_array([[[1, 0]], [[-1, -1]], [[3, 2]]], 3, "r")
    check_routing(routed, "r", num_experts=4, layers=1, top_k=2)
    with pytest.raises(ValueError, match=r"r\[2\]: expert ids \[\[3, 2\]\] not all \[0, 3\)"):
        check_routing(routed, "r", num_experts=3)
    with pytest.raises(ValueError, match=r"r: 2 k per token, the model has 4 \(experts per "
                                         r"token\)"):
        check_routing(routed, "r", top_k=4)
    with pytest.raises(ValueError, match=r"r: 1 layers per token, the model has 2 \(MoE layers"):
        check_routing(routed, "r", layers=2)


def test_a_file_of_another_format_names_the_format_to_use(tmp_path):
    path = _write(tmp_path / "g.jsonl", [{"group": 0, "tokens": [1, 2]}])
    with pytest.raises(ValueError, match=r"g\.jsonl:1: a 'groups' record .* data.format=groups"):
        load_trees(path, "traces", vocab_size=VOCAB)


def _rollout_group(rng, group: int) -> list[dict]:
    """Four rollouts of two turns after one prompt, with engine log-probs and rewards: the first
    two share their first turn, the last one's second prompt drifts (retokenized)."""
    def ids(n):
        return [int(t) for t in rng.integers(1, VOCAB, n)]

    prompt, shared = ids(12), ids(6)
    records = []
    for k in range(4):
        first = shared if k < 2 else ids(6)
        context = prompt + first + ids(4)
        if k == 3:
            context[len(prompt) + 5] = (first[5] + 1) % VOCAB
        turns = [_turn(prompt, first, (-rng.random(6)).tolist()),
                 _turn(context, ids(5), (-rng.random(5)).tolist())]
        records.append({"group": group, "reward": float(k % 2), "turns": turns})
    return records


def test_the_run_config_and_jtree_stats_read_traces(tmp_path, capsys):
    rng = np.random.default_rng(0)
    data = _write(tmp_path / "traces.jsonl", _rollout_group(rng, 0) + _rollout_group(rng, 1))
    overrides = tiny_overrides(data, **{"data.format": "traces"})
    with pytest.raises(ValueError, match=r"traces\.jsonl:4: turns\[1\]\.prompt_ids: does not "
                                         r"extend"):
        load_training_trees(load_config("configs/tiny.yaml", overrides))
    cfg = load_config("configs/tiny.yaml", overrides + ["data.trace_drift=branch"])
    trees, report = load_training_trees(cfg)
    assert [t.n_paths for t in trees] == [5, 5] and report.n_branched == 2
    assert jtree(["stats", str(data), "--format", "traces", "--trace-drift", "branch"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].split()[:2] == ["total", "10"]


@pytest.mark.slow
def test_a_tiny_training_run_trains_on_a_traces_file(tmp_path):
    rng = np.random.default_rng(0)
    data = _write(tmp_path / "traces.jsonl",
                  [r for g in range(8) for r in _rollout_group(rng, g)])
    metrics = tmp_path / "metrics.jsonl"
    args = ["--config", "configs/tiny.yaml", *tiny_overrides(data, **{
        "data.format": "traces", "data.trace_drift": "branch", "objective.kind": "ppo",
        "objective.advantage": "grpo",
        "run.steps": 2, "run.metrics_jsonl": metrics})]
    code, out, err = finish(launch(args, tmp_path / "run"), tmp_path / "run")
    assert code == 0, err[-3000:]
    log = out + err
    assert "data: 8 trees from" in log and "(traces)" in log
    assert "branched 8 trace rollout(s)" in log
    rows = read_metrics(metrics)
    assert len(rows) == 2 and all(np.isfinite(r["loss"]) for r in rows)
