"""Engine traces: rollouts recorded token-in / token-out, as the inference engine saw them, read
into trees (docs/rl.md, "Engine traces").

A record (one JSONL line) is one rollout:

    {"group": g, "turns": [{"prompt_ids": [...], "output_ids": [...], "output_logprobs": [...],
                            "reward": r_t}, ...], "reward": R, "weight": w}

`group`, `turns` and every turn's `prompt_ids` and `output_ids` are required. A turn's
`output_logprobs` (one per output token, the engine's sampling log-probs) and `reward` are on
every turn of a rollout or on none; so is `routed_experts` (per output token, per MoE layer, the
k experts the engine's router chose: `jtree.trees.routed_experts`) and `prompt_routed_experts`
(the same per prompt token: the engine's prefill routing; only beside `routed_experts`), one
shape [L][k] per token across the rollout. `finish_reason` (`stop`, `length`, `abort`: why the
engine ended the turn) is allowed on any turn, and `id` on the record.

Finish reasons. A turn the engine cut at its length limit (`length`) is trained as any other under
`truncated="train"`; under `mask` (DAPO's overlong masking) its output tokens are context only,
with loss mask 0, since its reward scores an answer the limit cut off rather than the policy's;
under `drop` the rollout is left out (`Rollout.dropped`). An aborted turn (`abort`) is never
trained: the rollout is a bad record (`aborted="refuse"`) or left out (`drop`).

Training on the tokens the engine produced, not on a retokenization, needs each turn's prompt to
begin with the previous turn's `prompt_ids + output_ids`, token for token. Where it does not
(retokenization drift, a truncated context, an agent that summarizes its history) the record names
the turn and the first position that differs, and `drift` decides: `reject` makes it a bad
record; `branch` cuts the rollout there, never merging the two token streams silently.

Paths. A rollout is cut into runs of turns that extend one another (one run when nothing
drifts). Each run is one path: the tokens of its last turn (`prompt_ids + output_ids`), trained
(loss mask 1) on the output tokens of the run's own turns and nowhere else: prompts (system
prompt, user turns, tool output) are context, and so are the earlier runs' outputs when a later
prompt repeats them. So after a drift at turn t, the path of turns 1..t-1 trains their outputs,
the path of turns t.. shares with it the tokens before the first difference (one trunk in the
tree) and trains only the outputs of turns t.. : every output token is trained once.

Old log-probs: the output tokens' `output_logprobs`. A prompt token has no sampling log-prob and
is never trained on its path; it takes the engine's log-prob of the same tree token from a path
that generated it (a later run, or another rollout whose prompt repeats an output), else 0, so that
paths agree on shared tokens and the old log-probs are not recomputed for a placeholder.

Routed experts: each path carries its tokens' engine routing [tokens, L, k] (`Rollout.routed`),
its run's output tokens as the turns give them (the routing that sampled them), every other
token as the first of its run's turns whose `prompt_routed_experts` routes it (the engine's
prefill), and -1 (own routing) where none does. In the group's tree
(`TrajectoryTree.routed_experts`) a token a path did not generate takes the routing of the same
tree token from the first path that generated it, as the old log-probs do (so a token's replayed
routing and its behaviour log-prob come from one rollout), else keeps its own prefill routing or
-1; a rollout without routed experts in a group of rollouts with them routes every token itself
(-1). The trainer replays them (docs/rl.md, "Routing replay").

Rewards: with turn rewards, a path's rewards are those of its turns, the rollout's `reward` (the
outcome) added to its last turn's; without, the rollout's `reward` is each path's. Rollouts of one
`group` merge into one tree as sequence groups do (`jtree.trees.jsonl.tree_from_group`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jtree.trees import json_values as jv
from jtree.trees.jsonl import Prepare, group_key, iter_lines, parse_line, tree_from_group
from jtree.trees.path_data import as_token_array, check_log_probabilities, per_token
from jtree.trees.routed_experts import Experts, check_routing, routed_array
from jtree.trees.tree import TrajectoryTree

DRIFT_POLICIES = ("reject", "branch")
FINISH_REASONS = ("stop", "length", "abort")
# What each `truncated` policy makes of a turn the engine cut at its length limit, as logged.
TRUNCATED_POLICIES = {"train": "trained", "mask": "not trained, kept as context",
                      "drop": "their rollouts left out"}
ABORTED_POLICIES = ("refuse", "drop")
_RECORD_FIELDS = ("group", "turns", "reward", "weight", "id")
_TURN_FIELDS = ("prompt_ids", "output_ids", "output_logprobs", "reward", "routed_experts",
                "prompt_routed_experts", "finish_reason")


@dataclasses.dataclass(frozen=True)
class _Turn:
    prompt: np.ndarray
    output: np.ndarray
    logprobs: np.ndarray | None
    reward: float | None
    routed: np.ndarray | None
    prompt_routed: np.ndarray | None
    finish: str | None

    @property
    def tokens(self) -> np.ndarray:
        return np.concatenate([self.prompt, self.output])


@dataclasses.dataclass(frozen=True)
class Rollout:
    """One trace record, checked and cut into paths: `paths` are sequence-group lines
    (`jtree.trees.jsonl`) whose `old_logprobs` are NaN on prompt tokens until the group's tree
    fills them; `drifts` the turns where the rollout was branched, one message each; `routed`
    each path's routed experts [tokens, L, k] (-1: own routing; module docstring), None when
    the turns carry none; `truncated` how many turns the engine cut at its length limit;
    `dropped` why the rollout is left out of training (`truncated` or `aborted` `drop`; its
    `paths` are then empty), None when it is kept."""

    where: str
    group: Any
    paths: tuple[dict[str, Any], ...]
    drifts: tuple[str, ...]
    routed: tuple[np.ndarray, ...] | None = None
    truncated: int = 0
    dropped: str | None = None


def _check_fields(rec: Any, allowed: Sequence[str], required: Sequence[str], what: str) -> None:
    jv.json_object(rec, what)
    for field in required:
        if field not in rec:
            raise ValueError(f"{what}: missing field {field!r}")
    unknown = set(rec) - set(allowed)
    if unknown:
        raise ValueError(f"{what}: unknown field {sorted(unknown)[0]!r}")


def _read_turn(at: str, rec: Any, vocab_size: int | None, experts: Experts | None) -> _Turn:
    _check_fields(rec, _TURN_FIELDS, ("prompt_ids", "output_ids"), at)
    prompt, output = (as_token_array(jv.integers(rec[field], f"{at}.{field}"), f"{at}.{field}",
                                     vocab_size) for field in ("prompt_ids", "output_ids"))
    logprobs = None
    if "output_logprobs" in rec:
        what = f"{at}.output_logprobs"
        logprobs = per_token(jv.numbers(rec["output_logprobs"], what), len(output), what,
                             allow_scalar=False)
        check_log_probabilities(logprobs, what)
    routed, prompt_routed = (_read_routing(rec, field, at, tokens, unit, experts)
                             for field, tokens, unit in (
                                 ("routed_experts", output, "output token"),
                                 ("prompt_routed_experts", prompt, "prompt token")))
    reward = jv.number(rec["reward"], f"{at}.reward") if "reward" in rec else None
    finish = None
    if "finish_reason" in rec:
        finish = rec["finish_reason"]
        if finish not in FINISH_REASONS:
            raise jv.refuse(f"{at}.finish_reason", f"one of {', '.join(FINISH_REASONS)}", finish)
    return _Turn(prompt, output, logprobs, reward, routed, prompt_routed, finish)


def _read_routing(rec: dict[str, Any], field: str, at: str, tokens: np.ndarray, unit: str,
                  experts: Experts | None) -> np.ndarray | None:
    """A turn's routed experts `field` [len(tokens), L, k], one entry per `unit`, checked against
    the model's `experts` where given; None when the turn has no such field."""
    if field not in rec:
        return None
    what = f"{at}.{field}"
    routed = routed_array(jv.integer_leaves(rec[field], what), len(tokens), what, unit)
    if experts is not None:
        check_routing(routed, what, num_experts=experts.num_experts, layers=experts.layers,
                      top_k=experts.top_k)
    return routed


