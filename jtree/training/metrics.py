"""Per-step metrics: a JSON Lines file and, optionally, TensorBoard scalars and a Weights & Biases
run.

Only process 0 writes. On resume, records of steps at or after the resume point (written by the
interrupted run after its last checkpoint) are dropped first, so the file reads as one run. A W&B
run's history only grows: the steps the interrupted run logged after its last checkpoint stay as
it logged them, and W&B drops the resumed run's records of those steps (the same values when the
resume is exact).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax

from jtree.config import TrainConfig, config_values


@dataclasses.dataclass(frozen=True)
class WandbRun:
    """The W&B run a `MetricsLog` logs to (`run.wandb_*`, `jtree.config.run.RunConfig`):
    `project`, the run's `name`, `mode` (None: `WANDB_MODE`, else online), `dir` (None: W&B's
    default), `id` (an existing run's id continues that run; None: a new run) and the `config`
    shown with it."""

    project: str
    name: str | None = None
    mode: str | None = None
    dir: str | None = None
    id: str | None = None
    config: dict[str, Any] = dataclasses.field(default_factory=dict)


def _scalars(record: dict[str, Any]) -> dict[str, int | float]:
    """The fields of a step record that are plotted: the numbers (a string such as the automatic
    mode is not a scalar), the step itself being the x axis."""
    return {key: value for key, value in record.items()
            if key != "step" and isinstance(value, (int, float))}


class MetricsLog:
    def __init__(self, jsonl_path: str | None, tensorboard_dir: str | None, *,
                 first_step: int = 0, enabled: bool = True, wandb: WandbRun | None = None):
        self._file = None
        self._tb = None
        self._wandb = None
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
        if wandb is not None:
            self._wandb = _wandb_init(wandb)

    @classmethod
    def of_run(cls, cfg: TrainConfig, first_step: int) -> MetricsLog:
        """The outputs `cfg.run` names (`run.metrics_jsonl`, `run.tensorboard_dir`,
        `run.wandb_*`), written by process 0, for a run whose first step is `first_step`."""
        run = cfg.run
        wandb = None if run.wandb_project is None else WandbRun(
            run.wandb_project, run.wandb_name, run.wandb_mode, run.wandb_dir, run.wandb_id,
            config_values(cfg))
        return cls(run.metrics_jsonl, run.tensorboard_dir, first_step=first_step,
                   enabled=jax.process_index() == 0, wandb=wandb)

    @property
    def wandb_id(self) -> str | None:
        """The id of the W&B run this log writes to (None without one): what a checkpoint
        stores so that a resumed run continues it."""
        return None if self._wandb is None else self._wandb.id

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._tb is not None:
            for key, value in _scalars(record).items():
                self._tb.add_scalar(key, value, record["step"])
        if self._wandb is not None:
            self._wandb.log(_scalars(record), step=record["step"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _wandb_init(target: WandbRun) -> Any:
    """Start (or, with `target.id`, continue) the W&B run; the package is optional."""
    try:
        import wandb
    except ImportError:
        raise ValueError("run.wandb_project: needs the wandb package "
                         "(pip install 'jtree[wandb]')") from None
    if target.dir is not None:
        Path(target.dir).mkdir(parents=True, exist_ok=True)
    return wandb.init(project=target.project, name=target.name, mode=target.mode,
                      dir=target.dir, id=target.id, resume="allow" if target.id else None,
                      config=target.config)
