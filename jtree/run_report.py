"""What a training run reports: one record per step (the metrics JSONL and TensorBoard), the
progress line printed for it, and the closing summary. Printing happens on process 0 only, so a
multi-process run prints each line once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np


def say(*args: Any) -> None:
    """Print on process 0 only."""
    if jax.process_index() == 0:
        print(*args, flush=True)


def step_record(step: int, metrics: dict[str, float], info: dict[str, Any], host_s: float,
                device_s: float, lr: float) -> dict[str, Any]:
    """One JSONL record: step metrics plus throughput and sharing numbers of the global batch.
    POR counts the trees' sharing, ERR what was really computed (parts of trees larger than a
    row recompute their shared prefixes; the baseline computes every path)."""
    n_tree, n_flat = int(info["n_tree_tokens"]), int(info["n_flat_tokens"])
    n_computed = int(info["n_computed_tokens"])
    if "mode" in info:  # the automatic mode choice of this step
        metrics = dict(metrics, mode=str(info["mode"]),
                       predicted_gain=float(info["predicted_gain"]))
    return dict(
        metrics, step=step, learning_rate=lr, n_trees=int(info["n_trees"]),
        n_tree_tokens=n_tree, n_flat_tokens=n_flat, n_computed_tokens=n_computed,
        por=1 - n_tree / n_flat,
        err=1 - n_computed / n_flat, tokens_per_s=n_flat / device_s,
        tree_tokens_per_s=n_computed / device_s, host_s=host_s, device_s=device_s,
    )


def progress_line(r: dict[str, Any]) -> str:
    """The printed line of a `step_record`: baseline-equivalent tokens/s counts every path token
    (what a per-path trainer would have to process), tree tokens/s what was really computed."""
    return (f"step {r['step']:4d}  loss {r['loss']:8.4f}  grad_norm {r['grad_norm']:7.3f}  "
            f"tokens/s {r['tokens_per_s']:9.0f} (baseline-equivalent)  "
            f"tree tokens/s {r['tree_tokens_per_s']:9.0f}  POR {r['por']:.3f}  ERR {r['err']:.3f}  "
            f"host {r['host_s'] * 1e3:6.1f} ms  device {r['device_s'] * 1e3:7.1f} ms")


def summary(history: list[dict[str, Any]], wall: float, n_bad: int,
            checkpoint_dir: Path | None) -> str:
    """The closing line of a run. Medians leave out the first step, which includes compiling."""
    if not history:
        return "summary: no steps to run"
    steady = history[1:] or history
    return (f"summary: steps {history[0]['step']}-{history[-1]['step']} in {wall:.1f} s; final "
            f"loss {history[-1]['loss']:.4f}; median baseline-equivalent tokens/s "
            f"{np.median([r['tokens_per_s'] for r in steady]):.0f}, device "
            f"{np.median([r['device_s'] for r in steady]) * 1e3:.1f} ms/step, host "
            f"{np.median([r['host_s'] for r in steady]) * 1e3:.1f} ms/step (excluding the first "
            f"step); bad records skipped {n_bad}"
            + (f"; checkpoints in {checkpoint_dir}" if checkpoint_dir is not None else ""))
