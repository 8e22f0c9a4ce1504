"""A training run of a `TrainConfig` on trees from JSONL, whichever entry point starts it
(`jtree train`, `python -m jtree.launch.train`).

`TrainingRun` adds to the `Trainer` what the trees determine: the step builders of each layout
mode (`StepBuilders`), the data pipeline and the checkpointer. It restores a checkpoint (data order
included; `jtree.training.resume` says which config keys may differ), trains with one record per
step (`jtree.training.report`), saves checkpoints (with the `run.kill_after_checkpoint` fault
injection the resume tests use), logs every compile of the step (`jtree.training.compile_log`;
compile time is kept out of tokens/s) and, with `run.compare_baseline`, checks tree-vs-baseline
log-prob equivalence with the trained parameters and times the tree step against the per-path
baseline step (`jtree.training.baseline_check`). `train` runs one config from start to summary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any, Literal

import jax
import numpy as np
from jax.experimental import multihost_utils

from jtree.config import TrainConfig
from jtree.config.architectures import attention_head_dims
from jtree.kernels.tree_attention import cpu_candidates, resolve_impl
from jtree.layout.batch import DeviceBatch
from jtree.models.lora import trainable
from jtree.parallel.layer_stack import layer_groups
from jtree.parallel.sharding import describe_mesh, row_shards
from jtree.step.batches import old_logprobs_stale
from jtree.step.optimizer import (
    TrainState,
    make_schedule,
)
from jtree.training.baseline_check import compare_with_baseline
from jtree.training.checkpoint import Checkpointer, abstract_like
from jtree.training.compile_log import Compiles, CompileWatch
from jtree.training.host_allocator import configure_host_malloc
from jtree.training.metrics import MetricsLog
from jtree.training.pipeline import make_pipeline
from jtree.training.report import (
    LOG_LEGEND,
    eta_seconds,
    kernel_choices_said,
    learned_means,
    progress,
    progress_line,
    say,
    step_record,
    summary,
    warmup_notice,
)
from jtree.training.resume import check_resumable
from jtree.training.run_data import (
    StepBuilders,
    host_data_shards,
    load_training_trees,
    run_step_builder,
    to_global,
)
from jtree.training.trainer import Trainer
from jtree.training.tree_files import LoadReport
from jtree.training.utilization import run_utilization
from jtree.trees.tree import TrajectoryTree

# How a run treats `checkpoint.dir`: "no" starts from scratch, "required" continues from its
# latest checkpoint (an error without one), "auto" continues when there is one (pod launchers).
Resume = Literal["no", "required", "auto"]
# Where a run writes its outputs: a resumed run that leaves them unset keeps the stored ones (the
# W&B run's id among them: a resumed run continues the W&B run).
RESUME_KEEPS_OUTPUTS = ("run.metrics_jsonl", "run.tensorboard_dir", "run.wandb_project",
                        "run.wandb_name", "run.wandb_dir", "run.wandb_id")


@dataclasses.dataclass
class TrainingRun:
    """One run of a config: its trees, step functions, step builders, data iterator and
    checkpointer (None without `checkpoint.dir`)."""

    cfg: TrainConfig
    trees: list[TrajectoryTree]
    load_report: LoadReport
    trainer: Trainer
    shards: tuple[int, ...]  # the data shards this process feeds
    builders: StepBuilders
    iterator: Any  # grain iterator: get_state / set_state carry the data order into checkpoints
    layout: str
    checkpointer: Checkpointer | None
    compile_watch: CompileWatch = dataclasses.field(default_factory=CompileWatch)
    compiled_shapes: set[tuple] = dataclasses.field(default_factory=set)
    reference: Any = None  # the reference model's parameters (objective.reference), on the mesh
    teacher: Any = None  # the distillation teacher's parameters (objective.distill), on the mesh
    # Set by SIGTERM (`preemption`): the loop saves at the next step boundary and stops.
    preempted: threading.Event = dataclasses.field(default_factory=threading.Event)
    saved_step: int | None = None  # the last step a checkpoint was saved at

    @classmethod
    def build(cls, cfg: TrainConfig) -> TrainingRun:
        """Load the trees, build the step functions, the step builders of the trained modes and
        the pipeline that feeds this process's data shards, and open `checkpoint.dir`."""
        with progress(f"loading {cfg.data.path}"):
            try:
                trees, report = load_training_trees(cfg)
            except FileNotFoundError as e:
                raise FileNotFoundError(f"data.path: no such file: {e.filename}") from None
        trainer = Trainer.build(cfg)
        shards = host_data_shards(trainer.mesh)
        with progress("laying out the steps (partitioning trees, sizing rows)"):
            builders = StepBuilders(cfg, trees, row_shards(trainer.mesh), shards)
            builder, layout = run_step_builder(cfg, trees, builders, trainer.mesh.devices.size)
        iterator = iter(make_pipeline(builder, seed=cfg.data.shuffle_seed,
                                      worker_count=cfg.data.worker_count))
        ckpt = None
        if cfg.checkpoint.dir is not None:
            ckpt = Checkpointer(cfg.checkpoint.dir, keep=cfg.checkpoint.keep,
                                async_save=cfg.checkpoint.async_save)
        return cls(cfg, trees, report, trainer, shards, builders, iterator, layout, ckpt)

    def restore(self, resume: Resume) -> tuple[TrainState, int]:
        """(state, first step): the latest checkpoint's, data order included, when resuming;
        a fresh state at step 0 when not, or with `resume="auto"` when `checkpoint.dir` holds no
        checkpoint (what a pod launcher that restarts preempted jobs wants). `resume="required"`
        without a checkpoint is an error: a mistyped directory must not silently start over.
        Loads the reference model of `objective.reference` and the teacher of
        `objective.distill` too (their weights do not depend on the checkpoint)."""
        if self.cfg.objective.reference is not None:
            with progress(f"loading the reference model ({self.cfg.objective.reference})"):
                self.reference = self.trainer.reference_params()
        if self.trainer.teacher is not None:
            with progress(f"loading the distillation teacher ({self.trainer.teacher.path})"):
                self.teacher = self.trainer.teacher.params()
        ckpt, stored = self.checkpointer, []  # stored: the config of each checkpoint checked
        if resume != "no" and ckpt is None:
            raise ValueError("--resume: checkpoint.dir is not set")
        restored = ckpt.restore_latest(
            abstract_like(jax.eval_shape(self.trainer.init_fn), self.trainer.shardings),
            on_corrupt=self.cfg.checkpoint.on_corrupt, log=say,
            layer_groups=layer_groups(self.cfg.model.config.decoder().layers),
            check_meta=lambda meta, where: (check_resumable(
                meta, self.trainer.run_meta()["config"], where), stored.append(meta["config"])),
        ) if resume != "no" else None
        if restored is None:
            if resume == "required":
                raise ValueError(f"--resume: no checkpoint in {ckpt.directory} (--resume=auto "
                                 "starts from scratch when there is none)")
            if resume == "auto":
                say(f"--resume=auto: no checkpoint in {ckpt.directory}, starting from scratch")
            return self.trainer.initial_state(), 0
        state = restored.state
        self.iterator.set_state(restored.data_state)
        start = int(state.step)
        say(f"resumed from {ckpt.where(restored.step)} (step {start})")
        self.keep_stored_outputs(stored[-1])
        return state, start

    def keep_stored_outputs(self, stored: dict[str, Any]) -> None:
        """A resumed run writes its metrics where the run it continues wrote them, unless this
        run names its own (`RESUME_KEEPS_OUTPUTS`): resuming without repeating
        `run.metrics_jsonl` must not drop the steps it trains from the log."""
        kept = {key.split(".", 1)[1]: stored[key] for key in RESUME_KEEPS_OUTPUTS
                if stored.get(key) is not None
                and getattr(self.cfg.run, key.split(".", 1)[1]) is None}
        for field, value in kept.items():
            say(f"--resume: run.{field} kept from the checkpoint's run: {value}")
        if kept:
            self.set_run_settings(**kept)

    def set_run_settings(self, **fields: Any) -> None:
        """Replace `run.*` settings of this run, in the config its checkpoints store too (the
        trainer's run meta), so a run resumed from them keeps them in turn."""
        self.cfg = dataclasses.replace(self.cfg, run=dataclasses.replace(self.cfg.run, **fields))
        self.trainer.cfg = self.cfg

    def describe(self, state: TrainState) -> str:
        """The line that says what runs where: model, mode, objective, mesh, attention kernel (what
        `auto` resolved to), batch layout."""
        cfg, mesh, mcfg = self.cfg, self.trainer.mesh, self.cfg.model.config
        n_params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
        if cfg.model.lora is not None:
            n_lora = sum(x.size for x in jax.tree_util.tree_leaves(trainable(state.params)))
            n_params = f"{n_params - n_lora:,} frozen + {n_lora:,} LoRA"
        else:
            n_params = f"{n_params:,}"
        rt = cfg.runtime
        qk_dim, v_dim = attention_head_dims(mcfg)
        attention = resolve_impl(rt.attention_impl, dtype=rt.dtype, head_dim=qk_dim,
                                 value_head_dim=v_dim)
        if rt.attention_impl == "auto" and jax.default_backend() == "cpu":
            candidates = cpu_candidates(None)
            if len(candidates) > 1:  # measured per shape class at the first trace (logged)
                attention = f"auto ({' or '.join(candidates)}: the faster, measured)"
        return (f"model: {cfg.model.architecture} {mcfg.num_hidden_layers} layers, hidden "
                f"{mcfg.hidden_size}, {n_params} parameters; mode {cfg.run.mode}, objective "
                f"{cfg.objective.kind}; mesh {describe_mesh(mesh)} "
                f"over {jax.process_count()} process(es), backend {jax.default_backend()}, "
                f"attention {attention}; "
                f"{self.layout}")

    def loop(self, state: TrainState, start: int) -> tuple[TrainState, list[dict[str, Any]]]:
        """Train steps `start` .. `run.steps - 1`: log each step's record, print every
        `run.log_every`-th, checkpoint every `checkpoint.every`-th. Returns the records."""
        cfg = self.cfg
        metrics_log = MetricsLog.of_run(cfg, start)
        if metrics_log.wandb_id is not None and cfg.run.wandb_id is None:  # a new W&B run
            self.set_run_settings(wandb_id=metrics_log.wandb_id)
        schedule, means = make_schedule(cfg.optim), learned_means(cfg.objective)
        history = []
        if start < cfg.run.steps:
            say(LOG_LEGEND)
            if notice := warmup_notice(cfg.optim.warmup_steps, cfg.run.steps):
                say(notice)
        for step in range(start, cfg.run.steps):
            state, metrics, info, host_s, device_s, compiles = self.train_step(state, step)
            record = step_record(step, metrics, info, host_s, device_s, compiles,
                                 float(schedule(step)), means)
            history.append(record)
            metrics_log.write(record)
            if step % cfg.run.log_every == 0 or step == cfg.run.steps - 1:
                say(progress_line(record, cfg.run.steps,
                                  eta_seconds(history, cfg.run.steps - step - 1)))
                if "mode_reason" in info:
                    say(f"           auto mode: {info['mode']} ({info['mode_reason']})")
            self.checkpoint(step + 1, state)
            if self.stop_for_preemption(step + 1, state):
                break
        if self.checkpointer is not None:
            self.checkpointer.wait()
        metrics_log.close()
        return state, history

    def train_step(self, state: TrainState, step: int) -> tuple[
            TrainState, dict[str, float], dict[str, Any], float, float, Compiles]:
        """Train the pipeline's next step: (state, metrics, step info, host s, device s, the
        step's compiles). Host time is reading the step and placing it; device time runs the
        old and reference log-prob forwards the step needs and waits for its metrics, less the time the step spent compiling (`compile_watch`, entered by
        `train`). A step at a shape not seen before says so before it compiles and how long the
        compile took after; a compile at known shapes is logged too (a redundancy-free part
        compiles per structure as well as per shape)."""
        cfg, trainer = self.cfg, self.trainer
        t0 = time.perf_counter()
        element = next(self.iterator)
        if "inputs" in element:  # the shapes the step compiles for are those of the laid-out batch
            element = dict(element, inputs=trainer.laid_out(element["inputs"]))
        info = element["info"]
        new = {k: d for k, d in step_shapes(element).items() if k not in self.compiled_shapes}
        shape = next(iter(new.values()), "") + (f" and {len(new) - 1} more" if len(new) > 1 else "")
        if new:
            say(f"compiling the step for shape {shape} ...")
            self.compiled_shapes.update(new)
        stale = old_logprobs_stale(bool(info["has_old_logprobs"]),
                                   float(info["old_logprob_disagreement"]), cfg.objective)
        if "program" in element:  # run.mode=redundancy_free
            if stale:
                raise ValueError(f"run.mode=redundancy_free: objective.kind="
                                 f"{cfg.objective.kind} needs old log-probs that the trees of "
                                 f"step {step} do not carry (or that disagree on shared tokens)")
            t1, before = time.perf_counter(), self.compile_watch.total
            state, metrics = trainer.rfree_step(state, element["program"])
        else:
            inputs = to_global(trainer.mesh, element["inputs"], len(self.shards))
            t1, before = time.perf_counter(), self.compile_watch.total
            state, metrics = trainer.train_on(state, inputs, old_logprobs_stale=stale,
                                              engine_logprobs=bool(info["has_old_logprobs"]),
                                              reference=self.reference,
                                              teacher=self.teacher)
        metrics = {k: float(v) for k, v in metrics.items()}  # waits for the step
        device_s = time.perf_counter() - t1
        compiles = self.compile_watch.total - before
        if compiles.n:
            say(f"compiling the step for shape {shape}: done in {compiles.seconds:.1f} s "
                f"({compiles.n} XLA programs: the step and the small ones around it)" if new else
                f"compiled the step again at shapes seen before: {compiles.n} XLA programs in "
                f"{compiles.seconds:.1f} s")
        if compiles.calibration_s:
            say(f"attention calibration ('auto' timing the CPU kernels once per shape class): "
                f"{compiles.calibration_s:.1f} s of that")
        # Compile time is wall time inside [t1, now] (compile_log), so this is never negative.
        return state, metrics, info, t1 - t0, device_s - compiles.seconds, compiles

    def checkpoint(self, done: int, state: TrainState) -> None:
        """Save after `done` steps when due (every `checkpoint.every` and at the end); with
        `run.kill_after_checkpoint == done`, wait for the write and SIGKILL this process (the
        fault the resume tests recover from)."""
        cfg, ckpt = self.cfg, self.checkpointer
        if ckpt is None or (done % cfg.checkpoint.every != 0 and done != cfg.run.steps):
            return
        ckpt.save(done, state, self.iterator.get_state(), self.trainer.run_meta())
        self.saved_step = done
        if cfg.run.kill_after_checkpoint == done:
            ckpt.wait()
            say(f"checkpoint {done} committed; fault injection: SIGKILL")
            os.kill(os.getpid(), signal.SIGKILL)

    def stop_for_preemption(self, done: int, state: TrainState) -> bool:
        """After `done` steps: whether a SIGTERM asks the run to stop (on any process of a
        multi-process run: every process stops at the same step), having saved and committed a
        checkpoint of step `done` when `checkpoint.dir` is set."""
        stop = self.preempted.is_set()
        if jax.process_count() > 1:
            stop = bool(np.any(multihost_utils.process_allgather(np.asarray(stop))))
        if not stop:
            return False
        if self.checkpointer is None:
            say(f"SIGTERM: stopping after step {done - 1}; nothing saved (checkpoint.dir is not "
                "set)")
            return True
        if self.saved_step != done:
            self.checkpointer.save(done, state, self.iterator.get_state(),
                                   self.trainer.run_meta())
            self.saved_step = done
        self.checkpointer.wait()
        say(f"SIGTERM: checkpoint {done} committed; stopping (continue with --resume)")
        return True

    def close(self) -> None:
        """Release the checkpointer: waits for its background writes and stops its threads, so
        a run that stops on an error exits without Orbax's teardown noise after the error."""
        if self.checkpointer is not None:
            self.checkpointer.close()


