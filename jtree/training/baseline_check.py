"""The end-of-run check of `run.compare_baseline`: on step 0's trees, with the trained parameters,
the tree layout's log-probs equal the per-path baseline's (docs/design.md section 9), and the tree
step is timed against the baseline step. Both go through the run's own step function and step
builders (`jtree.training.run_data.StepBuilders`), so a trained mode's step is neither laid out nor compiled
a second time and the timings are those of the steps the run trains on."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np

from jtree.config import TrainConfig
from jtree.layout.baseline import linearize_baseline, unlinearize_baseline
from jtree.layout.batch import stack
from jtree.layout.linearize import linearize, unlinearize
from jtree.parallel.sharding import row_shards
from jtree.step.optimizer import TrainState
from jtree.training.report import say
from jtree.training.run_data import StepBuilders, gdn_chunk_size, replay_shape
from jtree.training.step_builders import step_indices, unit_routing
from jtree.trees.tree import TrajectoryTree

if TYPE_CHECKING:  # jtree.training.trainer calls this module at the end of a run
    from jtree.training.trainer import Trainer


def compare_with_baseline(cfg: TrainConfig, trainer: Trainer, builders: StepBuilders,
                          trees: Sequence[TrajectoryTree], state: TrainState) -> None:
    """Print the log-prob equivalence and the tree-vs-baseline speed on step 0's trees (those
    that fit one row whole). Single process: every data shard is this process's."""
    d = cfg.data
    indices = step_indices(len(trees), d.trees_per_step, d.shuffle_seed)[0]
    whole = [t for t in (trees[int(i)] for i in indices) if t.n_tree_tokens <= d.seq_len]
    check_equivalence(cfg, trainer, state, whole)
    time_tree_vs_baseline(cfg, trainer, builders, state, indices, whole)


def check_equivalence(cfg: TrainConfig, trainer: Trainer, state: TrainState,
                      trees: list[TrajectoryTree]) -> None:
    """Print max |tree log-prob - baseline log-prob| over every path token of `trees`, each
    laid out whole in one row (with routing replay, both replaying the paths' routing: paths
    that disagree on a shared token's routing differ there, docs/rl.md)."""
    mesh, seq_len = trainer.mesh, cfg.data.seq_len
    n_data = row_shards(mesh)

    def logprobs(batch) -> np.ndarray:
        arrays = stack([batch.inputs])
        return np.asarray(trainer.logprob_fn(state.params, trainer.place(arrays, n_data)))[0]

    def padded_rows(n: int) -> int:
        return -(-n // n_data) * n_data

    kw = dict(normalization=cfg.objective.normalization, gdn_chunk_size=gdn_chunk_size(cfg))
    tree_kw, base_kw = kw, kw
    replay = replay_shape(cfg)
    if replay is not None:  # routing replay: each path's routing, folded onto the tree
        routed = [unit_routing(t, replay) for t in trees]
        tree_kw = dict(kw, routed_experts=routed)
        base_kw = dict(kw, routed_experts=[[r] for rs in routed for r in rs])
    tree_b = linearize(trees, seq_len, **tree_kw)
    tree_b = linearize(trees, seq_len, n_rows=padded_rows(tree_b.shape[0]), **tree_kw)
    base_b = linearize_baseline(trees, seq_len, **base_kw)
    base_b = linearize_baseline(trees, seq_len, n_rows=padded_rows(base_b.shape[0]), **base_kw)
    lp_tree = unlinearize(tree_b, logprobs(tree_b))
    lp_base = unlinearize_baseline(base_b, logprobs(base_b), trees)
    diff = max(float(np.max(np.abs(a - b))) for ta, tb in zip(lp_tree, lp_base)
               for a, b in zip(ta, tb))
    say(f"equivalence: max |tree log-prob - baseline log-prob| over all path tokens = {diff:.2e}")


def time_tree_vs_baseline(cfg: TrainConfig, trainer: Trainer, builders: StepBuilders,
                          state: TrainState, indices: np.ndarray,
                          trees: list[TrajectoryTree]) -> None:
    """Time the train step on the step of `indices` laid out as trees and as paths by the run's
    builders (each mode at the shape that holds every step of the run), alternating, and print
    the medians and the speedup against the token bound of `trees`."""
    repeats, n_data = cfg.run.timing_repeats, row_shards(trainer.mesh)
    inputs = {mode: trainer.place(builders[mode](indices)["inputs"], n_data)
              for mode in ("tree", "baseline")}
    for mode in inputs:  # compile both before timing
        state, metrics = trainer.step_fn(state, inputs[mode])
        jax.block_until_ready(metrics)
    times: dict[str, list[float]] = {"tree": [], "baseline": []}
    for _ in range(repeats):
        for mode in inputs:
            t0 = time.perf_counter()
            state, metrics = trainer.step_fn(state, inputs[mode])
            jax.block_until_ready(metrics)
            times[mode].append(time.perf_counter() - t0)
    t_tree, t_base = np.median(times["tree"]), np.median(times["baseline"])
    stats = sum((t.stats() for t in trees[1:]), trees[0].stats())
    shape = {m: "x".join(str(s) for s in inputs[m].shape) for m in inputs}
    say(f"speed: tree step {t_tree * 1e3:.1f} ms (micro-batches x rows x S = {shape['tree']}), "
        f"baseline step {t_base * 1e3:.1f} ms ({shape['baseline']}); speedup "
        f"{t_base / t_tree:.2f}x (token bound 1/(1-POR) = {1 / (1 - stats.por):.2f}x, "
        f"medians of {repeats} alternating runs)"
        + ("; above the token bound because the baseline also pays for its padding and for "
           "attention over longer rows, which the token count leaves out"
           if t_base / t_tree > 1 / (1 - stats.por) else ""))
