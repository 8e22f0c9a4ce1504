"""`objective.routing_replay` in training runs (docs/rl.md, "Routing replay"): a tiny Qwen3-MoE
trained on a traces file whose turns carry the engine's routed experts. The run's own pieces
(the traces read into trees, the step builders with partitioning, cross-group merging and
micro-batches, the pipeline, the step) against a per-path computation written here: every path
run alone through the model with its own forced experts, the prompt tokens it shares with a path
that generated them routed as that path's engine did (the documented rule, written out below
over token prefixes, not with jtree's trees). Also: replay changes the gradients, the per-step
gauges against a count written here, and the refusals."""

from __future__ import annotations

import base64
import dataclasses
import functools
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jtree.config import load_config
from jtree.kernels import TreeMask
from jtree.launch.train import main
from jtree.layout.batch import DeviceBatch, LossCoefficients
from jtree.memory.step_shapes import abstract_step_args
from jtree.models.architectures import create_model
from jtree.objectives.logprobs import token_logprobs
from jtree.step.train_step import make_grad_fn
from jtree.training.run import TrainingRun, train
from jtree.training.run_data import load_training_trees
from jtree.training.trainer import Trainer
from jtree.trees.engine_responses import sglang_generate_turn, vllm_completion_turn
from tests.models_util import assert_grads_close
from tests.run_util import finish, launch, read_metrics, tiny_overrides, xla_flags

LAYERS, K, EXPERTS = 2, 2, 4
SYSTEM = [1, 2, 3, 4, 5]
SEQ_LEN = 16  # the first group's tree (19 tree tokens) is cut into capacity parts


def _routes(rng: np.random.Generator, n: int) -> list:
    """n tokens' engine routing: per token, per MoE layer, K distinct experts."""
    return [[rng.choice(EXPERTS, K, replace=False).tolist() for _ in range(LAYERS)]
            for _ in range(n)]


def _turn(prompt, output, routed):
    turn = {"prompt_ids": prompt, "output_ids": output}
    if routed is not None:
        turn["routed_experts"] = routed
    return turn


def rollouts(seed: int, disagree: bool, system: list[int] = SYSTEM) -> list[dict]:
    """Two groups behind one system prompt. Group a: a two-turn rollout (A), a sibling first turn
    (B), a resampled second turn from A's state (C: A's first output is its prompt), a rollout
    that ends where A's first turn ends (D: a path ending at an internal node) and a duplicate of
    B (E). Group b: a two-turn rollout (F) and a resampled second turn (G) that carries no routed
    experts (its output keeps the trainer's routing). With `disagree`, D's engine routed two of
    A's first-turn tokens differently (the third: the same experts in another order)."""
    rng = np.random.default_rng(seed)
    o1, a_o1 = [10, 11, 12], _routes(rng, 3)
    a2_prompt = system + [6, 7] + o1 + [20, 21]
    d_o1 = [list(x) for x in a_o1]
    if disagree:
        d_o1[0], d_o1[2] = _routes(rng, 1)[0], _routes(rng, 1)[0]
        while {frozenset(e) for e in d_o1[0]} == {frozenset(e) for e in a_o1[0]}:
            d_o1[0] = _routes(rng, 1)[0]
        while {frozenset(e) for e in d_o1[2]} == {frozenset(e) for e in a_o1[2]}:
            d_o1[2] = _routes(rng, 1)[0]
        d_o1[1] = [layer[::-1] for layer in a_o1[1]]
    b_out = _routes(rng, 2)
    f2_prompt = system + [8, 9, 22, 23, 24, 25]
    return [
        {"group": "a", "turns": [_turn(system + [6, 7], o1, a_o1),
                                 _turn(a2_prompt, [13, 14], _routes(rng, 2))]},
        {"group": "a", "turns": [_turn(system + [6, 7], [15, 16], b_out)]},
        {"group": "a", "turns": [_turn(a2_prompt, [17, 18, 19], _routes(rng, 3))]},
        {"group": "a", "turns": [_turn(system + [6, 7], o1, d_o1)]},
        {"group": "a", "turns": [_turn(system + [6, 7], [15, 16], b_out)]},
        {"group": "b", "turns": [_turn(system + [8, 9], [22, 23, 24], _routes(rng, 3)),
                                 _turn(f2_prompt, [26, 27], _routes(rng, 2))]},
        {"group": "b", "turns": [_turn(f2_prompt, [28], None)]},
    ]


