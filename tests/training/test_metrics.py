"""The metrics log: JSON Lines that read as one run across a resume, and TensorBoard scalars
that a TensorBoard reader sees (event files parsed record by record, not just listed)."""

import json
import struct

import pytest

from jtree.training.metrics import MetricsLog


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