def step_shapes(element: dict[str, Any]) -> dict[tuple, str]:
    """What a pipeline element's step compiles for, each with its description: the shapes of its
    input arrays (a jit compiles once per distinct set), described by the micro-batches x rows x
    row length of `tokens` and every input of another shape. A redundancy-free program runs one
    call per part and one per micro-batch of the trees that fit a row whole, each compiling per
    input shapes."""
    if "program" not in element:
        return {_shape_key(element["inputs"]): _describe(element["inputs"])}
    program = element["program"]
    calls = [part.inputs for part in program.parts]
    if program.whole is not None:
        calls.extend(batch.inputs for batch in program.whole.batches)
    return {_shape_key(inputs): _describe(inputs) for inputs in calls}


def _leaf_shapes(inputs: DeviceBatch) -> list[tuple[str, tuple[int, ...]]]:
    """(field path, shape) of every array of a step's inputs."""
    return [(jax.tree_util.keystr(path).lstrip("."), tuple(leaf.shape))
            for path, leaf in jax.tree_util.tree_flatten_with_path(inputs)[0]]


def _shape_key(inputs: DeviceBatch) -> tuple:
    return tuple(_leaf_shapes(inputs))


def _describe(inputs: DeviceBatch) -> str:
    tokens = tuple(inputs.tokens.shape)
    other = [f"{k} {'x'.join(map(str, shape))}" for k, shape in _leaf_shapes(inputs)
             if shape[:len(tokens)] != tokens]
    return ", ".join(["tokens " + "x".join(map(str, tokens)), *other])


