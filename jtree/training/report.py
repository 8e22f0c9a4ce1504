"""What a training run reports: one record per step (the metrics JSONL and TensorBoard), the
progress line printed for it, and the closing summary. Printing happens on process 0 only, so a
multi-process run prints each line once."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jtree.config.objective import Objective
from jtree.training.compile_log import Compiles


def say(*args: Any) -> None:
    """Print on process 0 only."""
    if jax.process_index() == 0:
        print(*args, flush=True)


@contextlib.contextmanager
def progress(label: str, after: float = 5.0, every: float = 10.0) -> Iterator[None]:
    """Around work that may take long (loading a dataset, building its steps): once it has run
    `after` seconds, say `label: N s so far` every `every` seconds and, at the end, how long it
    took; quick work stays silent."""
    done = threading.Event()
    t0 = time.perf_counter()

    def tick() -> None:
        wait = after
        while not done.wait(wait):
            say(f"{label}: {time.perf_counter() - t0:.0f} s so far")
            wait = every

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        elapsed = time.perf_counter() - t0
        if elapsed >= after:
            say(f"{label}: done in {elapsed:.1f} s")


class _Say(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        say(self.format(record))


@contextlib.contextmanager
def kernel_choices_said() -> Iterator[None]:
    """Print the kernel dispatch's log lines while a run trains: which kernel `auto` runs for each
    shape class, with the times it measured or read, said once per class."""
    logger, handler = logging.getLogger("jtree.kernels.tree_attention"), _Say()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def learned_means(objective: Objective) -> tuple[str, ...]:
    """The means of a step's info (`jtree.training.step_builders.signal_means`) that describe
    what `objective` learns from, for its step records: the reward for the RL objectives, the
    advantage when the trees carry the one the loss uses (`Objective.advantage_estimator`; a
    critic's GAE advantages are formed on the device, and the records' own would mislead). SFT
    learns from neither, whatever its records carry."""
    if objective.kind == "sft":
        return ()
    host_advantages = objective.advantage_estimator is not None
    return ("reward_mean",) + (("advantage_mean",) if host_advantages else ())


def step_record(step: int, metrics: dict[str, float], info: dict[str, Any], host_s: float,
                device_s: float, compiles: Compiles, lr: float, means: Sequence[str] = ()
                ) -> dict[str, Any]:
    """One JSONL record: step metrics plus throughput and sharing numbers of the global batch.
    POR counts the trees' sharing, ERR what was really computed (parts of trees larger than a
    row recompute their shared prefixes; the baseline computes every path). `device_s` leaves
    out the step's `compiles` (`compiles`, `compile_s`), so tokens/s measures the step, not
    XLA. With the off-policy weights the step's metrics carry their gauges (from the device)
    and the record adds the trees' `offpolicy_behavior_disagreement` (from the host); with
    routing replay it adds `routing_disagreement`, `routing_coverage` and
    `routing_disagreeing_tokens` (from the host, `jtree.training.step_builders.routing_info`).
    `means`: the info's reward and advantage means the record carries (`learned_means`; those
    the step's info has)."""
    n_tree, n_flat = int(info["n_tree_tokens"]), int(info["n_flat_tokens"])
    n_computed = int(info["n_computed_tokens"])
    if "mode" in info:  # the automatic mode choice of this step
        metrics = dict(metrics, mode=str(info["mode"]),
                       predicted_gain=float(info["predicted_gain"]))
    if "offpolicy_behavior_disagreement" in info:
        metrics = dict(metrics, offpolicy_behavior_disagreement=float(
            info["offpolicy_behavior_disagreement"]))
    if "routing_disagreement" in info:  # routing replay's gauges (jtree.layout.routing)
        metrics = dict(metrics, routing_disagreement=float(info["routing_disagreement"]),
                       routing_coverage=float(info["routing_coverage"]),
                       routing_disagreeing_tokens=int(info["routing_disagreeing_tokens"]))
    metrics = dict(metrics, **{key: float(info[key]) for key in means if key in info})
    return dict(
        metrics, step=step, learning_rate=lr, n_trees=int(info["n_trees"]),
        n_tree_tokens=n_tree, n_flat_tokens=n_flat, n_computed_tokens=n_computed,
        n_pruned_tokens=int(info["n_pruned_tokens"]),
        n_computed_pairs=int(info.get("n_computed_pairs", 0)),
        n_scored_tokens=int(info.get("n_scored_tokens", 0)),
        n_merge_saved_tokens=int(info.get("n_merge_saved_tokens", 0)),  # 0: nothing merged
        por=1 - n_tree / n_flat,
        err=1 - n_computed / n_flat, tokens_per_s=n_flat / device_s,
        tree_tokens_per_s=n_computed / device_s, host_s=host_s, device_s=device_s,
        compiles=compiles.n, compile_s=compiles.seconds,
    )