def write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def reference_paths(records: list[dict]):
    """Per path (one per rollout here: nothing drifts): tokens, loss mask and forced routing
    [len, L, K] (-1: the trainer's own), written from the records: output tokens take their
    turn's routing; any other token the routing of the first rollout (file order, within the
    group) that generated the same token after the same prefix, else -1."""
    paths = []
    for rec in records:
        last = rec["turns"][-1]
        tokens = last["prompt_ids"] + last["output_ids"]
        mask = np.zeros(len(tokens))
        routed = np.full((len(tokens), LAYERS, K), -1)
        for turn in rec["turns"]:
            start = len(turn["prompt_ids"])
            mask[start:start + len(turn["output_ids"])] = 1
            if "routed_experts" in turn:
                routed[start:start + len(turn["output_ids"])] = turn["routed_experts"]
        paths.append((rec["group"], tokens, mask, routed))
    return with_generated_routing(paths)


def with_generated_routing(paths: list[tuple]) -> list[tuple]:
    """(tokens, mask, routing) per path from (group, tokens, mask, own routing): a token the path
    did not generate with a routing of its own (mask 0, or -1) takes the routing of the first
    path (file order, within the group) that generated the same token after the same prefix,
    else keeps its own."""
    def sampled(mask, own, i):
        return mask[i] and own[i, 0, 0] >= 0

    generated: dict[tuple, np.ndarray] = {}
    for group, tokens, mask, own in paths:
        for i in range(len(tokens)):
            if sampled(mask, own, i):
                generated.setdefault((group, *tokens[:i + 1]), own[i])
    out = []
    for group, tokens, mask, own in paths:
        routed = own.copy()
        for i in range(len(tokens)):
            key = (group, *tokens[:i + 1])
            if not sampled(mask, own, i) and key in generated:
                routed[i] = generated[key]
        out.append((tokens, mask, routed))
    return out


def config(data: str, **extra):
    overrides = {
        "data.format": "traces", "data.seq_len": SEQ_LEN, "data.trees_per_step": 2,
        "data.micro_batches": 2, "model.architecture": "qwen3_moe",
        "model.num_hidden_layers": LAYERS, "model.num_experts": EXPERTS,
        "model.num_experts_per_tok": K, "model.moe_intermediate_size": 32,
        "objective.routing_replay": True, "run.steps": 1}
    overrides.update(extra)
    return load_config(None, tiny_overrides(data, **overrides))


@functools.cache
def _per_path_fn(arch, model_config, runtime):
    graphdef = nnx.split(nnx.eval_shape(lambda: create_model(arch, model_config, runtime)))[0]

    def loss(params, inputs, c):
        return -jnp.sum(c * token_logprobs(nnx.merge(graphdef, params), inputs))

    return jax.jit(jax.value_and_grad(loss))