def divergence(before: np.ndarray, prompt: np.ndarray) -> int | None:
    """The first position where `prompt` stops repeating `before` (None: it begins with all of
    `before`). A prompt shorter than `before` that repeats it diverges where it ends."""
    n = min(len(before), len(prompt))
    diff = np.flatnonzero(before[:n] != prompt[:n])
    if diff.size:
        return int(diff[0])
    return None if len(prompt) >= len(before) else len(prompt)


def _drift_message(at: str, i: int, before: np.ndarray, prompt: np.ndarray, pos: int) -> str:
    if pos < len(prompt):
        how = f"token {int(prompt[pos])} where turns[{i - 1}] has {int(before[pos])}"
    else:
        how = f"the prompt ends there, inside the {len(before)} tokens of turns[{i - 1}]"
    return (f"{at}: turns[{i}].prompt_ids: does not extend turns[{i - 1}].prompt_ids + "
            f"output_ids: first difference at position {pos} ({how})")


def _path_line(rec: dict[str, Any], turns: Sequence[_Turn], outcome: float | None,
               truncated: str) -> dict[str, Any]:
    """The sequence-group line of one run of turns that extend each other; a length-truncated
    turn's outputs are context only under `truncated="mask"`."""
    tokens = turns[-1].tokens
    mask = np.zeros(len(tokens), np.float32)
    own = np.full(len(tokens), np.nan, np.float32)
    for t in turns:
        start, stop = len(t.prompt), len(t.prompt) + len(t.output)
        mask[start:stop] = 0.0 if t.finish == "length" and truncated == "mask" else 1.0
        if t.logprobs is not None:
            own[start:stop] = t.logprobs
    line: dict[str, Any] = {"group": rec["group"], "tokens": tokens, "loss_mask": mask}
    if turns[0].logprobs is not None:
        line["old_logprobs"] = own
    if turns[0].reward is not None:
        rewards = [t.reward for t in turns]
        rewards[-1] += outcome or 0.0
        line["reward"] = rewards
    elif outcome is not None:
        line["reward"] = outcome
    if "weight" in rec:
        line["weight"] = rec["weight"]
    return line


