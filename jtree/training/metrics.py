"""Per-step metrics: a JSON Lines file and, optionally, TensorBoard scalars.

Only process 0 writes. On resume, records of steps at or after the resume point (written by the
interrupted run after its last checkpoint) are dropped first, so the file reads as one run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class MetricsLog:
    def __init__(self, jsonl_path: str | None, tensorboard_dir: str | None, *,
                 first_step: int = 0, enabled: bool = True):
        self._file = None
        self._tb = None
        if not enabled:
            return
        if jsonl_path is not None:
            path = Path(jsonl_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            kept = []
            if first_step > 0 and path.exists():
                kept = [line for line in path.read_text().splitlines()
                        if line.strip() and json.loads(line).get("step", -1) < first_step]
            self._file = open(path, "w")
            self._file.writelines(line + "\n" for line in kept)
            self._file.flush()
        if tensorboard_dir is not None:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                raise ValueError("run.tensorboard_dir: needs the tensorboardX package "
                                 "(pip install tensorboardX)") from None
            self._tb = SummaryWriter(tensorboard_dir)

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
