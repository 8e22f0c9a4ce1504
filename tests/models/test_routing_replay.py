"""Routing replay (docs/rl.md, "Routing replay"): the tree step with the engine's routed experts
equals every path run alone through a dense reference MoE forced to that path's experts."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jtree.config.objective import Objective
from jtree.layout.baseline import linearize_baseline
from jtree.layout.linearize import linearize, unlinearize
from jtree.models.moe import RouterStats, SparseMoeBlock
from jtree.objectives.objective import objective_loss
from jtree.step.train_step import make_logprob_fn
from jtree.objectives.logprobs import token_logprobs
from jtree.trees.tree import TrajectoryTree
from tests.models_util import assert_grads_close, four_expert_config, perturbed, tiny_lm

# Several levels, a path ending inside another (path 1 inside path 0), a duplicate (3 == 2).
SEQS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5], [1, 2, 3, 9, 10, 11], [1, 2, 3, 9, 10, 11],
        [1, 2, 12, 13, 14, 15, 16], [1, 2, 12, 13, 17]]
PROMPT = 2  # the first tokens of every path carry no engine routing: the trainer routes them
SEQ_LEN = 32


def _engine_routing(tree: TrajectoryTree, layers: int, k: int, experts: int, seed: int
                    ) -> list[np.ndarray]:
    """Per path [len, layers, k]: one random expert set per tree token and layer (so paths agree
    on shared tokens), -1 on the first PROMPT tokens."""
    rng = np.random.default_rng(seed)
    per_token = np.stack([[rng.choice(experts, k, replace=False) for _ in range(layers)]
                          for _ in range(tree.n_tree_tokens)]).astype(np.int32)
    out = []
    for p in range(tree.n_paths):
        r = per_token[tree.path_token_index(p)].copy()
        r[:PROMPT] = -1
        out.append(r)
    return out


def _dense_forced_moe(forced: np.ndarray):
    """A `SparseMoeBlock.__call__` for the reference: every expert run densely, the output mixed
    by the router's probabilities over the forced experts (renormalized as `norm_topk_prob`
    says), the router's own argsort top-k where `forced` is -1. `forced` [rows, S, L, k] is read
    layer after layer in call order, so nothing of the replay path (the batch field, its
    per-layer slices, the router's replay) is used."""
    calls = []

    def call(self, x, replay=None):
        layer = len(calls) % forced.shape[2]
        calls.append(layer)
        n = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        k, e = forced.shape[-1], self.gate.weight.shape[0]
        probs = jax.nn.softmax(flat @ self.gate.weight[...].T, axis=-1)
        own = jnp.argsort(-probs, axis=-1)[:, :k]
        ids = jnp.asarray(forced[..., layer, :].reshape(-1, k))
        ids = jnp.where(ids[:, :1] >= 0, ids, own)
        w = probs * jax.nn.one_hot(ids, e).sum(axis=1)
        if self.gate.norm_topk_prob:
            w = w / w.sum(axis=-1, keepdims=True)
        gate, up = jnp.split(jnp.einsum("nh,eih->nei", flat, self.experts.gate_up_proj[...]), 2,
                             axis=-1)
        y = jnp.einsum("nei,ehi->neh", jax.nn.silu(gate) * up, self.experts.down_proj[...])
        out = jnp.einsum("ne,neh->nh", w, y)
        return out.reshape(*n, x.shape[-1]), RouterStats(probs, own)

    return call


def _loss_grads_logprobs(graphdef):
    """One compile: (params, inputs) -> ((SFT loss with the router loss, token log-probs),
    gradient of the loss)."""
    def f(params, inputs):
        model = nnx.merge(graphdef, params)
        return objective_loss(model, inputs, Objective())[0], token_logprobs(model, inputs)

    return jax.jit(jax.value_and_grad(f, has_aux=True))


@functools.lru_cache(maxsize=None)
def _two_moe_layer_model(norm: bool):
    """(config, graphdef, params): 2 MoE layers of 4 experts, top-2, weights perturbed; both
    `norm_topk_prob` settings share one set of weights (the flag is no parameter)."""
    cfg = four_expert_config("moe", mlp_only_layers=(), norm_topk_prob=norm)
    if not norm:
        graphdef, params = nnx.split(tiny_lm(cfg, 0))
        return cfg, graphdef, perturbed(params, scale=0.2)
    graphdef = nnx.split(nnx.eval_shape(lambda: tiny_lm(cfg, 0)))[0]
    return cfg, graphdef, _two_moe_layer_model(False)[2]


# Renormalized (Qwen3-30B-A3B's checkpoints) in the default suite; HF's default off is slow.
@pytest.mark.parametrize("norm", [pytest.param(False, marks=pytest.mark.slow), True])
def test_tree_replay_equals_each_path_alone_with_its_forced_experts(monkeypatch, norm):
    cfg, graphdef, params = _two_moe_layer_model(norm)
    tree = TrajectoryTree.from_sequences(SEQS)
    routing = _engine_routing(tree, 2, cfg.num_experts_per_tok, cfg.num_experts, seed=3)

    batch = linearize([tree], SEQ_LEN, routed_experts=[routing])
    assert batch.routing_disagreements == 0
    fn = _loss_grads_logprobs(graphdef)
    (loss_t, lp_t), g_t = fn(params, batch.inputs)
    # The same compile with every token on its own routing (-1 throughout).
    unrouted = dataclasses.replace(batch.inputs,
                                   routed_experts=np.full_like(batch.inputs.routed_experts, -1))
    own = fn(params, unrouted)[0][1]

    base = linearize_baseline([tree], SEQ_LEN)
    forced = np.full((*base.shape, 2, cfg.num_experts_per_tok), -1, np.int32)
    for r, row, off in zip(routing, base.layout.rows, base.layout.offsets):
        forced[row, off:off + len(r)] = r
    with monkeypatch.context() as m:
        m.setattr(SparseMoeBlock, "__call__", _dense_forced_moe(forced))
        (loss_b, lp_b), g_b = _loss_grads_logprobs(graphdef)(params, base.inputs)

    tree_paths = unlinearize(batch, np.asarray(lp_t))[0]
    base_paths = [p[0] for p in unlinearize(base, np.asarray(lp_b))]
    for t, b in zip(tree_paths, base_paths):
        np.testing.assert_allclose(t, b, rtol=1e-5, atol=1e-5)
    assert float(loss_t) == pytest.approx(float(loss_b), rel=1e-5)
    assert_grads_close(g_t, g_b)
    # Not vacuous: the replayed experts change the log-probs of the trainer's own routing.
    assert np.max(np.abs(np.asarray(lp_t) - np.asarray(own))) > 1e-3


def test_routed_experts_of_another_shape_are_refused():
    cfg = four_expert_config("moe")  # one MoE layer
    model = tiny_lm(cfg, 0)
    tree = TrajectoryTree.from_sequences(SEQS[:2])
    routing = _engine_routing(tree, 2, cfg.num_experts_per_tok, cfg.num_experts, seed=0)
    batch = linearize([tree], SEQ_LEN, routed_experts=[routing])
    with pytest.raises(ValueError, match=r"inputs\.routed_experts: \[\.\.\., S, 2, 2\], but the "
                                         r"model has 1 MoE layers of top-2 routing"):
        model(batch.inputs)


def test_scanned_layers_replay_as_unscanned():
    cfg = four_expert_config("moe", mlp_only_layers=())
    tree = TrajectoryTree.from_sequences(SEQS[:3])
    routing = _engine_routing(tree, 2, cfg.num_experts_per_tok, cfg.num_experts, seed=1)
    inputs = linearize([tree], SEQ_LEN, routed_experts=[routing]).inputs
    lps = [np.asarray(jax.jit(make_logprob_fn(g))(p, inputs))
           for g, p in (nnx.split(tiny_lm(cfg, 0, scan_layers=scan)) for scan in (False, True))]
    np.testing.assert_allclose(lps[1], lps[0], rtol=1e-5, atol=1e-5)
