"""Exact resume: 2N uninterrupted steps == N steps, SIGKILL right after the checkpoint, resume, N
more. Same per-step metrics (all but the timings) and same final parameters, bit for bit (same
program, same machine), including the data order (grain iterator state in the checkpoint, restored
with a worker process feeding the resumed run). The killed run's first N steps are a second run
from scratch in a fresh process, so identical runs are compared too. The dense run checks the
mechanics over 3 + 3 steps; a short MoE run (1 + 1 steps, slow) checks them for an
expert-parallel model (mesh model=2) with the router loss on."""

import json
import re
import shutil
import signal
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jtree.launch.train import main
from jtree.training.checkpoint import write_manifest
from tests.checkpoint_damage import damage
from tests.run_util import computed_metrics, finish, launch, read_metrics, tiny_overrides, xla_flags

N = 3
MOE_OVERRIDES = {
    "model.architecture": "qwen3_moe", "model.num_experts": 4, "model.num_experts_per_tok": 2,
    "model.moe_intermediate_size": 16, "model.output_router_logits": "true",
    "model.router_aux_loss_coef": 0.1, "mesh.model": 2, "data.micro_batches": 1,
}


def _params(ckpt_dir, step):
    """The checkpoint's parameters on this process's first device (whatever mesh wrote them)."""
    path = ckpt_dir / str(step) / "state"
    checkpointer = ocp.StandardCheckpointer()
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree_util.tree_map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
        checkpointer.metadata(path).item_metadata)
    return jax.tree_util.tree_leaves(checkpointer.restore(path, target)["params"])


def _assert_same_run(a, b, steps):
    """Runs `a` and `b` (checkpoint dirs holding metrics.jsonl) wrote bitwise the same metrics, but
    for the timings, and the same parameters after `steps` steps."""
    ma, mb = read_metrics(a / "metrics.jsonl"), read_metrics(b / "metrics.jsonl")
    assert computed_metrics(ma) == computed_metrics(mb)
    for x, y in zip(_params(a, steps), _params(b, steps), strict=True):
        np.testing.assert_array_equal(x, y)


def _kill_resume_and_compare(tmp_path, common, straight, n, env=None, workers=1):
    """Run `common` killed after the checkpoint of step n, resume it, and compare it with the
    uninterrupted run in `straight` (2n steps)."""
    resumed = tmp_path / "resumed"
    args = ["--config", "configs/tiny.yaml", *common, f"checkpoint.dir={resumed}",
            f"run.metrics_jsonl={resumed}/metrics.jsonl", f"data.worker_count={workers}"]
    log = tmp_path / "killed"
    code, out, err = finish(launch(args + [f"run.kill_after_checkpoint={n}"], log, env), log)
    assert code == -signal.SIGKILL, err[-3000:]
    assert f"checkpoint {n} committed" in out
    assert [r["step"] for r in read_metrics(resumed / "metrics.jsonl")][:n] == list(range(n))

    log = tmp_path / "again"
    code, out, err = finish(launch(args + ["--resume"], log, env), log)
    assert code == 0, err[-3000:]
    assert f"(step {n})" in out

    a, b = read_metrics(straight / "metrics.jsonl"), read_metrics(resumed / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(2 * n))
    assert len({r["loss"] for r in a}) == 2 * n  # the steps really differ
    _assert_same_run(straight, resumed, 2 * n)
    return a


def _wait_for(log: Path, line: str, proc, timeout: float = 300) -> None:
    """Wait until the run writing `log`.out has printed a line starting with `line`."""
    deadline = time.monotonic() + timeout
    while not any(x.startswith(line) for x in Path(f"{log}.out").read_text().splitlines()):
        assert proc.poll() is None, Path(f"{log}.err").read_text()[-3000:]
        assert time.monotonic() < deadline, f"no {line!r} in {timeout} s"
        time.sleep(0.05)


def _sigterm_resume_and_compare(tmp_path, common, straight, steps):
    """SIGTERM (a preemption) while step 0 compiles: the run saves a checkpoint after that step
    and exits 0; `--resume` without repeating `run.metrics_jsonl` continues into the same
    metrics file, and the result equals the uninterrupted run in `straight`, bit for bit."""
    run_dir = tmp_path / "preempted"
    args = ["--config", "configs/tiny.yaml", *common, f"checkpoint.dir={run_dir}"]
    log = tmp_path / "sigterm"
    proc = launch(args + [f"run.metrics_jsonl={run_dir}/metrics.jsonl"], log)
    _wait_for(log, "compiling the step for shape", proc)
    proc.send_signal(signal.SIGTERM)
    code, out, err = finish(proc, log)
    assert code == 0, err[-3000:]
    assert "SIGTERM: checkpoint 1 committed; stopping" in out
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0]

    log = tmp_path / "after_sigterm"
    code, out, err = finish(launch(args + ["--resume"], log), log)
    assert code == 0, err[-3000:]
    assert "(step 1)" in out and "run.metrics_jsonl kept from the checkpoint's run" in out
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == list(range(steps))
    _assert_same_run(straight, run_dir, steps)