def per_path(cfg, params, paths, replay: bool):
    """(loss, grads) of SFT (`seq_mean_token_mean`) with every path alone in its own row: plain
    causal attention, its own forced experts (`replay`) or the trainer's own routing (-1)."""
    k, length = len(paths), max(len(t) for t, _, _ in paths)
    tokens = np.zeros((k, length), np.int32)
    pos = np.zeros((k, length), np.int32)
    end = np.tile(np.arange(1, length + 1, dtype=np.int32), (k, 1))
    pred = np.full((k, length), -1, np.int32)
    node = np.full((k, length), -1, np.int32)
    valid = np.zeros((k, length), bool)
    routed = np.full((k, length, LAYERS, K), -1, np.int32)
    c = np.zeros((k, length), np.float32)
    for i, (t, m, r) in enumerate(paths):
        n = len(t)
        tokens[i, :n], pos[i, :n], end[i, :n], node[i, :n], valid[i, :n] = \
            t, np.arange(n), n, 0, True
        pred[i, 1:n] = np.arange(n - 1)
        if replay:
            routed[i, :n] = r
        c[i, 1:n] = m[1:] / (k * m[1:].sum())  # w_p m / (K_w n_p), every weight 1
    zeros = np.zeros((k, length), np.float32)
    inputs = DeviceBatch(tokens, pos, TreeMask(end), pred, node, valid,
                         np.ones((k, length), np.int32), LossCoefficients(*[zeros] * 6),
                         routed_experts=routed)
    fn = _per_path_fn(cfg.model.architecture, cfg.model.config, cfg.runtime)
    value, grads = fn(params, inputs, c)
    return float(value), grads


@functools.cache
def grad_fn(arch, model_config, runtime, objective):
    """The step's gradient function (`make_grad_fn`, the one the trainer runs per device) on
    the run's model outside any mesh."""
    graphdef = nnx.split(nnx.eval_shape(lambda: create_model(arch, model_config, runtime)))[0]
    return jax.jit(make_grad_fn(graphdef, objective))


def run_step(cfg):
    """The run's first step as `TrainingRun` builds it: its initial parameters, the element
    its pipeline yields, and the run's step on it (metrics, info)."""
    run = TrainingRun.build(cfg)
    try:
        state = run.trainer.initial_state()
        params = jax.tree_util.tree_map(np.asarray, state.params)
        element = next(run.iterator)
        run.iterator = iter([element])
        _, metrics, info, *_ = run.train_step(state, 0)
    finally:
        run.close()
    return params, element, metrics, info


def step_grads(cfg, params, inputs):
    """(loss, grads) of the step's objective on `inputs` at `params`."""
    loss, _, grads = grad_fn(cfg.model.architecture, cfg.model.config, cfg.runtime,
                             cfg.objective)(params, inputs)
    return float(loss), grads


def _norm(grads) -> float:
    return float(np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2)
                             for g in jax.tree_util.tree_leaves(grads))))


@pytest.mark.parametrize("extra", [
    {},  # tree mode: group a cut into capacity parts, 2 micro-batches
    # both groups merged at the system prompt into one tree, cut into capacity parts
    pytest.param({"data.share_prefixes": "across_groups", "data.micro_batches": 1},
                 marks=pytest.mark.slow),
    # every path alone: the per-path baseline with replay
    {"run.mode": "baseline"},
], ids=["tree", "across_groups", "baseline"])
def test_run_step_with_replay_equals_each_path_alone_with_its_forced_experts(tmp_path, extra):
    records = rollouts(seed=0, disagree=False)
    cfg = config(write(tmp_path / "t.jsonl", records), **extra)
    params, element, metrics, info = run_step(cfg)
    loss, grads = step_grads(cfg, params, element["inputs"])
    paths = reference_paths(records)
    want_loss, want_grads = per_path(cfg, params, paths, replay=True)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    assert_grads_close(grads, want_grads)
    # The run's own step saw the same gradients (its clipped AdamW update reports their norm).
    assert metrics["grad_norm"] == pytest.approx(_norm(want_grads), rel=1e-5)
    assert metrics["loss"] == pytest.approx(want_loss, rel=1e-5)
    routed = element["inputs"].routed_experts
    assert routed.shape == (*element["inputs"].shape, LAYERS, K) and (routed >= 0).any()
    assert float(info["routing_disagreement"]) == 0.0
    if not extra:  # group a's tree is larger than a row: its parts recompute their prefix
        assert int(info["n_computed_tokens"]) > int(info["n_tree_tokens"])
    if "data.share_prefixes" in extra:
        assert int(info["n_merge_saved_tokens"]) > 0

    # Not vacuous: the same step with every token on the trainer's own routing (-1) trains
    # other gradients, those of every path alone on its own routing. (A run without replay:
    # the context-parallel test below.)
    own = dataclasses.replace(element["inputs"], routed_experts=np.full_like(routed, -1))
    plain_loss, plain_grads = step_grads(cfg, params, own)
    own_loss, own_grads = per_path(cfg, params, paths, replay=False)
    assert plain_loss == pytest.approx(own_loss, rel=1e-5)
    assert_grads_close(plain_grads, own_grads)
    diff = _norm(jax.tree_util.tree_map(lambda a, b: np.asarray(a) - np.asarray(b), grads,
                                        plain_grads))
    assert diff > 1e-2 * _norm(want_grads)
    assert abs(plain_loss - loss) > 1e-4


