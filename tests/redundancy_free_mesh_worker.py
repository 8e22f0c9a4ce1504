"""Run one redundancy-free train step on meshes of 8 forced host devices and compare it with the
single-device redundancy-free step and the tree step.

Run in a subprocess (`tests/partitioning/test_redundancy_free_mesh.py`): XLA_FLAGS must be set before jax creates
its CPU backend. A case is `model:objective:DxFxM` (model `dense`, `moe` or `next` of
`tests.mesh_worker.case_model`, or `dense_lora`: `dense` training LoRA adapters; data x fsdp x
model). Prints one JSON line per case with the largest relative differences of the mesh step to
both references (loss, every gradient, also floored as `tests.models_util.assert_grads_close`
floors it, the updated parameters), the gap between the two references, and the lockstep
schedule's shape (steps, calls per shard, buffer levels). The references are computed once per
model and objective, the single-device redundancy-free one on the mesh's program
(`build_program(..., uniform=True)`); the same compile flags as `tests/mesh_worker.py`.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0").strip()

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
from jtree.step.optimizer import TrainState, apply_gradients, make_optimizer
from jtree.step.train_step import make_grad_fn, sharded_graphdef
from jtree.step.batches import stack_microbatches
from tests.mesh_worker import case_model  # noqa: E402
from tests.models_util import perturbed, rel_l2  # noqa: E402
from tests.strategies import multi_part_trees  # noqa: E402

ROW, CAPACITY, GDN_CHUNK = 16, 5, 3
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
    rfree_params = update(state, loss, metrics, grads)[0].params
    full = linearize(trees, 128, normalization=objective.normalization, gdn_chunk_size=chunk,
                     gdn_chunks=128 if chunk else None)
    t_loss, t_metrics, t_grads = jax.jit(make_grad_fn(graphdef, objective))(
        params, stack_microbatches([full]))
    tree_params = update(state, t_loss, t_metrics, t_grads)[0].params
    return dict(cfg=cfg, model=model, params=params, objective=objective, program=program,
                state=state, update=update,
                rfree=(loss, grads, rfree_params), tree=(t_loss, t_grads, tree_params))


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
    new_params = ref["update"](ref["state"], loss, metrics, grads)[0].params
    leaves = jax.tree_util.tree_leaves
    result: dict[str, Any] = {"case": case}
    for name, (r_loss, r_grads, r_params) in (("rfree", ref["rfree"]), ("tree", ref["tree"])):
        result[f"{name}_loss_rel"] = abs(float(loss) - float(r_loss)) / abs(float(r_loss))
        result[f"{name}_grads_rel_l2"] = max(rel_l2(a, b) for a, b in
                                             zip(leaves(grads), leaves(r_grads)))
        result[f"{name}_params_rel_l2"] = max(rel_l2(a, b) for a, b in
                                              zip(leaves(new_params), leaves(r_params)))
        result[f"{name}_grads_floored"] = floored_error(grads, r_grads)
    # How far the two references are apart themselves (one device, no mesh involved).
    gaps = {jax.tree_util.keystr(path): rel_l2(a, b) for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(ref["rfree"][1]), leaves(ref["tree"][1]))}
    result["rfree_vs_tree_grads_rel_l2"] = max(gaps.values())
    result["rfree_vs_tree_worst_leaf"] = max(gaps, key=gaps.get)
    schedule = step.schedule
    result.update(steps=int(schedule.steps), loads=list(schedule.loads),
                  levels=int(schedule.levels),
                  model_sharded=sum("model" in a.sharding.spec for a in leaves(grads)),
                  fsdp_sharded=sum("fsdp" in a.sharding.spec for a in leaves(grads)))
    return result


def floored_error(got: Any, want: Any) -> float:
    """The largest leaf error relative to max(the leaf's norm, 0.1 x the whole gradient's norm):
    <= 1e-5 is `tests.models_util.assert_grads_close` (1e-5 relative, 1e-6 of the whole norm as
    the floor for leaves whose gradient nearly cancels)."""
    leaves = [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(want)]
    total = float(np.sqrt(sum(np.sum(x ** 2) for x in leaves)))
    return max(float(np.linalg.norm(np.asarray(a, np.float64) - b))
               / max(float(np.linalg.norm(b)), 0.1 * total)
               for a, b in zip(jax.tree_util.tree_leaves(got), leaves))


def main(cases: list[str]) -> None:
    opt = make_optimizer(OptimConfig(learning_rate=1e-3, warmup_steps=0, decay_steps=10))
    references: dict[tuple[str, str], dict[str, Any]] = {}
    for case in cases:
        key = tuple(case.split(":")[:2])
        if key not in references:
            references[key] = reference(*key, opt)
        print(json.dumps(compare_on_mesh(case, references[key])), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