@contextlib.contextmanager
def preemption(run: TrainingRun) -> Iterator[None]:
    """While entered, SIGTERM (what spot GPUs and preemptible TPU slices send before they take the
    machine) sets `run.preempted` instead of killing the process: the loop saves at the next step
    boundary and the run exits 0 (`TrainingRun.stop_for_preemption`). Python takes signals on
    the main thread only; elsewhere SIGTERM keeps its default."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def note(signum: int, frame: Any) -> None:
        run.preempted.set()

    previous = signal.signal(signal.SIGTERM, note)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def train(cfg: TrainConfig, *, resume: Resume = "no") -> None:
    """Run `cfg` from its trees to its summary (and the baseline comparison when
    `run.compare_baseline`); with `resume` ("required" or "auto", see `TrainingRun.restore`),
    continue from the latest checkpoint in `checkpoint.dir`. SIGTERM saves at the next step
    boundary and returns (`preemption`). A multi-process run calls
    `jtree.parallel.distributed.initialize_from_env` first."""
    if resume == "required" and cfg.checkpoint.dir is not None and not os.path.isdir(
            cfg.checkpoint.dir):  # before the checkpointer creates it
        raise ValueError(f"--resume: {cfg.checkpoint.dir} does not exist (--resume=auto starts "
                         "from scratch when there is no checkpoint)")
    if configure_host_malloc(cfg.run.host_malloc):  # before anything starts a jax backend
        say("host malloc: keeps freed memory (run.host_malloc; CPU steps reuse their temporaries)")
    run = TrainingRun.build(cfg)
    try:
        with run.compile_watch, kernel_choices_said(), preemption(run):
            state, start = run.restore(resume)
            say(run.describe(state))
            if start >= cfg.run.steps:
                say(f"no steps to run: the checkpoint is at step {start} and run.steps is "
                    f"{cfg.run.steps} (raise run.steps to train on)")
            t_run = time.perf_counter()
            state, history = run.loop(state, start)
            checkpoint_dir = run.checkpointer.directory if run.checkpointer is not None else None
            wall = time.perf_counter() - t_run
            util = run_utilization(cfg.model.config, history, cfg.runtime.dtype)
            say(summary(history, wall, run.load_report.n_bad, checkpoint_dir,
                        util.describe() if util is not None else ""))
            if run.preempted.is_set():
                return
            if cfg.run.compare_baseline and history:
                if jax.process_count() == 1:
                    before = run.compile_watch.total
                    compare_with_baseline(cfg, run.trainer, run.builders, run.trees, state)
                    done = run.compile_watch.total - before
                    say(f"compare_baseline: {done.n} XLA programs compiled in "
                        f"{done.seconds:.1f} s")
                else:
                    say("compare_baseline: skipped (single-process check)")
            if cfg.run.mode != "redundancy_free":  # its parts run their own functions
                # The jit's own cache: one entry per step program this run compiled.
                say(f"train step programs: {run.trainer.step_fn._cache_size()} (one per step "
                    f"shape; the XLA program counts above also count the small programs around "
                    f"the step)")
    finally:
        run.close()
