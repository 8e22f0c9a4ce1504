"""Redundancy-free training over a ('data', 'fsdp', 'model') mesh (`jtree.partitioning.redundancy_free.mesh_executor`).

The lockstep schedule and the uniform layout are checked in process (no compile). The steps run
in a subprocess of 8 forced host devices (`tests/redundancy_free_mesh_worker.py`): a case
`model:objective:DxFxM` trains one step on that mesh and compares it with the single-device
redundancy-free step and the tree step on the same trees (float32: loss, every gradient and the
updated parameters within the error model of docs/design.md, Numerics, against the tree step in
float64; see `check`). Trees: four
that need two to four levels of parts at capacity 5 and two small ones (rows of their own); the
data 4 mesh runs one part tree per shard, data 2 two. The default case is the dense model with
PPO on data 2 x fsdp 2 x model 2 (data parallel, FSDP gathers and tensor parallel in one run);
the sweep over models (dense, MoE, Qwen3-Next, LoRA), objectives and meshes (data 2 and 4 among
them) and the launcher run are slow.
"""

import re

import numpy as np
import pytest

from jtree.partitioning.redundancy_free.layout import build_program
from jtree.partitioning.redundancy_free.schedule import lockstep, part_calls
from tests.covering import staggered
from tests.run_util import finish, launch, run_worker, tiny_overrides, write_groups, xla_flags
from tests.strategies import multi_part_trees


def trees():
    return multi_part_trees(seed=7) + multi_part_trees(seed=8)


def test_uniform_program_has_one_row_shape_and_no_whole_batches():
    """`uniform=True`: every part row has the same shapes, the small trees that fit no part
    row get rows of their own (parts without prefix or children), and every token is still
    computed once."""
    for capacity, chunk in ((5, None), (3, 3), (16, 3)):
        plain = build_program(trees(), capacity, seq_len=16, gdn_chunk_size=chunk)
        program = build_program(trees(), capacity, seq_len=16, gdn_chunk_size=chunk,
                                uniform=True)
        assert program.whole is None and program.n_computed == plain.n_computed
        shapes = {tuple((k, v.shape) for k, v in vars(p.inputs).items() if hasattr(v, "shape"))
                  for p in program.parts}
        assert len(shapes) == 1
        assert len({p.prefix_len for p in program.parts}) == 1
        roots = [p for p in program.parts if p.parent < 0]
        assert len(roots) >= 4 + (plain.whole is not None)


@pytest.mark.parametrize("shards", [1, 2, 3, 4, 8])
def test_lockstep_runs_part_trees_in_post_order_on_one_shard(shards):
    """Each part tree on one shard; per shard, a part with children called forward before its
    children and backward after the last one, a leaf once; calls balanced over the shards (no
    shard busier than the largest part tree or than the even split, rounded up to a part
    tree); idle steps only at the end; levels cover every part with children."""
    program = build_program(trees(), 3, seq_len=16, uniform=True)
    parts = program.parts
    schedule = lockstep(program, shards, min_steps=40)
    assert schedule.steps == max(40, max(schedule.loads))
    calls = part_calls(program)
    roots = [k for k, p in enumerate(parts) if p.parent < 0]
    assert sorted(r for g in schedule.groups for r in g) == roots
    total = sum(calls[r] for r in roots)
    assert max(schedule.loads) <= max(total / shards + max(calls[r] for r in roots),
                                      max(calls[r] for r in roots))
    for d, group in enumerate(schedule.groups):
        column = schedule.part[:, d]
        n = schedule.loads[d]
        assert n == sum(calls[r] for r in group)
        assert np.all(column[:n] >= 0) and np.all(column[n:] == -1)
        seen = {}
        for t in range(n):
            k, back = int(column[t]), bool(schedule.backward[t, d])
            seen.setdefault(k, []).append((t, back))
            depth = 0 if parts[k].parent < 0 else schedule.depth[seen[parts[k].parent][0][0], d] + 1
            assert schedule.depth[t, d] == depth
        for k, events in seen.items():
            kinds = [b for _, b in events]
            assert kinds == ([False, True] if parts[k].children else [True])
            for c in parts[k].children:  # the child's calls lie between the parent's two
                assert events[0][0] < seen[c][0][0] and seen[c][-1][0] < events[-1][0]
            if parts[k].children:
                assert schedule.depth[events[0][0], d] < schedule.levels
        assert sum(len(v) for v in seen.values()) == n


