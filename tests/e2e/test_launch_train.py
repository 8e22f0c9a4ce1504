import json
import re

import jax
import numpy as np
import pytest

from jtree.launch.train import main
from jtree.trees.synthetic import chat_record
from tests.run_util import tiny_overrides


def test_demo_job_runs_end_to_end(capsys):
    """The `make demo` job on a shrunken model: per-step lines, equivalence and speedup."""
    rc = main(["--config", "configs/tiny.yaml", "run.steps=2", "data.trees_per_step=2",
               "data.micro_batches=2", *DEMO_SMALL_MODEL, "run.timing_repeats=1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert len(re.findall(r"^step +\d+/\d+ +loss +[\d.]+ .*tokens/s .*POR", out, re.M)) == 2
    diff = float(re.search(r"equivalence: .* = ([\d.e+-]+)", out).group(1))
    assert diff <= 1e-5
    assert re.search(r"speedup [\d.]+x", out)
    _assert_compiles_reported(out)


DEMO_SMALL_MODEL = ["model.num_hidden_layers=1", "model.hidden_size=32",
                    "model.intermediate_size=64"]


def _assert_compiles_reported(out: str) -> int:
    """Each new step shape is announced before its compile and timed after it, the steps that
    compiled say so and are left out of the summary's medians, and the step's jit holds one
    program per announced shape plus the baseline comparison's. Returns the programs."""
    announced = re.findall(r"^compiling the step for shape (.*) \.\.\.$", out, re.M)
    done = re.findall(r"^compiling the step for shape (.*): done in ([\d.]+) s", out, re.M)
    assert announced and announced == [shape for shape, _ in done]
    assert len(set(announced)) == len(announced)
    assert "compiled the step again" not in out
    compiled_steps = re.findall(r"^step .* compile ([\d.]+) s(?:  eta \S+)?$", out,
                                re.M)
    assert len(compiled_steps) == len(announced)
    total = re.search(r"compiles: (\d+) in (\d+) step\(s\), ([\d.]+) s", out)
    assert int(total.group(2)) == len(announced) and float(total.group(3)) > 0
    programs = int(re.search(r"^train step programs: (\d+) ", out, re.M).group(1))
    baseline = 1 if "speedup" in out else 0
    assert programs == len(announced) + baseline
    return programs


def test_demo_compiles_at_most_one_step_program_per_mode(capsys):
    """The whole `make demo` run (16 steps and the baseline comparison, shrunken model) compiles
    its step at most twice: once for tree rows, once for the baseline's."""
    assert main(["--config", "configs/tiny.yaml", *DEMO_SMALL_MODEL,
                 "run.timing_repeats=1"]) == 0
    assert _assert_compiles_reported(capsys.readouterr().out) <= 2


def test_a_run_on_chat_data_compiles_its_step_once(tmp_path, capsys):
    """Chat conversations of different lengths and numbers of assistant turns: the steps differ
    in tree tokens and in scored tokens per row, yet the run compiles one step program (rows,
    score width and row length are fixed for the run by the planner), counted from jax's
    compile events."""
    rng = np.random.default_rng(5)
    data = tmp_path / "chat.jsonl"
    with open(data, "w", encoding="utf-8") as f:
        for _ in range(12):
            rec = chat_record(rng, system_words=int(rng.integers(3, 20)),
                              turns=int(rng.integers(1, 4)), user_words=5,
                              assistant_words=int(rng.integers(3, 20)), tool_words=5,
                              reasoning_words=5)
            f.write(json.dumps(rec) + "\n")
    assert main(["--config", "configs/tiny.yaml", *tiny_overrides(data, **{
        "data.format": "chat", "data.tokenizer": "bytes", "model.vocab_size": 260,
        "data.seq_len": 1024, "data.trees_per_step": 3, "run.steps": 4})]) == 0
    out = capsys.readouterr().out
    assert _assert_compiles_reported(out) == 1


def test_auto_mode_logs_each_steps_choice_and_trains_like_tree_mode(capsys):
    """`run.mode=auto` on the sample trees (POR ~0.6): every step says which mode it chose and
    why, and the losses are those of a tree-mode run (both modes are exact)."""
    common = ["--config", "configs/tiny.yaml", "run.steps=2", "data.trees_per_step=2",
              "model.num_hidden_layers=1", "model.hidden_size=32", "model.intermediate_size=64",
              "run.compare_baseline=false"]
    losses = {}
    for mode in ("auto", "tree"):
        assert main(common + [f"run.mode={mode}"]) == 0
        out = capsys.readouterr().out
        losses[mode] = [float(x) for x in re.findall(r"^step +\d+/\d+ +loss +([\d.]+)", out, re.M)]
        if mode == "auto":
            reasons = re.findall(r"auto mode: (tree|baseline) \(predicted gain ([\d.]+)x", out)
            assert len(reasons) == 2 and all(m == "tree" for m, _ in reasons), out
    assert losses["auto"] == losses["tree"]


def test_qwen3_next_job_runs_with_chunk_tables(few_groups_file, tmp_path, capsys):
    """The launcher on a one-layer Qwen3-Next (Gated DeltaNet + MoE with shared expert, router
    loss on): the pipeline adds GDN chunk tables and the step trains. (Its tree log-probs equal
    the per-path baseline's: tests/models/test_hybrid_equivalence.py.)"""
    rc = main(["--config", "configs/tiny.yaml", *tiny_overrides(few_groups_file, **{
        "model.architecture": "qwen3_next", "model.layer_types": "[linear_attention]",
        "model.num_experts": 4, "model.moe_intermediate_size": 16,
        "model.shared_expert_intermediate_size": 16, "model.output_router_logits": "true",
        "model.router_aux_loss_coef": 0.1, "data.gdn_chunk_size": 8, "run.steps": 1,
        "data.micro_batches": 1, "run.timing_repeats": 1,
        "model.tie_word_embeddings": "false"})])
    out = capsys.readouterr().out
    assert rc == 0
    assert "model: qwen3_next" in out
    assert len(re.findall(r"^step +0/\d+ +loss +[\d.]+ ", out, re.M)) == 1


def test_redundancy_free_mode_trains(few_groups_file, tmp_path, capsys):
    """`run.mode=redundancy_free` with a capacity below the trees' sizes (so they are split into
    parts over cached prefixes) trains with N_computed == N_tree (ERR == POR). (Its step equals
    the tree step: tests/partitioning/test_redundancy_free.py; through the launcher on a mesh:
    test_redundancy_free_mesh.py.)"""
    steps = 1
    common = ["--config", "configs/tiny.yaml",
              *tiny_overrides(few_groups_file, **{"run.steps": steps, "data.trees_per_step": 2,
                                       "data.micro_batches": 1, "runtime.attention_impl": "xla",
                                       "run.capacity": 40, "run.prefix_backward": "residuals",
                                       "run.row_steps_per_octave": 4})]
    assert main(common + ["run.mode=redundancy_free"]) == 0
    out = capsys.readouterr().out
    assert len(re.findall(r"^step +\d+/\d+ +loss +[\d.]+", out, re.M)) == steps
    por_err = re.findall(r"POR ([\d.]+)  ERR ([\d.]+)", out)
    assert len(por_err) == steps and all(p == e for p, e in por_err), out
    assert float(por_err[0][0]) > 0.3  # the trees share prefixes (so parts reuse them)


def test_redundancy_free_mode_refuses_bad_settings():
    """On a mesh of several devices the parts run in lockstep (`jtree.partitioning.redundancy_free.mesh_executor`, tested in
    tests/partitioning/test_redundancy_free_mesh.py), which keeps no residuals: `run.prefix_backward=residuals`
    there is refused, naming the setting and the mesh; so are mesh axes other than data, fsdp
    and model, a capacity above the rows and a bad row ladder."""
    from jax.sharding import Mesh

    from jtree.config import load_config
    from jtree.partitioning.redundancy_free.mesh_executor import MeshRedundancyFreeStep
    from jtree.training.trainer import make_rfree_step

    cfg = load_config("configs/tiny.yaml", ["run.mode=redundancy_free",
                                            "run.prefix_backward=residuals"])
    from jtree.parallel.sharding import AXES as axes
    for shape, named in (((2, 1, 1, 1), "data=2 x fsdp=1"), ((1, 2, 1, 1), "data=1 x fsdp=2")):
        devices = np.array([jax.devices()[0]] * 2).reshape(shape)
        with pytest.raises(ValueError, match=f"run.prefix_backward=residuals.*{named}"):
            make_rfree_step(cfg, Mesh(devices, axes), None, None)
    context = Mesh(np.array([jax.devices()[0]] * 2).reshape(1, 1, 2, 1), axes)
    with pytest.raises(ValueError, match="mesh.context=2: run.mode=redundancy_free"):
        MeshRedundancyFreeStep(None, cfg.objective, context, None)
    cfg = load_config("configs/tiny.yaml", ["run.mode=redundancy_free", "run.capacity=4096"])
    one = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1, 1), axes)
    with pytest.raises(ValueError, match="run.capacity=4096"):
        make_rfree_step(cfg, one, None, None)
    cfg = load_config("configs/tiny.yaml", ["run.mode=redundancy_free",
                                            "run.row_steps_per_octave=3"])
    with pytest.raises(ValueError, match="run.row_steps_per_octave"):
        make_rfree_step(cfg, one, None, None)
