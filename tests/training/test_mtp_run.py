"""`jtree train` with multi-token prediction (`objective.mtp_weight`, docs/design.md "Multi-token
prediction (MTP) on trees"): the run builds the MTP modules, reports their loss, checkpoints them
with their optimizer moments, resumes exactly, and its tree-mode losses equal the per-path
baseline mode's. The MTP loss itself is checked against a per-path reference written in
tests/models/test_mtp.py; here the run's wiring is."""

import argparse
import dataclasses
import signal
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from jtree.commands import export_hf
from jtree.config.run import load_config
from jtree.hf import save
from jtree.hf.safetensors_io import SINGLE_FILE
from jtree.launch.train import main
from jtree.models import create_model
from jtree.step.critic_params import flat_params
from jtree.training.checkpoint import Checkpointer
from jtree.training.trainer import Trainer
from tests.hf_util import copy_checkpoint, with_deepseek_mtp_layer, with_mtp_tensors
from tests.models_util import TINY_DEEPSEEK_V3
from tests.run_util import (
    checkpoint_params,
    computed_metrics,
    finish,
    launch,
    read_metrics,
    tiny_overrides,
)

# A tiny Qwen3.5 (Gated DeltaNet then gated attention): its checkpoints carry `mtp.*`.
QWEN3_5 = {"model.architecture": "qwen3_5",
           "model.layer_types": "[linear_attention,full_attention]",
           "model.num_hidden_layers": 2}

WEIGHT = 0.5


def _run_args(groups, out, **extra) -> list[str]:
    over = {"objective.mtp_weight": WEIGHT, "checkpoint.dir": out,
            "run.metrics_jsonl": out / "metrics.jsonl", **extra}
    return ["--config", "configs/tiny.yaml", *tiny_overrides(groups, **over)]


def _check_records(records):
    """Each step reports the MTP loss, and the step's loss is the SFT loss plus mtp_weight
    times it (the tiny model is dense: no router loss)."""
    for r in records:
        assert r["mtp_nll"] > 0
        np.testing.assert_allclose(r["loss"], r["nll"] + WEIGHT * r["mtp_nll"], rtol=1e-6)


def test_mtp_run_trains_and_checkpoints_mtp_modules(few_groups_file, tmp_path, capsys):
    """One step: the MTP loss in the JSONL and the printed line, the MTP modules in the
    checkpoint, moved by the step from the seeded init."""
    out = tmp_path / "run"
    assert main(_run_args(few_groups_file, out, **{"run.steps": 1, "data.micro_batches": 1})) == 0
    printed = capsys.readouterr().out
    assert "mtp_nll" in next(x for x in printed.splitlines() if x.startswith("step"))
    _check_records(read_metrics(out / "metrics.jsonl"))
    params = checkpoint_params(out, 1)
    mtp = [k for k in params if k.startswith("['mtp']")]
    assert "['mtp']['fc']['kernel']['value']" in mtp and any("['layers']['0']" in k for k in mtp)
    cfg = load_config("configs/tiny.yaml", _run_args(few_groups_file, out)[2:])
    seeded = create_model(cfg.model.architecture, cfg.model.config, cfg.runtime,
                          seed=cfg.run.seed, **cfg.model_args).mtp
    step = np.abs(params["['mtp']['fc']['kernel']['value']"] - np.asarray(seeded.fc.kernel[...]))
    assert 0 < step.max() < 0.1  # one AdamW step of learning rate 1e-2 from the seeded init


def test_mtp_run_refusals():
    for override, other in (("run.mode=redundancy_free", "redundancy_free"),
                            ("mesh.context=2", "mesh.context"),
                            ("model.lora.targets=[q_proj]", "model.lora")):
        with pytest.raises(ValueError, match=f"objective.mtp_weight: .*{other}"):
            load_config("configs/tiny.yaml", ["objective.mtp_weight=0.5", override])