LOG_LEGEND = (
    "reading the log: step i/N; tokens/s counts every path token (what training each path on its "
    "own would process: baseline-equivalent), tree tokens/s the tokens really computed; POR: the "
    "share of path tokens that repeat a shared prefix; ERR: the share the step did not compute "
    "(POR, less what partitioning recomputes); device time leaves out compiles; eta: the steps "
    "left at the median step time so far")


def warmup_notice(warmup_steps: int, steps: int) -> str:
    """The line said at the start of a run that ends inside its learning-rate warmup
    (`optim.warmup_steps` > `run.steps`): every step trains below `optim.learning_rate`, which
    nothing else on the console shows (`jtree.step.optimizer.make_schedule`: the last step runs at
    steps / warmup_steps of the peak). Empty when the warmup fits."""
    if warmup_steps <= steps:
        return ""
    return (f"note: optim.warmup_steps {warmup_steps} > run.steps {steps}: the run ends inside "
            f"its warmup, its last step at {steps / warmup_steps:.0%} of optim.learning_rate")


# The RL metrics of the step said on the console line, as they are named in its record.
# The objectives' own metrics a step line shows when the step has them: RL's, and the
# multi-token-prediction loss (`objective.mtp_weight`).
OBJECTIVE_FIELDS = (("clip_frac", "clip", ".3f"), ("approx_kl_old", "kl_old", ".2e"),
                    ("kl_ref", "kl_ref", ".2e"), ("entropy", "entropy", ".3f"),
                    ("reward_mean", "reward", ".3f"), ("advantage_mean", "adv", ".3f"),
                    ("mtp_nll", "mtp_nll", ".4f"))


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(round(seconds)), 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{s:02d}s"


def eta_seconds(history: list[dict[str, Any]], steps_left: int) -> float:
    """The time the `steps_left` steps take at the median host + device time of the steps so far
    that did not compile (all of them when every one did)."""
    steady = [r for r in history if not r["compiles"]] or history
    return steps_left * float(np.median([r["host_s"] + r["device_s"] for r in steady]))


def progress_line(r: dict[str, Any], total: int, eta_s: float | None = None) -> str:
    """The printed line of a `step_record` (`LOG_LEGEND` says how to read it), step `r['step']`
    of `total`; the objectives' metrics (`OBJECTIVE_FIELDS`) follow the loss."""
    rl = "".join(f"  {label} {r[key]:{spec}}" for key, label, spec in OBJECTIVE_FIELDS
                 if key in r)
    return (f"step {r['step']:4d}/{total}  loss {r['loss']:8.4f}  grad_norm {r['grad_norm']:7.3f}"
            f"{rl}  tokens/s {r['tokens_per_s']:9.0f}  "
            f"tree tokens/s {r['tree_tokens_per_s']:9.0f}  POR {r['por']:.3f}  ERR {r['err']:.3f}  "
            f"host {r['host_s'] * 1e3:6.1f} ms  device {r['device_s'] * 1e3:7.1f} ms"
            + (f"  compile {r['compile_s']:.1f} s" if r["compiles"] else "")
            + (f"  eta {_duration(eta_s)}" if eta_s is not None else ""))


