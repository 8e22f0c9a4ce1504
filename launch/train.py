"""Train a model on trees from a JSONL file: `python -m launch.train --config configs/tiny.yaml`.

Prints one line per step (loss, tokens/s, POR). With `run.compare_baseline`, it finishes by
checking tree-vs-baseline log-prob equivalence with the trained parameters and timing the tree step
against the per-path baseline step on the same trees (alternating, medians).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import jax
import numpy as np

from jtree.baseline import unlinearize_baseline
from jtree.config import TrainConfig, load_config
from jtree.linearize import TreeBatch, unlinearize
from jtree.loss import batch_normalizer
from jtree.models import create_model
from jtree.train import (
    build_batch,
    init_train_state,
    make_logprob_fn,
    make_optimizer,
    make_train_step,
    needs_old_logprobs,
    stack_microbatches,
)
from jtree.tree import TrajectoryTree
from jtree.tree_jsonl import read_sequence_groups, read_trees


def load_trees(cfg: TrainConfig) -> list[TrajectoryTree]:
    reader = read_sequence_groups if cfg.data.format == "groups" else read_trees
    return reader(cfg.data.path, vocab_size=cfg.model.vocab_size)


def step_batches(cfg: TrainConfig, trees: Sequence[TrajectoryTree], mode: str, step: int,
                 n_rows: int | None = None):
    """The trees of `step` as equally shaped micro-batches, the chosen trees, and the host
    preparation time. Rows per micro-batch: `n_rows`, else the config's, else as few as fit."""
    d = cfg.data
    order = np.random.default_rng(d.shuffle_seed + step // max(1, len(trees) // d.trees_per_step))
    perm = order.permutation(len(trees))
    start = (step * d.trees_per_step) % len(trees)
    chosen = [trees[i] for i in np.roll(perm, -start)[: d.trees_per_step]]
    per_micro = np.array_split(np.arange(len(chosen)), d.micro_batches)
    t0 = time.perf_counter()
    normalizer = batch_normalizer(chosen, cfg.objective.normalization)

    def build(rows: int | None) -> list[TreeBatch]:
        return [build_batch([chosen[i] for i in idx], d.seq_len, mode=mode,
                            normalization=cfg.objective.normalization, normalizer=normalizer,
                            n_rows=rows)
                for idx in per_micro]

    batches = build(n_rows or d.rows_per_micro_batch)
    rows = {b.shape[0] for b in batches}
    if len(rows) > 1:
        batches = build(max(rows))
    return batches, chosen, time.perf_counter() - t0


def rows_needed(cfg: TrainConfig, trees: Sequence[TrajectoryTree], mode: str) -> int:
    """The most rows any step's micro-batch needs, so every step has one shape (one compile)."""
    if cfg.data.rows_per_micro_batch is not None:
        return cfg.data.rows_per_micro_batch
    return max(step_batches(cfg, trees, mode, s)[0][0].shape[0] for s in range(cfg.run.steps))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default=None, help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    if cfg.data.trees_per_step % cfg.data.micro_batches:
        raise ValueError("data.trees_per_step must be a multiple of data.micro_batches")

    trees = load_trees(cfg)
    total = sum((t.stats() for t in trees[1:]), trees[0].stats())
    print(f"data: {len(trees)} trees from {cfg.data.path}: {total.n_flat_tokens} flat tokens, "
          f"{total.n_tree_tokens} tree tokens, POR {total.por:.3f}")
    model = create_model("qwen3", cfg.model, seed=cfg.run.seed)
    optimizer = make_optimizer(cfg.optim)
    graphdef, state = init_train_state(model, optimizer)
    step_fn = jax.jit(make_train_step(graphdef, optimizer, cfg.objective))
    logprob_fn = jax.jit(make_logprob_fn(graphdef, cfg.objective.logprob_chunk))
    print(f"model: Qwen3 {cfg.model.num_hidden_layers} layers, hidden {cfg.model.hidden_size}, "
          f"{sum(x.size for x in jax.tree_util.tree_leaves(state.params)):,} parameters; "
          f"mode {cfg.run.mode}, objective {cfg.objective.kind}, backend {jax.default_backend()}")

    n_rows = rows_needed(cfg, trees, cfg.run.mode)
    for step in range(cfg.run.steps):
        batches, chosen, host_s = step_batches(cfg, trees, cfg.run.mode, step, n_rows)
        inputs = stack_microbatches(batches)
        if any(needs_old_logprobs(b, cfg.objective) for b in batches):
            inputs["old_logprobs"] = np.stack(
                [np.asarray(logprob_fn(state.params, b.arrays())) for b in batches])
        t0 = time.perf_counter()
        state, metrics = step_fn(state, inputs)
        loss = float(metrics["loss"])
        dev_s = time.perf_counter() - t0
        stats = sum((t.stats() for t in chosen[1:]), chosen[0].stats())
        if step % cfg.run.log_every == 0 or step == cfg.run.steps - 1:
            print(f"step {step:4d}  loss {loss:8.4f}  grad_norm {float(metrics['grad_norm']):7.3f}  "
                  f"tokens/s {stats.n_flat_tokens / dev_s:9.0f} (flat-equivalent)  "
                  f"tree tokens/s {stats.n_tree_tokens / dev_s:9.0f}  POR {stats.por:.3f}  "
                  f"host {host_s * 1e3:6.1f} ms  device {dev_s * 1e3:7.1f} ms"
                  + ("  (includes compile)" if step == 0 else ""))
    if cfg.run.compare_baseline:
        compare_with_baseline(cfg, trees, graphdef, state, step_fn, logprob_fn, optimizer)
    return 0


def compare_with_baseline(cfg, trees, graphdef, state, step_fn, logprob_fn, optimizer) -> None:
    """Equivalence of log-probs and the speed of tree vs baseline steps, on step 0's trees."""
    tree_batches, chosen, _ = step_batches(cfg, trees, "tree", 0)
    base_batches, _, _ = step_batches(cfg, trees, "baseline", 0)
    diff = max(
        _max_logprob_diff(logprob_fn, state.params, tb, bb, [chosen[i] for i in idx])
        for tb, bb, idx in zip(tree_batches, base_batches,
                               np.array_split(np.arange(len(chosen)), cfg.data.micro_batches))
    )
    print(f"equivalence: max |tree log-prob - baseline log-prob| over all path tokens = {diff:.2e}")
    tree_in, base_in = stack_microbatches(tree_batches), stack_microbatches(base_batches)
    for inputs in (tree_in, base_in):  # compile both before timing
        jax.block_until_ready(step_fn(state, inputs))
    times: dict[str, list[float]] = {"tree": [], "baseline": []}
    for _ in range(cfg.run.timing_repeats):
        for name, inputs in (("tree", tree_in), ("baseline", base_in)):
            t0 = time.perf_counter()
            jax.block_until_ready(step_fn(state, inputs))
            times[name].append(time.perf_counter() - t0)
    t_tree, t_base = np.median(times["tree"]), np.median(times["baseline"])
    stats = sum((t.stats() for t in chosen[1:]), chosen[0].stats())
    print(f"speed: tree step {t_tree * 1e3:.1f} ms ({tree_in['tokens'].shape[1]} rows x "
          f"{tree_in['tokens'].shape[2]}), baseline step {t_base * 1e3:.1f} ms "
          f"({base_in['tokens'].shape[1]} rows x {base_in['tokens'].shape[2]}); speedup "
          f"{t_base / t_tree:.2f}x (token bound 1/(1-POR) = {1 / (1 - stats.por):.2f}x, "
          f"medians of {cfg.run.timing_repeats} alternating runs)")


def _max_logprob_diff(logprob_fn, params, tree_batch: TreeBatch, base_batch: TreeBatch,
                      trees: Sequence[TrajectoryTree]) -> float:
    lp_tree = unlinearize(tree_batch, np.asarray(logprob_fn(params, tree_batch.arrays())))
    lp_base = unlinearize_baseline(base_batch, np.asarray(logprob_fn(params, base_batch.arrays())),
                                   trees)
    return max(float(np.max(np.abs(a - b))) for ta, tb in zip(lp_tree, lp_base)
               for a, b in zip(ta, tb))


if __name__ == "__main__":
    sys.exit(main())