def read_rollout(where: str, rec: dict[str, Any], *, vocab_size: int | None = None,
                 drift: str = "reject", experts: Experts | None = None,
                 truncated: str = "mask", aborted: str = "refuse") -> Rollout:
    """One trace record checked on its own and cut into paths (module docstring); errors name
    `where`, the turn and the field. `experts`: the model's routing, which the turns' routed
    experts are checked against (layers, k, ids below its experts). `truncated` (`train`,
    `mask`, `drop`) and `aborted` (`refuse`, `drop`): what a turn whose `finish_reason` is
    `length` or `abort` makes of the rollout (module docstring)."""
    for key, value, allowed in (("trace_drift", drift, DRIFT_POLICIES),
                                ("truncated", truncated, TRUNCATED_POLICIES),
                                ("aborted", aborted, ABORTED_POLICIES)):
        if value not in allowed:
            raise ValueError(f"{key}: {value!r} is not one of {tuple(allowed)}")
    _check_fields(rec, _RECORD_FIELDS, ("group", "turns"), where)
    jv.group(rec["group"], f"{where}: group")
    if "weight" in rec:
        jv.number(rec["weight"], f"{where}: weight")
    if not jv.json_list(rec["turns"], f"{where}: turns", "a non-empty list of turns"):
        raise ValueError(f"{where}: turns: expected a non-empty list of turns, got []")
    turns = [_read_turn(f"{where}: turns[{i}]", t, vocab_size, experts)
             for i, t in enumerate(rec["turns"])]
    for field, present in (("output_logprobs", [t.logprobs is not None for t in turns]),
                           ("reward", [t.reward is not None for t in turns]),
                           ("routed_experts", [t.routed is not None for t in turns]),
                           ("prompt_routed_experts",
                            [t.prompt_routed is not None for t in turns])):
        if any(present) and not all(present):
            raise ValueError(f"{where}: turns[{present.index(False)}].{field}: missing, but "
                             f"turns[{present.index(True)}] has it (give it on every turn or none)")
    if turns[0].prompt_routed is not None and turns[0].routed is None:
        raise ValueError(f"{where}: turns[0].prompt_routed_experts: given without "
                         "routed_experts (the output tokens' routing)")
    finishes = [t.finish for t in turns]
    if "abort" in finishes:
        message = (f"{where}: turns[{finishes.index('abort')}].finish_reason: 'abort' (the "
                   "engine stopped the turn before it finished)")
        if aborted == "refuse":
            raise ValueError(f"{message}; data.aborted=drop leaves such rollouts out")
        return Rollout(where, rec["group"], (), (), dropped=message)
    n_truncated = finishes.count("length")
    if n_truncated and truncated == "drop":
        return Rollout(where, rec["group"], (), (), truncated=n_truncated, dropped=(
            f"{where}: turns[{finishes.index('length')}].finish_reason: 'length' "
            "(data.truncated=drop)"))
    outcome = jv.number(rec["reward"], f"{where}: reward") if "reward" in rec else None
    runs: list[list[_Turn]] = [[turns[0]]]
    drifts: list[str] = []
    for i in range(1, len(turns)):
        before, prompt = turns[i - 1].tokens, turns[i].prompt
        pos = divergence(before, prompt)
        if pos is None:
            runs[-1].append(turns[i])
            continue
        message = _drift_message(where, i, before, prompt, pos)
        if drift == "reject":
            raise ValueError(f"{message} (data.trace_drift / --trace-drift branch starts a new "
                             "path there)")
        drifts.append(f"{message}: branched")
        runs.append([turns[i]])
    paths = tuple(_path_line(rec, run, outcome, truncated) for run in runs)
    routed = None if turns[0].routed is None else tuple(_path_routing(where, run) for run in runs)
    return Rollout(where, rec["group"], paths, tuple(drifts), routed, n_truncated)