@pytest.mark.slow  # four runs of a few steps
def test_mtp_run_equals_baseline_and_resumes_exactly(groups_file, tmp_path):
    """Depth 2. Tree mode's per-step losses equal baseline mode's (every path its own row: the
    per-path MTP loss) at float tolerance; a run killed after its step-1 checkpoint and resumed
    equals the uninterrupted run bit for bit (metrics and parameters, MTP modules included)."""
    common = {"run.steps": 2, "checkpoint.every": 1, "objective.mtp_depth": 2}
    straight, baseline = tmp_path / "straight", tmp_path / "baseline"
    assert main(_run_args(groups_file, straight, **common)) == 0
    assert main(_run_args(groups_file, baseline, **common, **{"run.mode": "baseline"})) == 0
    tree_records = read_metrics(straight / "metrics.jsonl")
    _check_records(tree_records)
    for key in ("loss", "nll", "mtp_nll"):
        np.testing.assert_allclose([r[key] for r in tree_records],
                                   [r[key] for r in read_metrics(baseline / "metrics.jsonl")],
                                   rtol=1e-5, err_msg=key)

    resumed = tmp_path / "resumed"
    args = _run_args(groups_file, resumed, **common)
    log = tmp_path / "killed"
    code, _, err = finish(launch(args + ["run.kill_after_checkpoint=1"], log), log)
    assert code == -signal.SIGKILL, err[-3000:]
    log = tmp_path / "again"
    code, out, err = finish(launch(args + ["--resume"], log), log)
    assert code == 0 and "(step 1)" in out, err[-3000:]
    assert computed_metrics(tree_records) == computed_metrics(read_metrics(
        resumed / "metrics.jsonl"))
    a, b = checkpoint_params(straight, 2), checkpoint_params(resumed, 2)
    assert a.keys() == b.keys() and any(k.startswith("['mtp']['layers']['1']") for k in a)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("depth", [1, 2])
def test_mtp_run_starts_from_and_exports_hf_mtp_tensors(tmp_path, depth):
    """`model.init_from` a Qwen3.5 checkpoint with Hub-named `mtp.*` tensors (one MTP layer):
    the run's starting MTP modules are those tensors (depth 2: layer 1 from the seeded init),
    a KL reference model (`initial`) is the main model without them, and export-hf of that state, through an Orbax checkpoint, writes the checkpoint back bit for
    bit (depth 1) or with the seeded layer 1 added (depth 2). No step is compiled."""
    over = dict(QWEN3_5, **{"objective.mtp_weight": WEIGHT, "objective.mtp_depth": depth,
                            "objective.kind": "ppo", "objective.kl_coef": 0.1,
                            "objective.reference": "initial"})
    plain_cfg = load_config("configs/tiny.yaml", tiny_overrides(tmp_path / "none", **over))
    mcfg = plain_cfg.model.config
    save(create_model("qwen3_5", mcfg, seed=11), mcfg, tmp_path / "plain")
    src = copy_checkpoint(tmp_path / "plain", tmp_path / "src", edit_tensors=lambda t:
                          with_mtp_tensors(t, mcfg.hidden_size))
    overrides = tiny_overrides(tmp_path / "none", **over, **{"model.init_from": src})
    cfg = load_config("configs/tiny.yaml", overrides)
    trainer = Trainer.build(cfg)
    state = trainer.initial_state()
    params, tensors = flat_params(state.params), load_file(str(src / SINGLE_FILE))
    np.testing.assert_array_equal(params["mtp/fc/kernel"], tensors["mtp.fc.weight"].T)
    np.testing.assert_array_equal(params["mtp/layers/0/self_attn/o_proj/kernel"],
                                  tensors["mtp.layers.0.self_attn.o_proj.weight"].T)
    np.testing.assert_array_equal(params["model/embed_tokens/embedding"],
                                  tensors["model.embed_tokens.weight"])
    if depth == 2:
        seeded = flat_params(create_model("qwen3_5", mcfg, cfg.runtime, seed=cfg.run.seed,
                                          **cfg.model_args))
        name = "mtp/layers/1/self_attn/o_proj/kernel"
        # The run draws it under jit, this eagerly: the same draw, rounded differently.
        np.testing.assert_allclose(params[name], seeded[name], rtol=1e-6, atol=1e-8)
        assert not np.allclose(params[name], tensors["mtp.layers.0.self_attn.o_proj.weight"].T)

    # The KL term's reference model is the main model alone, as loaded.
    reference = flat_params(trainer.reference_params())
    assert not any(k.startswith("mtp/") for k in reference)
    np.testing.assert_array_equal(reference["model/embed_tokens/embedding"],
                                  tensors["model.embed_tokens.weight"])

    ckpt = Checkpointer(tmp_path / "ckpt", async_save=False)
    ckpt.save(0, state, {}, trainer.run_meta())
    ckpt.close()
    export_hf.run(argparse.Namespace(
        config="configs/tiny.yaml", overrides=overrides, checkpoint=str(tmp_path / "ckpt"),
        step=None, out=str(tmp_path / "out"), dtype=None, copy_from=None, peft_adapters=False,
        merge_lora=False))
    written = load_file(str(tmp_path / "out" / SINGLE_FILE))
    extra = {n for n in written if n.startswith("mtp.layers.1.")}
    assert bool(extra) == (depth == 2)
    assert written.keys() - extra == tensors.keys()
    for name, value in tensors.items():
        np.testing.assert_array_equal(written[name], value, err_msg=name)


