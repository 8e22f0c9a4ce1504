"""`objective.temperature` (docs/rl.md, "Sampling temperature"): the run's PPO step at T = 0.7
against a dense per-path JAX computation written here, which runs every path alone, forms its
logits from the model's hidden states and divides them by T itself; the engine log-prob gap the
step reports on on-policy data; SFT's refusal."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jtree.config.objective import Objective
from jtree.config.run import DataConfig
from jtree.step.train_step import make_grad_fn, make_logprob_fn
from jtree.training.step_builders import step_builder, step_indices
from jtree.trees.tree import TrajectoryTree
from tests.models_util import assert_grads_close, path_inputs, perturbed, tiny_model
from tests.strategies import random_forest

T = 0.7
CLIP = 0.2
ENTROPY = 0.05
CHUNK = 8  # several log-prob chunks per micro-batch
OBJECTIVE = Objective(kind="ppo", clip_low=CLIP, clip_high=CLIP, entropy_coef=ENTROPY,
                      logprob_chunk=CHUNK, temperature=T)
SEQ_LEN = 32


@functools.cache
def model():
    """(graphdef, params, old params): the step's parameters and those pi_old comes from."""
    graphdef, params = tiny_model(num_hidden_layers=1)
    params = perturbed(params)
    return graphdef, params, perturbed(params, scale=0.02, seed=7)


def make_trees(rng: np.random.Generator) -> list[TrajectoryTree]:
    """Random multi-level forests with per-path loss masks and advantages."""
    trees: list[TrajectoryTree] = []
    while len(trees) < 4:
        shape = TrajectoryTree.from_nodes(**random_forest(rng, with_rl=False, max_nodes=10,
                                                          max_seg=6, extra_paths=3))
        if shape.n_paths < 2 or shape.n_tree_tokens < 8 or shape.path_lengths.max() > SEQ_LEN:
            continue
        lengths = [len(shape.path_tokens(p)) for p in range(shape.n_paths)]
        trees.append(TrajectoryTree.from_nodes(
            shape.parents.tolist(), list(shape.segments), path_nodes=shape.path_nodes.tolist(),
            loss_masks=[(rng.random(n) < 0.8).astype(int) for n in lengths],
            advantages=[float(rng.normal()) for _ in lengths]))
    return trees


@functools.partial(jax.jit, static_argnums=0)
def tempered(graphdef, params, inputs) -> tuple[jax.Array, jax.Array]:
    """log softmax(logits / T) of each path's next token and the entropy of that distribution,
    [paths, L] (0 at position 0), from logits formed here: hidden @ output embedding."""
    m = nnx.merge(graphdef, params)
    logits = jnp.einsum("kld,dv->klv", m(inputs).hidden, m.output_embedding(),
                        preferred_element_type=jnp.float32)[:, :-1] / T
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, inputs.tokens[:, 1:, None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return jnp.pad(picked, ((0, 0), (1, 0))), jnp.pad(entropy, ((0, 0), (1, 0)))


def reference(trees: list[TrajectoryTree]):
    """Per-path PPO loss (clipped surrogate minus the entropy bonus) and its gradients at T,
    with c[p,t] = m[p,t] / (paths * trained tokens of p) (`seq_mean_token_mean`)."""
    graphdef, params, old_params = model()
    flat = [(t, p) for t in trees for p in range(t.n_paths)]
    tokens = [t.path_tokens(p) for t, p in flat]
    length = max(map(len, tokens))
    inputs = path_inputs(tokens, length)
    m = np.zeros((len(flat), length))
    a = np.zeros((len(flat), length))
    for i, (t, p) in enumerate(flat):
        m[i, 1:len(tokens[i])] = t.loss_masks[p][1:]
        a[i, :len(tokens[i])] = t.advantages[p]
    c = m / (len(flat) * np.maximum(m.sum(1, keepdims=True), 1))
    m, c, a = (jnp.asarray(x, jnp.float32) for x in (m, c, a))
    pi_old = tempered(graphdef, old_params, inputs)[0]

    def loss(p):
        logp, entropy = tempered(graphdef, p, inputs)
        rho = jnp.exp(jnp.where(m > 0, logp - pi_old, 0.0))
        clipped = jnp.clip(rho, 1 - CLIP, 1 + CLIP)
        return -jnp.sum(c * jnp.minimum(rho * a, clipped * a)) - ENTROPY * jnp.sum(c * entropy)

    value, grads = jax.value_and_grad(loss)(params)
    return float(value), grads


@functools.cache
def logprob_fn(graphdef, temperature: float):
    return jax.jit(make_logprob_fn(graphdef, CHUNK, temperature))


@functools.cache
def grad_fn(graphdef, objective: Objective):
    return jax.jit(make_grad_fn(graphdef, objective))


def run_step(trees: list[TrajectoryTree], mode: str, old_params, old_temperature: float = T):
    """The run's step on `trees` (2 micro-batches): old log-probs from a forward on the step's
    batch under `old_params` at `old_temperature` (what an engine reports), then the step's
    gradient function at `OBJECTIVE.temperature`."""
    graphdef = model()[0]
    data = DataConfig(seq_len=SEQ_LEN, trees_per_step=len(trees), micro_batches=2)
    builder = step_builder(trees, data, mode, normalization=OBJECTIVE.normalization,
                           n_shards=1, shards=(0,), steps=1)
    inputs = builder(step_indices(len(trees), len(trees), 0)[0])["inputs"]
    micro = [jax.tree_util.tree_map(lambda x, i=i: x[i], inputs) for i in range(inputs.shape[0])]
    old = jnp.stack([logprob_fn(graphdef, old_temperature)(old_params, mb) for mb in micro])
    loss, metrics, grads = grad_fn(graphdef, OBJECTIVE)(
        model()[1], inputs.with_coefficients(old_logprobs=old))
    return float(loss), {k: float(v) for k, v in metrics.items()}, grads


def test_ppo_step_at_a_temperature_equals_per_path_reference():
    """Loss and every gradient of the run's PPO step at T = 0.7 (tree and baseline modes, old
    log-probs from the trainer's forward at T) equal the per-path reference; the clip acts."""
    trees = make_trees(np.random.default_rng(5))
    want_loss, want_grads = reference(trees)
    for mode in ("tree", "baseline"):
        loss, metrics, grads = run_step(trees, mode, model()[2])
        assert loss == pytest.approx(want_loss, rel=1e-5, abs=1e-6), mode
        assert_grads_close(grads, want_grads)
        assert 0 < metrics["clip_frac"] < 1


def test_engine_logprob_gap_shows_a_mismatched_temperature():
    """On on-policy data (old log-probs from the step's own parameters) the gap is float noise
    when the engine's temperature is the objective's, and large when the engine reported T = 1
    log-probs (another temperature, or raw log-probs instead of processed ones)."""
    trees = make_trees(np.random.default_rng(5))
    params = model()[1]
    matched = run_step(trees, "tree", params)[1]["engine_logprob_gap"]
    raw = run_step(trees, "tree", params, old_temperature=1.0)[1]["engine_logprob_gap"]
    assert matched < 1e-5
    assert raw > 0.05


def test_sft_refuses_a_temperature():
    with pytest.raises(ValueError, match="temperature: 0.7 tempers"):
        Objective(kind="sft", temperature=0.7)
    with pytest.raises(ValueError, match="temperature"):
        Objective(kind="ppo", temperature=0.0)