def _pruned(history: list[dict[str, Any]]) -> str:
    """The summary's account of zero-gradient pruning (empty when it left nothing out)."""
    saved = sum(r["n_pruned_tokens"] for r in history)
    if not saved:
        return ""
    total = sum(r["n_tree_tokens"] for r in history)
    return (f"; pruned {saved} zero-gradient tree tokens of {total} "
            f"({saved / max(total, 1):.1%}, mean {saved / len(history):.0f} per step)")


def _merged(history: list[dict[str, Any]]) -> str:
    """The summary's account of cross-group prefix sharing (empty when it saved nothing; a
    record without the count saved nothing)."""
    saved = sum(r.get("n_merge_saved_tokens", 0) for r in history)
    if not saved:
        return ""
    total = sum(r["n_tree_tokens"] for r in history)
    return (f"; merged across groups: {saved} tree tokens of {total} computed once instead of "
            f"once per group ({saved / max(total, 1):.1%}, mean {saved / len(history):.0f} per "
            "step)")


def _off_policy(history: list[dict[str, Any]]) -> str:
    """The summary's account of the off-policy weights (empty without them): the engine-vs-
    trainer KL and the corrected and masked fractions averaged over the steps, the largest
    disagreement."""
    if "offpolicy_kl_k3" not in history[-1]:
        return ""
    return (f"; off-policy: mean kl_k3 {np.mean([r['offpolicy_kl_k3'] for r in history]):.2e}, "
            f"corrected {np.mean([r['offpolicy_corrected_frac'] for r in history]):.1%} of "
            f"pairs, max behavior disagreement "
            f"{max(r['offpolicy_behavior_disagreement'] for r in history):.2e}, masked "
            f"{np.mean([r['offpolicy_masked_seq_frac'] for r in history]):.1%} of sequences")


def _routing(history: list[dict[str, Any]]) -> str:
    """The summary's account of routing replay (empty without it): the mean coverage and the
    largest disagreement over the steps."""
    if "routing_coverage" not in history[-1]:
        return ""
    coverage = np.mean([r["routing_coverage"] for r in history])
    return (f"; routing replay: mean coverage {coverage:.1%} of trained tokens, max disagreement "
            f"{max(r['routing_disagreement'] for r in history):.1%} of shared routed tokens")


def summary(history: list[dict[str, Any]], wall: float, n_bad: int,
            checkpoint_dir: Path | None, utilization: str = "") -> str:
    """The closing line of a run. Medians leave out the steps that compiled (their time is
    mostly XLA's, not the step's; with none left, they take every step); the compiles are
    reported apart. `utilization`: the run's model FLOP utilization, said as is
    (`jtree.training.utilization.run_utilization`)."""
    if not history:
        return "summary: no steps to run"
    compiled = [r for r in history if r["compiles"]]
    steady = [r for r in history if not r["compiles"]] or history
    return (f"summary: steps {history[0]['step']}-{history[-1]['step']} in {wall:.1f} s; final "
            f"loss {history[-1]['loss']:.4f}; median baseline-equivalent tokens/s "
            f"{np.median([r['tokens_per_s'] for r in steady]):.0f}, device "
            f"{np.median([r['device_s'] for r in steady]) * 1e3:.1f} ms/step, host "
            f"{np.median([r['host_s'] for r in steady]) * 1e3:.1f} ms/step (over "
            + (f"{len(steady)} step(s) without a compile" if len(compiled) < len(history)
               else "every step; each compiled") + "); compiles: "
            f"{sum(r['compiles'] for r in history)} in {len(compiled)} step(s), "
            f"{sum(r['compile_s'] for r in history):.1f} s; bad records skipped {n_bad}"
            + _pruned(history) + _merged(history) + _off_policy(history) + _routing(history)
            + (f"; utilization: {utilization}" if utilization else "")
            + (f"; checkpoints in {checkpoint_dir}" if checkpoint_dir is not None else ""))