def numpy_gauges(paths) -> tuple[float, float, int]:
    """(disagreement, coverage, disagreeing tokens) counted over token prefixes: a shared
    replayed token is a (group, prefix) that two or more paths route, disagreeing when their
    expert sets differ; coverage is over the (group, prefix)es some path trains."""
    routes: dict[tuple, list] = {}
    trained: set = set()
    for group, (tokens, mask, routed) in paths:
        for i in range(len(tokens)):
            key = (group, *tokens[:i + 1])
            if routed[i, 0, 0] >= 0:
                routes.setdefault(key, []).append(
                    tuple(tuple(sorted(layer)) for layer in routed[i].tolist()))
            if mask[i]:
                trained.add(key)
    shared = [r for r in routes.values() if len(r) >= 2]
    disagreeing = sum(len(set(r)) > 1 for r in shared)
    covered = sum(key in routes for key in trained)
    return disagreeing / len(shared), covered / len(trained), disagreeing


def test_the_step_logs_the_disagreement_and_coverage_counted_by_hand(tmp_path, capsys):
    """The metrics record's gauges against the count written here; the summary carries them."""
    records = rollouts(seed=1, disagree=True)
    metrics_path = tmp_path / "metrics.jsonl"
    cfg = config(write(tmp_path / "t.jsonl", records), **{"run.metrics_jsonl": metrics_path})
    paths = list(zip([r["group"] for r in records], reference_paths(records)))
    disagreement, coverage, n = numpy_gauges(paths)
    assert n == 2 and 0 < disagreement < 1 and 0 < coverage < 1  # D's two tokens; G unrouted
    train(cfg)
    record = read_metrics(metrics_path)[0]
    assert record["routing_disagreement"] == pytest.approx(disagreement, rel=1e-12)
    assert record["routing_coverage"] == pytest.approx(coverage, rel=1e-12)
    assert record["routing_disagreeing_tokens"] == n
    assert (f"routing replay: mean coverage {coverage:.1%} of trained tokens, max disagreement "
            f"{disagreement:.1%} of shared routed tokens") in capsys.readouterr().out


@pytest.mark.slow  # the end-of-run check compiles three more programs
def test_the_baseline_check_replays_and_shows_a_disagreement(tmp_path, capsys):
    """`run.compare_baseline` replays in both layouts: where the paths agree the tree's
    log-probs are the baseline's; where D's engine routed two of A's tokens otherwise, the tree
    routes them as A's (the first path's) and D alone as its own, and the check shows it."""
    for disagree, seed in ((False, 0), (True, 1)):
        cfg = config(write(tmp_path / f"t{seed}.jsonl", rollouts(seed, disagree)), **{
            "data.seq_len": 32, "run.compare_baseline": True, "run.timing_repeats": 1})
        train(cfg)
        diff = float(capsys.readouterr().out.split("over all path tokens = ")[1].split()[0])
        assert diff > 1e-4 if disagree else diff < 1e-5