def run_cases(cases: list[str]) -> list[dict]:
    return run_worker("tests.redundancy_free_mesh_worker", cases)


def check(result: dict) -> None:
    # Loss and every gradient within the error model of `tests.models_util.rounding_bound`
    # against the tree step in float64: the mesh step measured by the single-device
    # redundancy-free step's error (the same algorithm), and that step by the tree step's
    # (Qwen3-Next's layer-0 GDN input path is ill-conditioned in float32 with PPO on these trees:
    # both single-device steps are ~1e-5 off float64 there, and agree with each other only as
    # closely). The updates, and so the updated parameters, by `tests.mesh_worker.
    # update_rounding`. The direct differences (`*_rel*`, `rfree_vs_tree_*`) are reported.
    for kind, worst in result["rounding"].items():
        assert worst["excess"] <= 1.0, (kind, worst, result)
    data, fsdp, model = (int(x) for x in result["case"].split(":")[2].split("x"))
    assert len(result["loads"]) == data * fsdp and min(result["loads"]) > 0  # every shard ran
    assert result["levels"] >= 2  # parts with grandchildren: buffers on several levels
    if model > 1:
        assert result["model_sharded"] > 0, result
    if fsdp > 1:
        assert result["fsdp_sharded"] > 0, result


def test_dense_on_a_data_fsdp_model_mesh():
    for result in run_cases(["dense:ppo:2x2x2"]):
        check(result)


MODELS = ("dense", "moe", "next", "dense_lora")


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("model", MODELS)
def test_every_model_objective_and_mesh(model):
    # Two meshes for each model, staggered so that every mesh meets a model, SFT and PPO in
    # turn (each model meets both).
    meshes = ("2x1x1", "4x1x1", "2x1x2", "1x2x2", "2x2x2")
    cases = [f"{model}:{objective}:{mesh}"
             for m, mesh, objective in staggered(MODELS, meshes, 2, ("sft", "ppo")) if m == model]
    for result in run_cases(cases):
        check(result)


@pytest.mark.slow
def test_launcher_trains_redundancy_free_on_a_mesh(tmp_path):
    """`run.mode=redundancy_free` through the launcher on data 2 x model 2 (4 forced host
    devices) gives tree mode's losses on the same mesh, at N_computed == N_tree."""
    data = write_groups(tmp_path / "groups.jsonl", n_groups=4)
    losses = {}
    for mode in ("redundancy_free", "tree"):
        args = ["--config", "configs/tiny.yaml", *tiny_overrides(data, **{
            "run.steps": 3, "data.trees_per_step": 4, "data.micro_batches": 1,
            "runtime.attention_impl": "xla", "run.capacity": 40, "run.row_steps_per_octave": 4,
            "mesh.data": 2, "mesh.model": 2, "run.mode": mode})]
        log = tmp_path / mode
        code, out, err = finish(launch(args, log, env={
            "XLA_FLAGS": xla_flags(4)}), log)
        assert code == 0, err[-3000:]
        losses[mode] = [float(x) for x in re.findall(r"^step +\d+/\d+ +loss +([\d.]+)", out, re.M)]
        if mode == "redundancy_free":
            assert "part trees in lockstep over the row shards" in out
            por_err = re.findall(r"POR ([\d.]+)  ERR ([\d.]+)", out)
            assert len(por_err) == 3 and all(p == e for p, e in por_err), out
    assert len(losses["tree"]) == 3
    assert losses["redundancy_free"] == pytest.approx(losses["tree"], rel=1e-5)
