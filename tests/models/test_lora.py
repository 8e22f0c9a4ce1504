"""LoRA (`model.lora`): a step changes the adapters and nothing else, keeps optimizer state for the
adapters only, the tree step equals the per-path step (Qwen3, and gpt-oss with adapters on its
windowed attention), the gradients a redundancy-free step pulls back through the merge are the
adapters', a bf16 base merges as stored, and a target that matches no kernel fails naming its
key."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jtree.layout.baseline import linearize_baseline
from jtree.layout.batch import stack
from jtree.config import load_config
from jtree.launch.train import main
from jtree.layout.linearize import linearize
from jtree.config.model import LoraConfig
from jtree.models.lora import attach, model_params, trainable, trainable_grads, with_trainable
from jtree.training.trainer import Trainer
from jtree.config.objective import Objective, OptimConfig
from jtree.step.optimizer import TrainState, make_optimizer
from jtree.step.train_step import make_grad_fn, make_train_step
from jtree.step.batches import stack_microbatches
from tests.models_util import (
    assert_grads_close, off_policy_ppo_inputs, tiny_gpt_oss_config, tiny_lm, tiny_model,
)
from tests.run_util import finish, launch, read_metrics, tiny_overrides, xla_flags
from tests.strategies import seeded_forests

TARGETS = ("self_attn/(q|o)_proj", "mlp/down_proj", "lm_head")
# gpt-oss: its attention (biases, sinks, sliding windows) and the head; the experts are fused.
GPT_OSS_TARGETS = ("self_attn/(q|k|v|o)_proj", "lm_head")


def lora_params(seed: int = 0, arch: str = "qwen3", **cfg):
    """(graphdef, LoraParams) of the tiny model (Qwen3, or gpt-oss) with adapters on `TARGETS`
    (`GPT_OSS_TARGETS`); B drawn at random so the adapters change the model."""
    if arch == "gpt_oss":
        graphdef, params = nnx.split(tiny_lm(tiny_gpt_oss_config(), seed))
    else:
        graphdef, params = tiny_model(seed=seed)
    targets = GPT_OSS_TARGETS if arch == "gpt_oss" else TARGETS
    lora = attach(params, LoraConfig(rank=2, alpha=4.0, targets=targets, **cfg),
                  jax.random.key(seed))
    keys = iter(jax.random.split(jax.random.key(seed + 1), 64))
    adapters = jax.tree_util.tree_map_with_path(
        lambda p, x: 0.1 * jax.random.normal(next(keys), x.shape, x.dtype)
        if p[-1].key == "lora_b" else x, lora.adapters)
    return graphdef, with_trainable(lora, adapters)


def test_a_step_changes_only_the_adapters():
    graphdef, params = tiny_model(seed=0)
    lora = attach(params, LoraConfig(rank=2, alpha=4.0, targets=TARGETS), jax.random.key(0))
    opt = make_optimizer(OptimConfig(learning_rate=1e-2, warmup_steps=1, decay_steps=10))
    state = TrainState(lora, opt.init(trainable(lora)), jnp.zeros((), jnp.int32))
    n_adapters = len(jax.tree_util.tree_leaves(lora.adapters))
    assert n_adapters == 2 * 2 * 3 + 2  # q, o, down in 2 layers and the head: A and B each
    # AdamW's moments are the adapters' shape: nothing for the frozen base.
    for moment in ("mu", "nu"):
        assert (jax.tree_util.tree_structure(optax.tree.get(state.opt_state, moment))
                == jax.tree_util.tree_structure(lora.adapters))
    step = jax.jit(make_train_step(graphdef, opt, Objective()))
    inputs = stack_microbatches([linearize(seeded_forests(3, seed=1, max_nodes=6), 64)])
    states = [state]
    for _ in range(2):  # warmup_steps=1: the first step already runs at the peak rate
        states.append(step(states[-1], inputs)[0])
    for before, after in zip(jax.tree_util.tree_leaves(lora.base),
                             jax.tree_util.tree_leaves(states[-1].params.base), strict=True):
        np.testing.assert_array_equal(np.asarray(before), np.asarray(after))
    adapters = [jax.tree_util.tree_leaves_with_path(s.params.adapters) for s in states]
    for (path, x0), (_, x1), (_, x2) in zip(*adapters, strict=True):
        where = jax.tree_util.keystr(path)
        # B starts at zero, so A's gradient is zero until B has moved: B moves on the first
        # step, A on the second.
        if path[-1].key == "lora_b":
            assert not np.array_equal(x0, x1), where
        else:
            np.testing.assert_array_equal(x0, x1)
            assert not np.array_equal(x1, x2), where


@pytest.mark.parametrize("arch", ["qwen3", "gpt_oss"])
def test_lora_tree_step_equals_per_path_step(arch):
    """PPO (old log-probs off the policy, so the clip acts) on the merged model: tree loss and
    adapter gradients equal the per-path ones."""
    graphdef, lora = lora_params(seed=2, arch=arch)
    trees = seeded_forests(4, seed=3, max_nodes=6)
    tree = linearize(trees, 64, normalization="token_mean")
    base = linearize_baseline(trees, 64, normalization="token_mean")
    tree_in, base_in = off_policy_ppo_inputs(lora, graphdef, tree, base, seed=4)
    grad_fn = jax.jit(make_grad_fn(graphdef, Objective(kind="ppo", normalization="token_mean")))
    loss_t, _, g_t = grad_fn(lora, stack([tree_in]))
    loss_b, _, g_b = grad_fn(lora, stack([base_in]))
    assert jax.tree_util.tree_structure(g_t) == jax.tree_util.tree_structure(lora.adapters)
    assert float(loss_t) == pytest.approx(float(loss_b), rel=1e-5, abs=1e-7)
    assert_grads_close(g_t, g_b)
    # What a redundancy-free step does: gradients of the merged model's parameters, pulled back
    # through the merge to the adapters.
    _, _, g_model = grad_fn(model_params(lora), stack([tree_in]))
    assert_grads_close(jax.jit(trainable_grads)(lora, g_model), g_t)


def test_bf16_base_merges_as_stored():
    graphdef, params = tiny_model(seed=0)
    lora = attach(params, LoraConfig(rank=2, targets=("q_proj",), base_dtype="bfloat16"),
                  jax.random.key(0))
    assert {x.dtype for x in jax.tree_util.tree_leaves(lora.base)} == {jnp.dtype("bfloat16")}
    merged = model_params(lora)
    for a, b in zip(jax.tree_util.tree_leaves(merged), jax.tree_util.tree_leaves(params)):
        assert a.dtype == b.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a),  # B = 0: the base, rounded to bf16
                                      np.asarray(b.astype(jnp.bfloat16).astype(jnp.float32)))


def test_a_target_matching_no_kernel_fails_naming_its_key():
    with pytest.raises(ValueError, match=r"model\.lora\.targets\[1\]: 'qproj' matches no linear "
                                         r"kernel \(kernels: model/.*/kernel"):
        Trainer.build(load_config("configs/tiny.yaml", [
            "model.lora={rank: 2, targets: [v_proj, qproj]}"]))
    # Norm weights and embeddings are not linear kernels.
    with pytest.raises(ValueError, match=r"targets\[0\]: 'input_layernorm' matches no linear"):
        attach(tiny_model()[1], LoraConfig(targets=("input_layernorm",)), jax.random.key(0))


@pytest.mark.slow
def test_lora_runs_train_alike_in_tree_baseline_and_redundancy_free_mode(few_groups_file,
                                                                         tmp_path):
    """A LoRA run (bf16 base) trains the same adapters in every layout: its losses after the
    adapters moved agree between tree, per-path baseline and redundancy-free parts (the trees
    split over cached prefixes)."""
    overrides = tiny_overrides(few_groups_file, **{
        "run.steps": 3, "data.trees_per_step": 2, "data.micro_batches": 1,
        "optim.warmup_steps": 0, "run.capacity": 40, "run.prefix_backward": "residuals",
        "model.lora": "{rank: 2, alpha: 4, targets: [proj, lm_head], base_dtype: bfloat16}",
        "model.tie_word_embeddings": False})
    losses = {}
    for mode in ("tree", "baseline", "redundancy_free"):
        out = tmp_path / f"{mode}.jsonl"
        assert main(["--config", "configs/tiny.yaml", *overrides, f"run.mode={mode}",
                     f"run.metrics_jsonl={out}"]) == 0
        losses[mode] = [r["loss"] for r in read_metrics(out)]
    assert losses["tree"][-1] < losses["tree"][0]
    for mode in ("baseline", "redundancy_free"):
        assert losses[mode] == pytest.approx(losses["tree"], rel=1e-5), mode


@pytest.mark.slow
def test_lora_run_on_an_fsdp_mesh_trains_like_one_device(few_groups_file, tmp_path):
    """`jtree.launch.train` with LoRA on mesh.fsdp=2 (two forced host devices): the base stored
    split over fsdp and gathered per layer, the adapters laid out by `lora_specs`; its losses
    equal the one-device run's in tree and baseline mode."""
    overrides = tiny_overrides(few_groups_file, **{
        "run.steps": 3, "data.trees_per_step": 2, "optim.warmup_steps": 0,
        "model.lora": "{rank: 2, alpha: 4, targets: [proj, lm_head]}",
        "model.tie_word_embeddings": False})
    one = tmp_path / "one.jsonl"
    assert main(["--config", "configs/tiny.yaml", *overrides, f"run.metrics_jsonl={one}"]) == 0
    want = [r["loss"] for r in read_metrics(one)]
    assert want[-1] < want[0]
    env = {"XLA_FLAGS": xla_flags(2)}
    for mode in ("tree", "baseline"):
        out, log = tmp_path / f"fsdp_{mode}.jsonl", tmp_path / f"fsdp_{mode}"
        code, stdout, err = finish(launch(["--config", "configs/tiny.yaml", *overrides,
                                           "mesh.data=1", "mesh.fsdp=2", f"run.mode={mode}",
                                           f"run.metrics_jsonl={out}"], log, env), log)
        assert code == 0, err[-3000:]
        assert "mesh data=1 x fsdp=2 x model=1" in stdout
        assert [r["loss"] for r in read_metrics(out)] == pytest.approx(want, rel=1e-5), mode