# The engines' own encodings (tests/trees/test_engine_responses.py names the versions), on a
# model of three hidden layers whose middle one is dense: a row per hidden layer, the dense one
# mapped out through the model's layer map.
HIDDEN_SPARSE = [True, False, True]


def _engine_rows(rng: np.random.Generator, prefill: dict, tokens: list[int], start: int,
                 n_prompt: int) -> dict[int, np.ndarray]:
    """One engine call's routing rows by position, [hidden layers, K] each, from `start` to the
    last token but one: a prompt position as the prefill of its prefix routes it (one routing
    per prefix: `prefill`, shared by every call), an output position a routing of its own (the
    decode step's), the dense layer a placeholder."""
    rows = {}
    for p in range(start, len(tokens) - 1):
        if p < n_prompt:
            key = tuple(tokens[:p + 1])
            if key not in prefill:
                prefill[key] = np.array(_routes(rng, 1)[0])
            moe = prefill[key]
        else:
            moe = np.array(_routes(rng, 1)[0])
        rows[p] = np.stack([moe[0], np.full(K, 7), moe[1]])
    return rows


def _encoded_response(engine: str, prompt: list[int], output: list[int], rows: dict, start: int
                      ) -> dict:
    """The engine's response to one call, in its own shape and encoding of `rows`."""
    stack = np.stack([rows[p] for p in sorted(rows)])
    if engine == "vllm":
        buf = io.BytesIO()
        np.save(buf, stack.astype(np.uint16))
        return {"choices": [{
            "index": 0, "text": "", "finish_reason": "stop", "token_ids": output,
            "prompt_token_ids": prompt, "routed_experts": base64.b64encode(buf.getvalue()).decode(),
            "logprobs": {"tokens": [f"token_id:{t}" for t in output],
                         "token_logprobs": [-0.5] * len(output),
                         "top_logprobs": [None] * len(output), "text_offset": [0] * len(output)}}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(output),
                      "total_tokens": len(prompt) + len(output)}}
    return {"text": "", "output_ids": output, "meta_info": {
        "prompt_tokens": len(prompt), "completion_tokens": len(output),
        "finish_reason": {"type": "stop", "matched": output[-1]},
        "output_token_logprobs": [[-0.5, t, None] for t in output],
        "routed_experts": base64.b64encode(stack.astype(np.int32).tobytes()).decode()}}


def engine_rollouts(engine: str, seed: int) -> tuple[list[dict], list[list[tuple]]]:
    """Trace records adapted from engine responses, and per record its calls (prompt, output,
    rows by position) for the reference. Group a: a two-turn rollout whose second call asks for
    routing from the first call's last token on (`routed_experts_prompt_start` /
    `routed_experts_start_len`), a sibling first turn, and a resampled second turn from the
    first rollout's context, whose prompt repeats that rollout's outputs; group b: one turn."""
    rng = np.random.default_rng(seed)
    prefill: dict = {}
    t1_prompt = SYSTEM + [6, 7]
    t2_prompt = t1_prompt + [10, 11, 12, 20, 21]
    calls = [[("a", t1_prompt, [10, 11, 12], 0), ("a", t2_prompt, [13, 14], len(t1_prompt) + 2)],
             [("a", t1_prompt, [15, 16], 0)],
             [("a", t2_prompt, [17, 18, 19], 0)],
             [("b", SYSTEM + [8, 9], [22, 23, 24], 0)]]
    adapt = vllm_completion_turn if engine == "vllm" else sglang_generate_turn
    records, truths = [], []
    for rollout in calls:
        turns, truth = [], []
        for group, prompt, output, start in rollout:
            rows = _engine_rows(rng, prefill, prompt + output, start, len(prompt))
            turns.append(adapt(_encoded_response(engine, prompt, output, rows, start), prompt,
                               sparse_layers=HIDDEN_SPARSE, routed_start=start))
            truth.append((prompt, output, rows))
        records.append({"group": rollout[0][0], "turns": turns})
        truths.append(truth)
    return records, truths