def test_killed_or_preempted_run_resumes_exactly(groups_file, tmp_path):
    """With the `cpu` attention kernel, what `auto` runs on CPU (that its threads sum gradients
    in a fixed order is `tests/kernels/test_attention_cpu.py`'s test: here each one's work is too
    short for their timing to vary). Killed after a checkpoint, and stopped by SIGTERM."""
    common = tiny_overrides(groups_file, **{"run.steps": 2 * N, "checkpoint.every": N,
                                            "runtime.attention_impl": "cpu"})
    straight = tmp_path / "straight"
    assert main(["--config", "configs/tiny.yaml", *common, f"checkpoint.dir={straight}",
                 f"run.metrics_jsonl={straight}/metrics.jsonl"]) == 0
    _kill_resume_and_compare(tmp_path, common, straight, N)
    _sigterm_resume_and_compare(tmp_path, common, straight, 2 * N)


def test_resume_without_a_checkpoint_is_an_error_unless_auto(few_groups_file, tmp_path, capsys):
    """A mistyped checkpoint.dir under --resume must not start over (nor create the folder);
    --resume=auto starts from scratch when there is no checkpoint, as pod launchers want."""
    missing = tmp_path / "typo"
    common = ["--config", "configs/tiny.yaml",
              *tiny_overrides(few_groups_file, **{"run.steps": 1}), f"checkpoint.dir={missing}"]
    assert main([*common, "--resume"]) == 2
    assert f"--resume: {missing} does not exist" in capsys.readouterr().err
    assert not missing.exists()
    assert main([*common, "--resume=auto"]) == 0
    assert "--resume=auto: no checkpoint in" in capsys.readouterr().out
    assert main([*common, "--resume"]) == 0  # step 1 of 1 is saved: nothing left to run
    assert "no steps to run: the checkpoint is at step 1 and run.steps is 1" in (
        capsys.readouterr().out)


@pytest.mark.slow  # the mechanics are the dense test's; this adds an expert-parallel state
def test_killed_moe_run_resumes_exactly_on_an_expert_parallel_mesh(groups_file, tmp_path):
    common = tiny_overrides(groups_file, **{"run.steps": 2, "checkpoint.every": 1, **MOE_OVERRIDES})
    env = {"XLA_FLAGS": xla_flags(2)}
    straight = tmp_path / "straight"
    log = tmp_path / "straight_log"
    code, out, err = finish(launch(["--config", "configs/tiny.yaml", *common,
                                    f"checkpoint.dir={straight}",
                                    f"run.metrics_jsonl={straight}/metrics.jsonl"], log, env), log)
    assert code == 0, err[-3000:]
    assert "model: qwen3_moe" in out and "mesh data=1 x fsdp=1 x model=2" in out
    history = _kill_resume_and_compare(tmp_path, common, straight, 1, env, workers=0)
    assert all(r["aux_loss"] > 0 for r in history)  # the router loss is part of the objective