def test_mtp_run_starts_from_and_exports_a_deepseek_mtp_layer(tmp_path):
    """The same for DeepSeek-V3, whose checkpoints keep the MTP module as decoder layer
    `num_hidden_layers` (`tests.hf_util.with_deepseek_mtp_layer`): the run's MTP modules start
    from that layer, and export-hf writes it back bit for bit, its copies of the embedding and
    head included. The run config is configs/tiny.yaml with the tiny DeepSeek-V3 model section
    of the model tests. No step is compiled."""
    config_path = tmp_path / "deepseek.yaml"
    run_config = yaml.safe_load(Path("configs/tiny.yaml").read_text())
    rope = dataclasses.asdict(TINY_DEEPSEEK_V3["rope_scaling"])
    run_config["model"] = {"architecture": "deepseek_v3",
                           **dict(TINY_DEEPSEEK_V3, rope_scaling=rope)}
    config_path.write_text(yaml.safe_dump(run_config))
    mcfg = load_config(str(config_path), []).model.config
    save(create_model("deepseek_v3", mcfg, seed=11), mcfg, tmp_path / "plain")
    prefix = []
    src = copy_checkpoint(tmp_path / "plain", tmp_path / "src", edit_tensors=lambda t:
                          prefix.append(with_deepseek_mtp_layer(t, mcfg.hidden_size)))
    overrides = [f"data.path={tmp_path / 'none'}", "runtime.attention_impl=reference",
                 f"objective.mtp_weight={WEIGHT}", f"model.init_from={src}"]
    cfg = load_config(str(config_path), overrides)
    trainer = Trainer.build(cfg)
    state = trainer.initial_state()
    params, tensors = flat_params(state.params), load_file(str(src / SINGLE_FILE))
    np.testing.assert_array_equal(params["mtp/fc/kernel"], tensors[prefix[0] + "eh_proj.weight"].T)
    np.testing.assert_array_equal(params["mtp/layers/0/self_attn/o_proj/kernel"],
                                  tensors[prefix[0] + "self_attn.o_proj.weight"].T)

    ckpt = Checkpointer(tmp_path / "ckpt", async_save=False)
    ckpt.save(0, state, {}, trainer.run_meta())
    ckpt.close()
    export_hf.run(argparse.Namespace(
        config=str(config_path), overrides=overrides, checkpoint=str(tmp_path / "ckpt"),
        step=None, out=str(tmp_path / "out"), dtype=None, copy_from=None, peft_adapters=False,
        merge_lora=False))
    written = load_file(str(tmp_path / "out" / SINGLE_FILE))
    assert written.keys() == tensors.keys()
    for name, value in tensors.items():
        np.testing.assert_array_equal(written[name], value, err_msg=name)