def engine_reference_paths(records: list[dict], truths: list[list[tuple]]):
    """Per path (one per rollout: nothing drifts): tokens, loss mask and forced routing [len, L,
    K] of the MoE layers, written from the engine's rows: an output token the row of its own
    call (the decode step that fed it; the last sampled token of a call has none); any other
    token the row of the first rollout (file order, within the group) that generated the same
    token after the same prefix, else the first of its own calls whose prefill routes it, else
    -1."""
    moe = np.flatnonzero(HIDDEN_SPARSE)
    paths = []
    for rec, truth in zip(records, truths):
        prompt, output, _ = truth[-1]
        tokens = prompt + output
        mask = np.zeros(len(tokens))
        own = np.full((len(tokens), LAYERS, K), -1)
        for prompt, output, rows in truth:
            for p in range(len(prompt), len(prompt) + len(output)):
                mask[p] = 1
                if p in rows:
                    own[p] = rows[p][moe]
        for prompt, output, rows in truth:
            for p in range(len(prompt)):
                if own[p, 0, 0] < 0 and p in rows:
                    own[p] = rows[p][moe]
        paths.append((rec["group"], tokens, mask, own))
    return with_generated_routing(paths)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_routing_from_each_engine_s_encoding_replays_as_each_path_alone(tmp_path, engine):
    """Issue 48's acceptance: routed experts decoded from vLLM's `.npy` and SGLang's raw int32,
    prompt rows kept, the last sampled token on the trainer's routing and the dense layer mapped
    out, train a replay run whose first step equals every path alone with those experts."""
    records, truths = engine_rollouts(engine, seed=1)
    cfg = config(write(tmp_path / "t.jsonl", records),
                 **{"model.num_hidden_layers": 3, "model.mlp_only_layers": "[1]"})
    params, element, metrics, info = run_step(cfg)
    loss, grads = step_grads(cfg, params, element["inputs"])
    paths = engine_reference_paths(records, truths)
    assert any((r[:5] >= 0).all() for _, _, r in paths)  # the prompt replays its prefill
    want_loss, want_grads = per_path(cfg, params, paths, replay=True)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    assert_grads_close(grads, want_grads)
    assert metrics["loss"] == pytest.approx(want_loss, rel=1e-5)
    assert metrics["grad_norm"] == pytest.approx(_norm(want_grads), rel=1e-5)
    assert float(info["routing_disagreement"]) == 0.0
    # Not vacuous: the same paths on the trainer's own routing train other gradients.
    own_loss, _ = per_path(cfg, params, paths, replay=False)
    assert abs(own_loss - want_loss) > 1e-4