def test_resume_falls_back_past_a_damaged_checkpoint(groups_file, tmp_path, capsys):
    """Changed bytes in the latest checkpoint's arrays (which Orbax reads without an error):
    `--resume` logs the file in one line and continues from the newest intact checkpoint, with the
    same losses and final parameters as resuming from that checkpoint directly; with
    `checkpoint.on_corrupt=raise` it stops naming the file."""
    first = tmp_path / "first"
    common = tiny_overrides(groups_file, **{"checkpoint.every": 1})
    assert main(["--config", "configs/tiny.yaml", *common, "run.steps=3",
                 f"checkpoint.dir={first}"]) == 0
    losses, reason = {}, None
    for name in ("damaged", "direct"):
        directory = tmp_path / name
        shutil.copytree(first, directory)
        if name == "damaged":
            reason = damage(directory / "3", "bitflip")
        else:
            shutil.rmtree(directory / "3")
        capsys.readouterr()
        assert main(["--resume", "--config", "configs/tiny.yaml", *common, "run.steps=4",
                     f"checkpoint.dir={directory}",
                     f"run.metrics_jsonl={directory}/metrics.jsonl"]) == 0
        out = capsys.readouterr().out
        assert f"resumed from checkpoint {directory}/2 (step 2)" in out
        damaged_line = f"checkpoint {directory}/3: {reason}"
        assert (damaged_line in out) == (name == "damaged"), out
        assert out.count(f"{directory}/3:") == (name == "damaged")
        losses[name] = [(r["step"], r["loss"]) for r in read_metrics(directory / "metrics.jsonl")]
    assert [s for s, _ in losses["direct"]] == [2, 3]
    assert losses["damaged"] == losses["direct"]
    for x, y in zip(_params(tmp_path / "damaged", 4), _params(tmp_path / "direct", 4), strict=True):
        np.testing.assert_array_equal(x, y)

    directory = tmp_path / "raise"
    shutil.copytree(first, directory)
    damage(directory / "3", "bitflip")
    assert main(["--resume", "--config", "configs/tiny.yaml", *common, "run.steps=4",
                 f"checkpoint.dir={directory}", "checkpoint.on_corrupt=raise"]) == 2
    err = capsys.readouterr().err
    assert f"CorruptCheckpoint: checkpoint {directory}/3: {reason}" in err, err
    assert (directory / "3").is_dir() and not (directory / "4").exists()


def test_resume_says_what_changed_and_refuses_model_and_data_order_changes(few_groups_file,
                                                                         tmp_path, capsys):
    """A resumed run lists the config keys that differ from the checkpoint's; a change of the
    model or of the data order is refused naming the key (in one line, no traceback, even when
    only the stored parameter shapes disagree), the rest is allowed, and overrides may follow
    `--resume`."""
    ckpt = tmp_path / "ckpt"
    common = ["--config", "configs/tiny.yaml", *tiny_overrides(few_groups_file, **{
        "run.steps": 2, "data.trees_per_step": 2, "data.micro_batches": 1,
        "checkpoint.dir": ckpt, "checkpoint.every": 2})]
    assert main(common) == 0
    capsys.readouterr()

    for key, value in (("data.seq_len", 256), ("run.seed", 1)):
        assert main([*common, "--resume", f"{key}={value}"]) == 2
        out, err = capsys.readouterr()
        assert f"--resume: {key} changed from " in out and "refused" in out
        assert err.startswith("python -m jtree.launch.train: error: ValueError: checkpoint ")
        assert f"{key} (" in err and "Traceback" not in err

    log = tmp_path / "hidden"
    code, out, err = finish(launch([*common, "--resume", "model.hidden_size=64"], log), log)
    assert code == 2
    assert "--resume: model.hidden_size changed from 32 to 64: refused" in out
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "model.hidden_size (32 -> 64): it changes the model" in err

    # The stored config agrees, the stored parameters do not: refused before Orbax restores. The
    # edited metadata is sealed again (`write_manifest`), or the checksum check would call it damage.
    meta = ckpt / "2" / "meta" / "metadata"
    saved = json.loads(meta.read_text())
    saved["config"]["model.hidden_size"] = 64
    meta.write_text(json.dumps(saved))
    write_manifest(ckpt / "2")
    log = tmp_path / "shapes"
    code, out, err = finish(launch([*common, "--resume", "model.hidden_size=64"], log), log)
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err, err[-3000:]
    assert "embed_tokens/embedding/value has shape (64, 32), the model wants (64, 64)" in err
    saved["config"]["model.hidden_size"] = 32
    meta.write_text(json.dumps(saved))
    write_manifest(ckpt / "2")

    from jtree.cli import main as jtree  # export-hf checks the stored shapes the same way

    assert jtree(["export-hf", "--config", "configs/tiny.yaml", "--checkpoint", str(ckpt),
                  "--out", str(tmp_path / "hf"), *common[2:], "model.hidden_size=64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jtree export-hf: error: ValueError: checkpoint ") and "Traceback" not in err
    assert "embed_tokens/embedding/value has shape (64, 32), the model wants (64, 64)" in err

    assert main([*common, "--resume", "run.steps=3", "optim.learning_rate=0.005"]) == 0
    out = capsys.readouterr().out
    assert "--resume: optim.learning_rate changed from 0.01 to 0.005: allowed" in out
    assert "--resume: run.steps changed from 2 to 3: allowed" in out
    assert "resumed from checkpoint" in out and re.search(r"^step +2/\d+ +loss", out, re.M)