def _path_routing(where: str, turns: Sequence[_Turn]) -> np.ndarray:
    """A run's routed experts on its path's tokens [tokens, L, k]: its turns' output tokens
    as the engine routed them when sampling; any other token as the first turn whose prompt
    routing (the engine's prefill) gives it, else -1; every turn's entries of one shape [L][k]."""
    spans = [(len(t.prompt), t.routed) for t in turns] + [(0, t.prompt_routed) for t in turns
                                                          if t.prompt_routed is not None]
    shapes = {routed.shape[1:] for _, routed in spans if len(routed)}
    if len(shapes) > 1:
        raise ValueError(f"{where}: routed_experts: turns give [layers][k] of shapes "
                         f"{sorted(shapes)}; one shape per rollout")
    tokens = turns[-1].tokens
    out = np.full((len(tokens), *(shapes.pop() if shapes else (0, 0))), -1, np.int32)
    for start, routed in spans:  # outputs first: a prefill row never replaces a sampling row
        if len(routed):
            span = out[start:start + len(routed)]
            free = np.all(span == -1, axis=(1, 2))
            span[free] = routed[free]
    return out


def _fill_prompt_logprobs(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each line's old log-probs with its prompt tokens (NaN) given the log-prob of the same
    tree token on a line that generated it, else 0."""
    shape = TrajectoryTree.from_sequences([line["tokens"] for line in lines])
    own = np.concatenate([line["old_logprobs"] for line in lines])
    known = ~np.isnan(own)
    generated, first = np.unique(shape.flat_token_index[known], return_index=True)
    values = np.zeros(shape.n_tree_tokens, np.float32)
    values[generated] = own[known][first]
    filled = []
    for p, line in enumerate(lines):
        old = line["old_logprobs"]
        old = np.where(np.isnan(old), values[shape.path_token_index(p)], old)
        filled.append(dict(line, old_logprobs=old))
    return filled


def tree_from_rollouts(rollouts: Sequence[Rollout], *, vocab_size: int | None = None,
                       prepare: Prepare | None = None) -> TrajectoryTree:
    """The tree of one group's rollouts (shared prompts stored once), then `prepare` run on it;
    an error about a path names the line of its rollout."""
    members = [(r.where, line) for r in rollouts for line in r.paths]
    lines = [line for _, line in members]
    if all("old_logprobs" in line for line in lines):
        lines = _fill_prompt_logprobs(lines)
    tree = tree_from_group([(w, line) for (w, _), line in zip(members, lines)],
                           vocab_size=vocab_size, prepare=prepare)
    routed = _group_routing(rollouts)
    return tree if routed is None else tree.with_routed_experts(
        _fill_prompt_routing(tree, routed, [line["loss_mask"] > 0 for line in lines]))


def _group_routing(rollouts: Sequence[Rollout]) -> list[np.ndarray] | None:
    """Every path's routed experts in path order, -1 throughout on the paths of a rollout that
    carries none; None when no rollout of the group does."""
    given = [r for r in rollouts if r.routed is not None]
    if not given:
        return None
    shapes: dict[tuple[int, ...], str] = {}
    for r in given:
        for x in r.routed:
            shapes.setdefault(x.shape[1:], r.where)
            if len(shapes) > 1:
                (a, first), (b, second) = list(shapes.items())[:2]
                raise ValueError(f"{second}: routed_experts: [layers][k] of shape {list(b)}, "
                                 f"but {first} (same group) gives {list(a)}")
    shape = next(iter(shapes))
    return [x for r in rollouts for x in (r.routed if r.routed is not None else
                                          [np.full((len(line["tokens"]), *shape), -1, np.int32)
                                           for line in r.paths])]


def _fill_prompt_routing(tree: TrajectoryTree, routed: list[np.ndarray],
                         trained: list[np.ndarray]) -> list[np.ndarray]:
    """Each path's routing with the tokens it did not generate with a routing (prompt tokens,
    `trained` False, or a sampled token without a row, -1) given the routing of the same tree
    token on the first path that generated it, as the old log-probs are
    (`_fill_prompt_logprobs`), else keeping their own (prefill or -1); so paths agree on every
    shared token unless the engine routed it differently for two of them."""
    flat = np.concatenate(routed)
    sampled = np.concatenate(trained) & ~np.all(flat == -1, axis=(1, 2))
    generated, first = np.unique(tree.flat_token_index[sampled], return_index=True)
    values = np.full((tree.n_tree_tokens, *flat.shape[1:]), -1, np.int32)
    values[generated] = flat[sampled][first]
    has = np.zeros(tree.n_tree_tokens, bool)
    has[generated] = True
    filled = []
    for p, own in enumerate(routed):
        index = tree.path_token_index(p)
        mine = trained[p] & ~np.all(own == -1, axis=(1, 2))
        take = has[index] & ~mine
        filled.append(np.where(take[:, None, None], values[index], own))
    return filled


def path_wheres(rollouts: Sequence[Rollout]) -> list[str]:
    """The `file:line` of every path of the group's tree, in path order."""
    return [r.where for r in rollouts for _ in r.paths]


def read_traces(path: str | Path, *, vocab_size: int | None = None, drift: str = "reject",
                truncated: str = "mask", aborted: str = "refuse") -> list[TrajectoryTree]:
    """One tree per group of a traces file, in order of first appearance, without the dropped
    rollouts (`read_rollout`); the first bad record raises (training reads with a bad-record
    policy and counts what it drops: `jtree.training.tree_files.load_trees`)."""
    groups: dict[str, list[Rollout]] = {}
    for where, line in iter_lines(path):
        rec = parse_line(where, line)
        rollout = read_rollout(where, rec, vocab_size=vocab_size, drift=drift,
                               truncated=truncated, aborted=aborted)
        if rollout.dropped is None:
            groups.setdefault(group_key(rec), []).append(rollout)
    if not groups:
        raise ValueError(f"{path}: no rollouts")
    return [tree_from_rollouts(rs, vocab_size=vocab_size) for rs in groups.values()]
