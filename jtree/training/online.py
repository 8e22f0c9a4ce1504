"""Training on trees built in Python, one step per call: a rollout loop that never writes a file.

`jtree train` reads every tree of a run from `data.path` before its first step, so that it can
shuffle them, size its rows for the whole run and checkpoint its data order. An RL loop that
samples, scores and trains in one process has the trees of one step at a time instead.
`OnlineTrainer` takes them: each `step(trees)` lays the given trees out as one global step with
the run's own step builders (tree, baseline or auto mode; the same planner, normalization and
objective as a file-fed run) and runs the run's own step function on them. The config supplies
everything else (model, mesh, objective, optimizer, checkpoints; `data.path` is not read).

Shapes: each step lays out only its own trees, so the sizes a file-fed run fixes for all its steps
(rows per micro-batch unless `data.rows_per_micro_batch` gives them, the score width, GDN chunks,
off-policy pairs) are rounded up to powers of two here, and row lengths come from
`data.row_steps_per_octave` (or are `data.seq_len`): the step compiles once per bucket, not once
per batch. A multi-process run passes every process the same trees (each lays out its own data
shards of the global step, as a file-fed run does).

    trainer = OnlineTrainer.create(load_config("configs/tiny_rl.yaml"))
    for batch in rollouts():                       # each: a list of TrajectoryTree
        record = trainer.step(batch)               # loss, grad norm, RL metrics, tokens/s, ...
    trainer.save()                                 # checkpoint.dir, step = trainer.steps_done
    trainer.close()
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jtree.config import TrainConfig
from jtree.layout.flop_model import FlopModel
from jtree.layout.pruning import prune_trees
from jtree.models.lora import trainable
from jtree.parallel.layer_stack import layer_groups
from jtree.parallel.sharding import row_shards
from jtree.step.batches import old_logprobs_stale
from jtree.step.optimizer import TrainState, make_schedule
from jtree.training.checkpoint import Checkpointer, abstract_like
from jtree.training.compile_log import CompileWatch
from jtree.training.metrics import MetricsLog
from jtree.training.report import learned_means, say, step_record
from jtree.training.run_data import (
    check_training_trees,
    gdn_chunk_size,
    host_data_shards,
    replay_shape,
    trained_modes,
)
from jtree.training.step_builders import AutoStepBuilder, step_builder
from jtree.training.trainer import Trainer
from jtree.training.tree_files import check_path_lengths
from jtree.trees.routed_experts import check_routing
from jtree.trees.tree import TrajectoryTree


def shape_bucket(n: int) -> int:
    """The power of two at or above `n` (at least 1): a size rounded up to it takes one of
    log2(n) values, so steps that differ in size share compiled programs."""
    return 1 << max(0, int(n) - 1).bit_length()


@dataclasses.dataclass
class OnlineTrainer:
    """A training run fed trees in process (`step`), with the run's model, mesh, objective,
    optimizer and checkpoints. `state` is the current `TrainState`; `history` the records of the
    steps run so far (what `jtree train` writes to `run.metrics_jsonl`, which this writes too)."""

    cfg: TrainConfig
    trainer: Trainer
    state: TrainState
    shards: tuple[int, ...]
    checkpointer: Checkpointer | None
    metrics_log: MetricsLog
    reference: Any = None
    teacher: Any = None
    compile_watch: CompileWatch = dataclasses.field(default_factory=CompileWatch)
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @classmethod
    def create(cls, cfg: TrainConfig, *, resume: bool = False) -> OnlineTrainer:
        """Build the run of `cfg` and its first state: fresh (random, or `model.init_from`), or
        with `resume` the latest checkpoint in `checkpoint.dir` (an error when there is none)."""
        if cfg.run.mode == "redundancy_free":
            raise ValueError("run.mode=redundancy_free: not available in process (OnlineTrainer "
                             "lays out rows: use run.mode=tree, baseline or auto)")
        trainer = Trainer.build(cfg)
        ckpt = None if cfg.checkpoint.dir is None else Checkpointer(
            cfg.checkpoint.dir, keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save)
        state = None
        if resume:
            if ckpt is None:
                raise ValueError("resume: checkpoint.dir is not set")
            restored = ckpt.restore_latest(
                abstract_like(jax.eval_shape(trainer.init_fn), trainer.shardings),
                on_corrupt=cfg.checkpoint.on_corrupt, log=say,
                layer_groups=layer_groups(cfg.model.config.decoder().layers))
            if restored is None:
                raise ValueError(f"resume: no checkpoint in {ckpt.directory}")
            state = restored.state
            say(f"resumed from {ckpt.where(restored.step)} (step {int(state.step)})")
        if state is None:
            state = trainer.initial_state()
        metrics_log = MetricsLog.of_run(cfg, int(state.step))
        reference = None if cfg.objective.reference is None else trainer.reference_params()
        teacher = None if trainer.teacher is None else trainer.teacher.params()
        return cls(cfg, trainer, state, host_data_shards(trainer.mesh), ckpt, metrics_log,
                   reference, teacher)

    @property
    def steps_done(self) -> int:
        """Optimizer steps taken (restored ones included)."""
        return int(self.state.step)

    @property
    def params(self) -> Any:
        """The trained parameters (with LoRA: the adapters only)."""
        return trainable(self.state.params)

    def step(self, trees: Sequence[TrajectoryTree]) -> dict[str, Any]:
        """One optimizer step on `trees`, all of them one global step (every group of the
        batch; advantages as the trees carry them, e.g. from `jtree.with_advantages`). Returns
        the step's record: its metrics, learning rate, token counts and times, compile time
        kept out of the step's device time."""
        cfg, trainer = self.cfg, self.trainer
        self.check(trees)
        t0 = time.perf_counter()
        element = self._builder(trees)(np.arange(len(trees)))
        info = element["info"]
        stale = old_logprobs_stale(bool(info["has_old_logprobs"]),
                                   float(info["old_logprob_disagreement"]), cfg.objective)
        with self.compile_watch:
            inputs = trainer.place(element["inputs"], len(self.shards))
            t1, before = time.perf_counter(), self.compile_watch.total
            step = self.steps_done
            self.state, metrics = trainer.train_on(self.state, inputs, old_logprobs_stale=stale,
                                                   engine_logprobs=bool(info["has_old_logprobs"]),
                                                   reference=self.reference,
                                                   teacher=self.teacher)
            metrics = {k: float(v) for k, v in metrics.items()}  # waits for the step
            device_s = time.perf_counter() - t1
            compiles = self.compile_watch.total - before
        record = step_record(step, metrics, info, t1 - t0, device_s - compiles.seconds,
                             compiles, float(make_schedule(cfg.optim)(step)),
                             learned_means(cfg.objective))
        self.history.append(record)
        self.metrics_log.write(record)
        return record

    def check(self, trees: Sequence[TrajectoryTree]) -> None:
        """Refuse trees this run cannot train on, naming the tree: none at all, a token outside
        the vocabulary, a path longer than a row (`data.seq_len`), routed experts that do not fit
        the model, or what the objective needs and they lack (`check_training_trees`)."""
        cfg = self.cfg
        if not trees:
            raise ValueError("trees: a step needs at least one tree")
        vocab = cfg.model.config.vocab_size
        replay = replay_shape(cfg)
        for i, tree in enumerate(trees):
            if not isinstance(tree, TrajectoryTree):
                raise TypeError(f"trees[{i}]: expected a TrajectoryTree, got "
                                 f"{type(tree).__name__}")
            if tree.tokens.size and int(tree.tokens.max()) >= vocab:
                raise ValueError(f"trees[{i}]: token id {int(tree.tokens.max())} is outside the "
                                 f"model's vocabulary of {vocab}")
            check_path_lengths(tree, [f"trees[{i}]"], None, cfg.data.seq_len)
            if replay is not None and tree.routed_experts is not None:
                for p, routed in enumerate(tree.routed_experts):
                    check_routing(routed, f"trees[{i}].routed_experts[path {p}]",
                                  num_experts=cfg.model.config.num_experts, layers=replay[0],
                                  top_k=replay[1])
        check_training_trees(cfg, trees, "trees")

    def _builder(self, trees: Sequence[TrajectoryTree]) -> Any:
        """The step builder of `run.mode` over `trees` as one step, its sizes bucketed."""
        cfg = self.cfg
        data = dataclasses.replace(cfg.data, trees_per_step=len(trees))
        pruned = (prune_trees(trees, cfg.objective,
                              bool(getattr(cfg.model.config, "output_router_logits", False)))
                  if cfg.data.prune_zero_gradient else None)
        builders = {mode: step_builder(
            trees, data, mode, normalization=cfg.objective.normalization,
            n_shards=row_shards(self.trainer.mesh), shards=self.shards, steps=1,
            gdn_chunk_size=gdn_chunk_size(cfg), critic=cfg.objective.critic is not None,
            off_policy=cfg.objective.off_policy.enabled, context=cfg.mesh.context,
            pruned=pruned, shared_masks=cfg.objective.kind == "gspo",
            routing=replay_shape(cfg), round_up=shape_bucket) for mode in trained_modes(cfg)}
        if cfg.run.mode != "auto":
            return builders[cfg.run.mode]
        return AutoStepBuilder(builders, FlopModel.for_config(cfg.model.config),
                               cfg.run.auto_min_gain)

    def save(self) -> None:
        """Checkpoint the state at `steps_done` into `checkpoint.dir`, for `create(...,
        resume=True)`. No data order is stored: the caller's rollout loop owns it."""
        if self.checkpointer is None:
            raise ValueError("save: checkpoint.dir is not set")
        self.checkpointer.save(self.steps_done, self.state, {}, self.trainer.run_meta())

    def close(self) -> None:
        """Wait for checkpoint writes and close the metrics files."""
        if self.checkpointer is not None:
            self.checkpointer.close()
        self.metrics_log.close()