def test_runs_refuse_what_cannot_replay(tmp_path):
    records = rollouts(seed=0, disagree=False)
    data = write(tmp_path / "t.jsonl", records)
    with pytest.raises(ValueError, match=r"objective\.routing_replay: model\.architecture "
                                         r"'qwen3' has no MoE layers"):
        load_config(None, tiny_overrides(data, **{"data.format": "traces",
                                                  "objective.routing_replay": True}))
    with pytest.raises(ValueError, match=r"objective\.routing_replay: needs data\.format "
                                         r"'traces'"):
        config(data, **{"data.format": "groups"})
    with pytest.raises(ValueError, match=r"objective\.routing_replay: not available with "
                                         r"run\.mode=redundancy_free"):
        config(data, **{"run.mode": "redundancy_free"})
    bare = [{"group": r["group"], "turns": [{k: v for k, v in t.items() if k != "routed_experts"}
                                            for t in r["turns"]]} for r in records]
    with pytest.raises(ValueError, match=r"objective\.routing_replay: .*t2\.jsonl carries no "
                                         r"routed_experts"):
        load_training_trees(config(write(tmp_path / "t2.jsonl", bare)))
    with pytest.raises(ValueError, match=r"t\.jsonl:1: turns\[0\]\.routed_experts: 2 layers "
                                         r"per token, the model has 1 \(MoE layers\)"):
        load_training_trees(config(data, **{"model.mlp_only_layers": "[1]"}))
    with pytest.raises(ValueError, match=r"t\.jsonl:1: turns\[0\]\.routed_experts: 2 k per "
                                         r"token, the model has 3 \(experts per token\)"):
        load_training_trees(config(data, **{"model.num_experts_per_tok": 3}))
    bad = [dict(records[0], turns=[dict(records[0]["turns"][0], routed_experts=[
        [[0, 1], [1, 2]], [[0, 1], [3, 2]], [[0, 1], [1, 2]]]), records[0]["turns"][1]])]
    with pytest.raises(ValueError, match=r"t3\.jsonl:1: turns\[0\]\.routed_experts\[1\]: "
                                         r"expert ids \[\[0, 1\], \[3, 2\]\] not all \[0, 3\)"):
        load_training_trees(config(write(tmp_path / "t3.jsonl", bad),
                                   **{"model.num_experts": 3}))


def test_the_step_a_config_lowers_carries_the_routing(tmp_path):
    """`jtree.launch.lower_step` and `jtree.memory` trace the run's step on abstract inputs:
    with routing replay they carry every token's routed experts."""
    cfg = config(write(tmp_path / "t.jsonl", rollouts(seed=0, disagree=False)))
    trainer = Trainer.build(cfg)
    state, inputs = abstract_step_args(trainer, 1)
    assert inputs.routed_experts.shape == (*inputs.shape, LAYERS, K)
    assert "loss" in jax.eval_shape(trainer.step_fn, state, inputs)[1]


@pytest.mark.slow  # two runs, one on 2 forced host devices in a subprocess
def test_a_context_parallel_run_replays_like_one_device(tmp_path):
    """`mesh.context=2`: each device holds its slice of the rows' routed experts (the batch's
    per-token axis is split like the tokens'), so the steps' losses and gradient norms are the
    one-device run's; both differ from a run without replay."""
    # A long system prompt: the step's 183 tree tokens fill more than one slice.
    long_system = [30 + i % 30 for i in range(80)]
    data = write(tmp_path / "t.jsonl", rollouts(seed=0, disagree=False, system=long_system))
    # Weights at 10x the default scale, so that routing moves the loss well beyond 1e-5.
    base = {"data.seq_len": 256, "data.micro_batches": 1, "run.steps": 2,
            "model.initializer_range": 0.2, "optim.warmup_steps": 0}

    def overrides(name, **extra):
        cfg = tiny_overrides(data, **{
            "data.format": "traces", "data.trees_per_step": 2, "model.architecture": "qwen3_moe",
            "model.num_hidden_layers": LAYERS, "model.num_experts": EXPERTS,
            "model.num_experts_per_tok": K, "model.moe_intermediate_size": 32,
            "objective.routing_replay": True, **base, **extra})
        return [*cfg, f"run.metrics_jsonl={tmp_path / name}.jsonl"]

    log = tmp_path / "cp"
    code, stdout, err = finish(launch(overrides("cp", **{"mesh.context": 2}), log, {
        "XLA_FLAGS": xla_flags(2)}), log)
    assert code == 0, err[-3000:]
    assert "context=2" in stdout and "routing replay: mean coverage 93.8%" in stdout  # G: 1 of 16
    assert main(overrides("one")) == 0
    assert main(overrides("plain", **{"objective.routing_replay": False})) == 0
    got, want, plain = (read_metrics(tmp_path / f"{n}.jsonl") for n in ("cp", "one", "plain"))
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=1e-5), key
    assert abs(plain[0]["loss"] - want[0]["loss"]) > 1e-2
