"""Run one redundancy-free train step on meshes of 8 forced host devices and compare it with the
single-device redundancy-free step and the tree step.

Run in a subprocess (`tests/partitioning/test_redundancy_free_mesh.py`): XLA_FLAGS must be set before jax creates
its CPU backend. A case is `model:objective:DxFxM` (model `dense`, `moe` or `next` of
`tests.mesh_worker.case_model`, or `dense_lora`: `dense` training LoRA adapters; data x fsdp x
model). Prints one JSON line per case with the largest relative differences of the mesh step to
both references (loss, every gradient, the updated parameters), the gap between the two
references, the result farthest past its error model against the tree step in float64 (loss and
gradients: `tests.models_util.worst_rounding`, the mesh step measured by the single-device
redundancy-free one and that one by the tree step; updates: `tests.mesh_worker.update_rounding`),
and the lockstep schedule's shape
(steps, calls per shard, buffer levels). The references are computed once per model and
objective, the single-device redundancy-free one on the mesh's program
(`build_program(..., uniform=True)`); the same compile flags as `tests/mesh_worker.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jtree.layout.linearize import linearize  # noqa: E402
from jtree.models import create_model
from jtree.config.model import LoraConfig
from jtree.models.lora import attach, lora_specs, model_params, trainable, trainable_grads
from jtree.partitioning.redundancy_free.executor import RedundancyFreeStep  # noqa: E402
from jtree.partitioning.redundancy_free.layout import build_program
from jtree.partitioning.redundancy_free.mesh_executor import MeshRedundancyFreeStep  # noqa: E402
from jtree.config.run import MeshConfig
from jtree.parallel.sharding import make_mesh, named, param_rules, param_specs
from jtree.config.objective import Objective, OptimConfig
from jtree.config.runtime import RuntimeConfig
from jtree.step.optimizer import TrainState, apply_gradients, make_optimizer
from jtree.step.train_step import make_grad_fn, sharded_graphdef
from jtree.step.batches import stack_microbatches
from tests.mesh_worker import as_float64, case_model, update_rounding  # noqa: E402
from tests.models_util import perturbed, rel_l2, worst_rounding  # noqa: E402
from tests.strategies import multi_part_trees  # noqa: E402

ROW, CAPACITY, GDN_CHUNK = 16, 5, 3
OPTIM = OptimConfig(learning_rate=1e-3, warmup_steps=0, decay_steps=10)
LORA = LoraConfig(rank=2, alpha=4.0, targets=("self_attn/(q|k|o)_proj", "mlp", "lm_head"))
OBJECTIVES = {
    "sft": Objective(kind="sft", normalization="seq_mean_token_mean"),
    "ppo": Objective(kind="ppo", normalization="token_mean", clip_low=0.1, clip_high=0.1,
                     kl_coef=0.05),
}


def case_trees() -> list:
    """Four trees that need several parts at capacity 5 (part trees of two to four levels) and
    two small ones that fit whole; old log-probs consistent on shared tokens (PPO)."""
    return multi_part_trees(seed=7) + multi_part_trees(seed=8)


def reference(model_kind: str, objective_name: str, opt) -> dict[str, Any]:
    """The single-device redundancy-free step and the tree step on the case's trees."""
    arch, cfg, runtime = case_model(model_kind)
    model = create_model(arch, cfg, runtime, seed=3)
    graphdef, params = nnx.split(model)
    if model_kind == "dense_lora":  # as the trainer runs it: LoRA on a base model
        params = attach(params, LORA, jax.random.key(0))
    if model_kind != "dense":
        params = perturbed(params, scale=0.2)
    objective = OBJECTIVES[objective_name]
    chunk = GDN_CHUNK if cfg.decoder().needs_gdn_tables else None
    trees = case_trees()
    # The mesh's program (rows of one shape: each jitted piece of the single-device executor
    # compiles once).
    program = build_program(trees, CAPACITY, seq_len=ROW, uniform=True,
                            normalization=objective.normalization, gdn_chunk_size=chunk)
    state = TrainState(params, opt.init(trainable(params)), np.int32(0))
    update = jax.jit(apply_gradients(opt))
    rfree = RedundancyFreeStep(graphdef, objective, prefix_backward="auto")
    # With LoRA the single-device executor differentiates the merged model (the trainer's
    # pull-back); the mesh executor differentiates the adapters directly.
    loss, metrics, grads = rfree(model_params(params), program)
    grads = trainable_grads(params, grads)
    rfree_state = update(state, loss, metrics, grads)[0]
    full = linearize(trees, 128, normalization=objective.normalization, gdn_chunk_size=chunk,
                     gdn_chunks=128 if chunk else None)
    t_loss, t_metrics, t_grads = jax.jit(make_grad_fn(graphdef, objective))(
        params, stack_microbatches([full]))
    tree_state = update(state, t_loss, t_metrics, t_grads)[0]
    exact = exact_tree_step(arch, cfg, runtime, params, objective, full, opt)
    return dict(cfg=cfg, model=model, params=params, objective=objective, program=program,
                state=state, update=update, tokens=sum(t.n_tree_tokens for t in trees),
                rfree=(loss, grads, rfree_state), tree=(t_loss, t_grads, tree_state),
                exact=exact)


