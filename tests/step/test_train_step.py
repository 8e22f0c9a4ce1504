import jax
import numpy as np
import optax
import pytest

from jtree.config.objective import Objective, OptimConfig
from jtree.layout.coefficients import batch_normalizer
from jtree.layout.linearize import linearize
from jtree.step.batches import needs_old_logprobs, stack_microbatches
from jtree.step.optimizer import (
    TrainState,
    clip_by_global_norm,
    make_optimizer,
    make_schedule,
)
from jtree.step.train_step import make_grad_fn, make_train_step
from jtree.trees.tree import TrajectoryTree
from tests.models_util import rel_l2, tiny_model, tiny_runtime
from tests.strategies import explicit_tree, random_forest


def _trees(n, seed=0):
    rng = np.random.default_rng(seed)
    return [explicit_tree(random_forest(rng, max_nodes=6)) for _ in range(n)]


def test_micro_batch_accumulation_equals_full_batch():
    graphdef, params = tiny_model(seed=2)
    trees = _trees(4)
    norm = batch_normalizer(trees, "token_mean")
    full = linearize(trees, 64, normalization="token_mean", n_rows=4)
    micro = [linearize(trees[:2], 64, normalization="token_mean", normalizer=norm, n_rows=2),
             linearize(trees[2:], 64, normalization="token_mean", normalizer=norm, n_rows=2)]
    grad_fn = jax.jit(make_grad_fn(graphdef, Objective(kind="sft", normalization="token_mean")))
    loss_f, _, g_f = grad_fn(params, stack_microbatches([full]))
    loss_m, _, g_m = grad_fn(params, stack_microbatches(micro))
    assert float(loss_m) == pytest.approx(float(loss_f), rel=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(g_m), jax.tree_util.tree_leaves(g_f)):
        assert rel_l2(a, b) <= 1e-5


def test_train_step_reduces_loss():
    graphdef, params = tiny_model(seed=0)
    opt = make_optimizer(OptimConfig(learning_rate=1e-2, warmup_steps=1, decay_steps=20))
    step = jax.jit(make_train_step(graphdef, opt, Objective()))
    state = TrainState(params, opt.init(params), np.int32(0))
    inputs = stack_microbatches([linearize(_trees(3, seed=1), 64)])
    losses = []
    for _ in range(8):
        state, metrics = step(state, inputs)
        losses.append(float(metrics["loss"]))
    assert int(state.step) == 8 and np.isfinite(float(metrics["grad_norm"]))
    assert losses[-1] < 0.8 * losses[0]


@pytest.mark.parametrize("warmup", [0, 1, 4])
def test_schedule_warms_up_from_the_first_step_then_decays(warmup):
    """Linear warmup to the peak that trains from step 0, cosine decay to peak * min_lr_ratio at
    `decay_steps`, held after: the formula written out here, at step 0, the last warmup step,
    the first decay step, the middle of the decay, its end and past it."""
    cfg = OptimConfig(learning_rate=2e-3, warmup_steps=warmup, decay_steps=12, min_lr_ratio=0.1)
    peak, floor = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio

    def want(step: int) -> float:
        if step < warmup:
            return peak * (step + 1) / warmup
        progress = min(step - warmup, 12 - warmup) / (12 - warmup)
        return floor + (peak - floor) * 0.5 * (1 + np.cos(np.pi * progress))

    schedule = make_schedule(cfg)
    steps = sorted({0, max(warmup - 1, 0), warmup, (warmup + 12) // 2, 12, 20})
    got = [float(schedule(step)) for step in steps]
    np.testing.assert_allclose(got, [want(step) for step in steps], rtol=1e-6)
    assert got[0] == pytest.approx(peak / warmup if warmup else peak, rel=1e-6) and got[0] > 0


def test_clip_by_global_norm_matches_optax():
    """The scalar-factor clip gives optax's clipped updates (to rounding) and the same state;
    below the threshold it returns the updates unchanged, bit for bit."""
    rng = np.random.default_rng(0)
    grads = {"a": rng.normal(size=(7, 5)).astype(np.float32),
             "b": [rng.normal(size=(3,)).astype(np.float32)]}
    norm = float(optax.tree.norm(grads))
    for max_norm in (0.25 * norm, 4.0 * norm):
        ours = clip_by_global_norm(max_norm)
        ref = optax.clip_by_global_norm(max_norm)
        assert ours.init(grads) == ref.init(grads)
        got, _ = jax.jit(ours.update)(grads, ours.init(grads))
        want, _ = jax.jit(ref.update)(grads, ref.init(grads))
        for g, w, x in zip(*(jax.tree_util.tree_leaves(t) for t in (got, want, grads))):
            if max_norm > norm:
                np.testing.assert_array_equal(g, x)
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=0)
        assert float(optax.tree.norm(got)) == pytest.approx(min(norm, max_norm), rel=1e-6)


def test_old_logprob_policy():
    consistent = TrajectoryTree.from_sequences([[1, 2, 3], [1, 2, 4]],
                                               old_logprobs=[[0, -1, -2], [0, -1, -3]])
    drifting = TrajectoryTree.from_sequences([[1, 2, 3], [1, 2, 4]],
                                             old_logprobs=[[0, -1, -2], [0, -1.5, -3]])
    missing = TrajectoryTree.from_sequences([[1, 2, 3]])
    ppo, sft = Objective(kind="ppo"), Objective(kind="sft")
    assert not needs_old_logprobs(linearize([consistent], 8), ppo)
    assert needs_old_logprobs(linearize([drifting], 8), ppo)
    assert needs_old_logprobs(linearize([missing], 8), ppo)
    assert not needs_old_logprobs(linearize([missing], 8), sft)


def test_bf16_compute_keeps_fp32_master_weights():
    """bf16 activations and matmuls, fp32 parameters and optimizer state; the loss deviates from
    fp32 by rounding only (reported here, not asserted to be bit-equal)."""
    inputs = stack_microbatches([linearize(_trees(3, seed=5), 64)])
    opt = make_optimizer(OptimConfig(learning_rate=1e-2, warmup_steps=0, decay_steps=10))
    losses = {}
    for dtype in ("float32", "bfloat16"):
        graphdef, params = tiny_model(seed=0, runtime=tiny_runtime(dtype=dtype))
        state = TrainState(params, opt.init(params), np.int32(0))
        state, metrics = jax.jit(make_train_step(graphdef, opt, Objective()))(state, inputs)
        losses[dtype] = float(metrics["loss"])
        assert {x.dtype for x in jax.tree_util.tree_leaves(state.params)} == {np.dtype("float32")}
    assert losses["bfloat16"] == pytest.approx(losses["float32"], rel=2e-2)
