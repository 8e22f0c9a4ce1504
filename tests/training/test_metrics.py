"""The metrics log: JSON Lines that read as one run across a resume, and TensorBoard scalars and
Weights & Biases history that their readers see (event files and the offline run's transaction
log parsed record by record, not just listed)."""

import json
import struct
import sys

import pytest

from jtree.launch.train import main
from jtree.training.metrics import MetricsLog, WandbRun
from tests.run_util import read_metrics, tiny_overrides


def tensorboard_scalars(directory) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} from the TFRecord event files in `directory`."""
    from tensorboardX.proto.event_pb2 import Event

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4  # length, its CRC, the record, its CRC
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def wandb_offline_runs(directory) -> list[tuple[str, dict[int, dict[str, float]]]]:
    """(run id, {step: {key: value}}) of each offline W&B run under `directory`, oldest first,
    from its `.wandb` transaction log: a LevelDB-style log (a 7-byte header ':W&B', magic,
    version; 32 KiB blocks of chunks, each a 7-byte header of CRC, length and type: 1 full,
    2 first, 3 middle, 4 last; a block's tail shorter than a header is padding) of `Record`
    protobufs, whose `history` records hold a step's values as JSON. W&B's service writes the
    log after `finish()` returns; it is whole once the service has stopped (`wandb.teardown`)."""
    import wandb
    from wandb.proto.wandb_internal_pb2 import Record

    wandb.teardown()

    runs = []
    for path in sorted(directory.glob("wandb/offline-run-*/run-*.wandb")):
        data = path.read_bytes()
        assert data[:4] == b":W&B"
        offset, pending, run_id, history = 7, b"", None, {}
        while offset + 7 <= len(data):
            if 32768 - offset % 32768 < 7:
                offset += 32768 - offset % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[offset:offset + 7])
            pending = (b"" if kind in (1, 2) else pending) + data[offset + 7:offset + 7 + length]
            offset += 7 + length
            if kind not in (1, 4):
                continue
            record = Record.FromString(pending)
            if record.HasField("run"):
                run_id = record.run.run_id
            if record.HasField("history"):
                values = {".".join(item.nested_key) or item.key: json.loads(item.value_json)
                          for item in record.history.item}
                history[record.history.step.num] = {
                    k: v for k, v in values.items() if not k.startswith("_")}
        runs.append((run_id, history))
    return runs


def test_jsonl_drops_the_interrupted_steps_on_resume(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    log = MetricsLog(str(path), None)
    for step in range(5):
        log.write({"step": step, "loss": 1.0 / (step + 1)})
    log.close()
    resumed = MetricsLog(str(path), None, first_step=3)  # the checkpoint was at step 3
    resumed.write({"step": 3, "loss": 0.5})
    resumed.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[3]["loss"] == 0.5 and records[2]["loss"] == pytest.approx(1 / 3)


def test_tensorboard_gets_every_numeric_field_per_step(tmp_path):
    log = MetricsLog(None, str(tmp_path / "tb"))
    for step in range(3):
        log.write({"step": step, "loss": 2.0 - step, "por": 0.25, "mode": "tree"})
    log.close()
    scalars = tensorboard_scalars(tmp_path / "tb")
    assert set(scalars) == {"loss", "por"}  # strings are not scalars; the step is the x axis
    assert scalars["loss"] == [(0, 2.0), (1, 1.0), (2, 0.0)]
    assert scalars["por"] == [(s, 0.25) for s in range(3)]


def test_processes_other_than_the_first_write_nothing(tmp_path):
    log = MetricsLog(str(tmp_path / "m.jsonl"), str(tmp_path / "tb"), enabled=False)
    log.write({"step": 0, "loss": 1.0})
    log.close()
    assert not (tmp_path / "m.jsonl").exists() and not (tmp_path / "tb").exists()


def test_wandb_offline_run_logs_every_numeric_field_per_step_and_resumes(tmp_path,
                                                                         monkeypatch):
    """W&B (WANDB_MODE=offline, as `run.wandb_mode` unset reads it): the offline run's history
    holds, step by step, the numeric fields of the JSONL records; a log given the run's id
    continues that run."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    target = WandbRun("jtree-test", name="tiny", dir=str(tmp_path), config={"run.steps": 3})
    log = MetricsLog(str(tmp_path / "m.jsonl"), None, wandb=target)
    for step in range(2):
        log.write({"step": step, "loss": 2.0 - step / 3, "n_trees": 4, "mode": "tree"})
    run_id = log.wandb_id
    log.close()
    resumed = MetricsLog(str(tmp_path / "m.jsonl"), None, first_step=2,  # its own files
                         wandb=WandbRun("jtree-test", dir=str(tmp_path / "resumed"), id=run_id))
    resumed.write({"step": 2, "loss": 0.125, "n_trees": 4, "mode": "baseline"})
    resumed.close()
    (first, logged), (second, logged_resumed) = [
        *wandb_offline_runs(tmp_path), *wandb_offline_runs(tmp_path / "resumed")]
    assert first == second == run_id  # the resumed log continued the run
    logged.update(logged_resumed)
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert sorted(logged) == [r["step"] for r in records] == [0, 1, 2]
    for r in records:
        assert logged[r["step"]] == {k: v for k, v in r.items() if k not in ("step", "mode")}


def test_a_resumed_run_continues_its_wandb_run(few_groups_file, tmp_path, monkeypatch, capsys):
    """A run with `run.wandb_project` stores its W&B run's id with its checkpoints; `--resume`
    without the W&B settings continues that run, and the two offline runs' history is the
    metrics JSONL, step by step."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    args = ["--config", "configs/tiny.yaml", *tiny_overrides(few_groups_file, **{
        "checkpoint.dir": tmp_path / "ckpt", "checkpoint.every": 1,
        "run.metrics_jsonl": tmp_path / "m.jsonl"})]
    assert main([*args, "run.steps=2", "run.wandb_project=jtree-test",
                 f"run.wandb_dir={tmp_path / 'wb'}"]) == 0
    assert main([*args, "run.steps=3", "--resume"]) == 0
    assert "run.wandb_id kept from the checkpoint's run" in capsys.readouterr().out
    (first, logged), (second, resumed) = wandb_offline_runs(tmp_path / "wb")
    assert first == second and sorted(logged) == [0, 1] and sorted(resumed) == [2]
    logged.update(resumed)
    for r in read_metrics(tmp_path / "m.jsonl"):
        assert logged[r["step"]] == pytest.approx(
            {k: v for k, v in r.items() if k != "step" and isinstance(v, (int, float))})


def test_wandb_without_the_package_names_the_setting(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ValueError, match=r"^run.wandb_project: needs the wandb package"):
        MetricsLog(None, None, wandb=WandbRun("p", dir=str(tmp_path)))