def exact_tree_step(arch: str, cfg: Any, runtime: RuntimeConfig, params: Any,
                    objective: Objective, full: Any, opt) -> tuple[Any, Any, TrainState, Any]:
    """(loss, gradients, next TrainState, initial parameters) of the tree step in float64 from
    the same parameters: the exact values the float32 steps are measured against (the float64
    redundancy-free and tree steps agree to 4e-15). The `reference` attention; numpy arrays."""
    with jax.enable_x64(True):
        runtime = dataclasses.replace(runtime, dtype="float64", param_dtype="float64",
                                      attention_impl="reference")
        graphdef = nnx.split(create_model(arch, cfg, runtime, seed=3))[0]
        params = as_float64(params)
        loss, metrics, grads = jax.jit(make_grad_fn(graphdef, objective))(
            params, stack_microbatches([full]))
        state = TrainState(params, opt.init(trainable(params)), np.int32(0))
        new_state = jax.jit(apply_gradients(opt))(state, loss, metrics, grads)[0]
        return jax.tree_util.tree_map(np.asarray, (loss, grads, new_state)) + (params,)


def compare_on_mesh(case: str, ref: dict[str, Any]) -> dict[str, Any]:
    data, fsdp, model_size = (int(x) for x in case.split(":")[2].split("x"))
    mesh = make_mesh(MeshConfig(data=data, fsdp=fsdp, model=model_size),
                     jax.devices()[:data * fsdp * model_size])
    params, objective = ref["params"], ref["objective"]
    rules = param_rules(ref["cfg"], model_size)
    specs, step_specs = lora_specs(params, rules, mesh)
    graphdef = sharded_graphdef(ref["model"],
                                param_specs(nnx.split(ref["model"])[1], rules, mesh), mesh)
    sharded = jax.device_put(params, named(mesh, specs))
    step = MeshRedundancyFreeStep(graphdef, objective, mesh, step_specs)
    loss, metrics, grads = step(sharded, ref["program"])
    new_state = ref["update"](ref["state"], loss, metrics, grads)[0]
    leaves = jax.tree_util.tree_leaves
    result: dict[str, Any] = {"case": case}
    for name, (r_loss, r_grads, r_state) in (("rfree", ref["rfree"]), ("tree", ref["tree"])):
        result[f"{name}_loss_rel"] = abs(float(loss) - float(r_loss)) / abs(float(r_loss))
        result[f"{name}_grads_rel_l2"] = max(rel_l2(a, b) for a, b in
                                             zip(leaves(grads), leaves(r_grads)))
        result[f"{name}_params_rel_l2"] = max(rel_l2(a, b) for a, b in
                                              zip(leaves(new_state.params),
                                                  leaves(r_state.params)))
    # How far the two references are apart themselves (one device, no mesh involved).
    gaps = {jax.tree_util.keystr(path): rel_l2(a, b) for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(ref["rfree"][1]), leaves(ref["tree"][1]))}
    result["rfree_vs_tree_grads_rel_l2"] = max(gaps.values())
    result["rfree_vs_tree_worst_leaf"] = max(gaps, key=gaps.get)
    # The error model against the float64 tree step: the mesh step's loss and gradients with
    # the single-device redundancy-free step's error as their measure (the same algorithm, other
    # sum orders), and that step's with the tree step's (the trees' longest sums run over all
    # their tokens); the updates (and so the updated parameters) by `update_rounding`.
    exact_loss, exact_grads, exact_state, exact_params = ref["exact"]
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(exact_grads)]
    mesh, rfree, tree, exact = (
        {"loss": {"loss": loss_}, "grads": dict(zip(names, leaves(grads_), strict=True))}
        for loss_, grads_ in ((loss, grads), ref["rfree"][:2], ref["tree"][:2],
                              (exact_loss, exact_grads)))
    result["rounding"] = {
        f"{name}_{kind}": worst_rounding(got[kind], want[kind], exact[kind], ref["tokens"])
        for name, got, want in (("mesh", mesh, rfree), ("rfree", rfree, tree))
        for kind in exact}
    for name, state in (("mesh", new_state), ("rfree", ref["rfree"][2])):
        result["rounding"][f"{name}_update"] = update_rounding(state, exact_state, exact_params,
                                                               OPTIM)
    schedule = step.schedule
    result.update(steps=int(schedule.steps), loads=list(schedule.loads),
                  levels=int(schedule.levels),
                  model_sharded=sum("model" in a.sharding.spec for a in leaves(grads)),
                  fsdp_sharded=sum("fsdp" in a.sharding.spec for a in leaves(grads)))
    return result


def main(cases: list[str]) -> None:
    opt = make_optimizer(OPTIM)
    references: dict[tuple[str, str], dict[str, Any]] = {}
    for case in cases:
        key = tuple(case.split(":")[:2])
        if key not in references:
            references[key] = reference(*key, opt)
        print(json.dumps(compare_on_mesh(case, references[key])), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
