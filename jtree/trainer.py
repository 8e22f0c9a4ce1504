"""The trainer: a run of a `TrainConfig` on trees from JSONL, whichever entry point starts it
(`jtree train`, `python -m jtree.launch.train`).

`Trainer` holds what the config alone determines: the ('data', 'model') mesh, the model graph and
its parameter shardings, the optimizer and the jitted step functions (data parallel over rows,
tensor parallel inside shard_map). It needs no data, so `jtree.launch.lower_step` lowers the very
step a run trains with. `TrainingRun` adds what the trees determine: the step builders of each
layout mode (`StepBuilders`), the data pipeline and the checkpointer; it restores a checkpoint
(data order included), trains with one record per step (`jtree.run_report`), saves checkpoints
(with the `run.kill_after_checkpoint` fault injection the resume tests use) and, with
`run.compare_baseline`, checks tree-vs-baseline log-prob equivalence with the trained parameters
and times the tree step against the per-path baseline step through the run's own builders and
step function. `train` runs one config from start to summary.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jtree.baseline_comparison import compare_with_baseline
from jtree.checkpoint import Checkpointer, abstract_like
from jtree.config import TrainConfig
from jtree.data import LoadReport, make_pipeline
from jtree.host_allocator import configure_host_malloc
from jtree.kernels.tree_attention import resolve_impl
from jtree.metrics import MetricsLog
from jtree.models import create_model
from jtree.rfree.execute import RedundancyFreeStep
from jtree.planner import check_steps_per_octave
from jtree.run_data import (
    StepBuilders, host_data_shards, load_training_trees, rfree_capacity, run_step_builder,
    to_global,
)
from jtree.run_report import progress_line, say, step_record, summary
from jtree.sharding import (
    DATA, MODEL, make_mesh, named, param_path, param_rules, param_specs,
)
from jtree.train_step import (
    TrainState, apply_gradients, make_optimizer, make_schedule, make_sharded_grad_fn,
    make_sharded_logprob_fn, make_train_step, old_logprobs_stale, state_shardings,
    tensor_parallel_graphdef,
)
from jtree.tree import TrajectoryTree

@dataclasses.dataclass
class Trainer:
    """What the config alone determines: mesh, model graphs, parameter shardings, optimizer and
    the jitted step, log-prob and init functions. No data: `jtree.launch.lower_step` lowers the
    step a run trains with from it."""

    cfg: TrainConfig
    mesh: Mesh
    graphdef: Any
    specs: Any
    shardings: TrainState
    optimizer: Any
    step_fn: Any
    logprob_fn: Any
    init_fn: Any
    rfree_step: Any = None  # (state, RfreeProgram) -> (state, metrics), run.mode=redundancy_free

    @classmethod
    def build(cls, cfg: TrainConfig) -> Trainer:
        """Compiles nothing: the model is built abstractly (shapes only) and the functions are
        jitted wrappers that compile on their first call."""
        mesh = make_mesh(cfg.mesh)
        arch, mcfg = cfg.model.architecture, cfg.model.config
        abstract = nnx.eval_shape(lambda: create_model(arch, mcfg, cfg.runtime,
                                                       seed=cfg.run.seed))
        _, abstract_params = nnx.split(abstract)
        try:
            rules = param_rules(mcfg, mesh.shape[MODEL])
        except ValueError as e:
            raise ValueError(f"model ({arch}) on mesh.model={mesh.shape[MODEL]}: {e}") from None
        specs = param_specs(abstract_params, rules, mesh)
        graphdef = tensor_parallel_graphdef(abstract)
        optimizer = make_optimizer(cfg.optim)
        shardings = state_shardings(optimizer, abstract_params, named(mesh, specs), mesh)
        grad_fn = make_sharded_grad_fn(graphdef, cfg.objective, mesh, specs)
        step = make_train_step(graphdef, optimizer, cfg.objective, grad_fn=grad_fn)
        replicated = NamedSharding(mesh, P())
        step_fn = jax.jit(step, out_shardings=(shardings, replicated), donate_argnums=0)
        logprob_fn = jax.jit(make_sharded_logprob_fn(graphdef, mesh, specs,
                                                     cfg.objective.logprob_chunk))

        def init() -> TrainState:
            params = nnx.split(create_model(arch, mcfg, cfg.runtime, seed=cfg.run.seed))[1]
            return TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32))

        init_fn = jax.jit(init, out_shardings=shardings)
        rfree_step = None
        if cfg.run.mode == "redundancy_free":
            rfree_step = make_rfree_step(cfg, mesh, nnx.split(abstract)[0], optimizer)
        return cls(cfg, mesh, graphdef, specs, shardings, optimizer, step_fn, logprob_fn, init_fn,
                   rfree_step)

    def initial_state(self) -> TrainState:
        """A fresh TrainState: random init, or the weights of `model.init_from` placed directly
        onto the mesh (each host reads only what its devices hold)."""
        path = self.cfg.model.init_from
        if path is None:
            return self.init_fn()
        from jtree.hf import load

        mcfg = self.cfg.model.config
        by_name = {param_path(p).replace("/", "."): s for p, s in
                   jax.tree_util.tree_flatten_with_path(self.shardings.params)[0]}
        loaded, model = load(path, self.cfg.runtime, shardings=lambda name, shape: by_name[name])
        for field in dataclasses.fields(mcfg):
            ours, theirs = getattr(mcfg, field.name), getattr(loaded, field.name)
            # initializer_range only shapes a random init, which a loaded model does not have.
            if field.name != "initializer_range" and ours != theirs:
                raise ValueError(f"model.{field.name}: the config has {ours!r}, "
                                 f"{path}/config.json has {theirs!r}")
        params = nnx.split(model)[1]
        opt_state = jax.jit(self.optimizer.init, out_shardings=self.shardings.opt_state)(params)
        return TrainState(params, opt_state,
                          jax.device_put(jnp.zeros((), jnp.int32), self.shardings.step))

    def run_meta(self) -> dict[str, Any]:
        """What a checkpoint must agree with to be resumed by this config."""
        c = self.cfg
        return {"architecture": c.model.architecture, "seed": c.run.seed,
                "shuffle_seed": c.data.shuffle_seed, "trees_per_step": c.data.trees_per_step,
                "mode": c.run.mode, "data_path": c.data.path}


def make_rfree_step(cfg: TrainConfig, mesh: Mesh, graphdef: Any, optimizer: Any
                    ) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]:
    """The `run.mode=redundancy_free` step: `jtree.rfree` gradients part by part, then the
    optimizer update. Single device: the parts run as separate calls, not over a mesh."""
    if mesh.devices.size != 1:
        raise ValueError(f"run.mode=redundancy_free: runs on one device, but the mesh has "
                         f"{mesh.devices.size} (mesh.data={mesh.shape[DATA]} x mesh.model="
                         f"{mesh.shape[MODEL]}); set mesh.data=1 mesh.model=1 or another run.mode")
    rfree_capacity(cfg)
    check_steps_per_octave(cfg.run.row_steps_per_octave, "run.row_steps_per_octave")
    grads_of = RedundancyFreeStep(graphdef, cfg.objective,
                                  prefix_backward=cfg.run.prefix_backward)
    update = jax.jit(apply_gradients(optimizer), donate_argnums=0)

    def step(state: TrainState, program) -> tuple[TrainState, dict[str, jax.Array]]:
        return update(state, *grads_of(state.params, program))

    return step


def check_resumable(meta: dict[str, Any], expected: dict[str, Any], where: str) -> None:
    """Refuse a checkpoint written by a run that `expected` (this config's `run_meta`) would not
    continue: another model, seed, data or data order."""
    for key, value in expected.items():
        if key in meta and meta[key] != value:
            raise ValueError(f"{where}: written with {key}={meta[key]!r}, but the config has "
                             f"{value!r}; resuming would not continue the same run")


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

    @classmethod
    def build(cls, cfg: TrainConfig) -> TrainingRun:
        """Load the trees, build the step functions, the step builders of the trained modes and
        the pipeline that feeds this process's data shards, and open `checkpoint.dir`."""
        trees, report = load_training_trees(cfg)
        trainer = Trainer.build(cfg)
        shards = host_data_shards(trainer.mesh)
        builders = StepBuilders(cfg, trees, trainer.mesh.shape[DATA], shards)
        builder, layout = run_step_builder(cfg, trees, builders)
        iterator = iter(make_pipeline(builder, seed=cfg.data.shuffle_seed,
                                      worker_count=cfg.data.worker_count))
        ckpt = None
        if cfg.checkpoint.dir is not None:
            ckpt = Checkpointer(cfg.checkpoint.dir, keep=cfg.checkpoint.keep,
                                async_save=cfg.checkpoint.async_save)
        return cls(cfg, trees, report, trainer, shards, builders, iterator, layout, ckpt)

    def restore(self, resume: bool) -> tuple[TrainState, int]:
        """(state, first step): the latest checkpoint's, data order included, when `resume` and
        one exists; otherwise a fresh state at step 0."""
        ckpt = self.checkpointer
        if resume and ckpt is None:
            raise ValueError("--resume: checkpoint.dir is not set")
        restored = ckpt.restore_latest(
            abstract_like(jax.eval_shape(self.trainer.init_fn), self.trainer.shardings),
            on_corrupt=self.cfg.checkpoint.on_corrupt, log=say,
            check_meta=lambda meta, where: check_resumable(meta, self.trainer.run_meta(), where),
        ) if resume else None
        if restored is None:
            if resume:
                say(f"--resume: no checkpoint in {ckpt.directory}, starting from scratch")
            return self.trainer.initial_state(), 0
        state = restored.state
        self.iterator.set_state(restored.data_state)
        start = int(state.step)
        say(f"resumed from {ckpt.where(restored.step)} (step {start})")
        return state, start

    def describe(self, state: TrainState) -> str:
        """The line that says what runs where: model, mode, objective, mesh, attention kernel (what
        `auto` resolved to), batch layout."""
        cfg, mesh, mcfg = self.cfg, self.trainer.mesh, self.cfg.model.config
        n_params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
        rt = cfg.runtime
        attention = resolve_impl(rt.attention_impl, dtype=rt.dtype, head_dim=mcfg.head_dim)
        return (f"model: {cfg.model.architecture} {mcfg.num_hidden_layers} layers, hidden "
                f"{mcfg.hidden_size}, {n_params:,} parameters; mode {cfg.run.mode}, objective "
                f"{cfg.objective.kind}; mesh data={mesh.shape[DATA]} x model={mesh.shape[MODEL]} "
                f"over {jax.process_count()} process(es), backend {jax.default_backend()}, "
                f"attention {attention}; "
                f"{self.layout}")

    def loop(self, state: TrainState, start: int) -> tuple[TrainState, list[dict[str, Any]]]:
        """Train steps `start` .. `run.steps - 1`: log each step's record, print every
        `run.log_every`-th, checkpoint every `checkpoint.every`-th. Returns the records."""
        cfg = self.cfg
        metrics_log = MetricsLog(cfg.run.metrics_jsonl, cfg.run.tensorboard_dir,
                                 first_step=start, enabled=jax.process_index() == 0)
        schedule = make_schedule(cfg.optim)
        history = []
        for step in range(start, cfg.run.steps):
            state, metrics, info, host_s, device_s = self.train_step(state, step)
            record = step_record(step, metrics, info, host_s, device_s, float(schedule(step)))
            history.append(record)
            metrics_log.write(record)
            if step % cfg.run.log_every == 0 or step == cfg.run.steps - 1:
                say(progress_line(record) + ("  (includes compile)" if step == start else ""))
                if "mode_reason" in info:
                    say(f"           auto mode: {info['mode']} ({info['mode_reason']})")
            self.checkpoint(step + 1, state)
        if self.checkpointer is not None:
            self.checkpointer.wait()
        metrics_log.close()
        return state, history

    def train_step(self, state: TrainState, step: int
                   ) -> tuple[TrainState, dict[str, float], dict[str, Any], float, float]:
        """Train the pipeline's next step: (state, metrics, step info, host s, device s). Host
        time is reading the step and placing it; device time waits for the step's metrics."""
        cfg, trainer = self.cfg, self.trainer
        t0 = time.perf_counter()
        element = next(self.iterator)
        info = element["info"]
        stale = old_logprobs_stale(bool(info["has_old_logprobs"]),
                                   float(info["old_logprob_disagreement"]), cfg.objective)
        if "program" in element:  # run.mode=redundancy_free
            if stale:
                raise ValueError(f"run.mode=redundancy_free: objective.kind="
                                 f"{cfg.objective.kind} needs old log-probs that the trees of "
                                 f"step {step} do not carry (or that disagree on shared tokens)")
            t1 = time.perf_counter()
            state, metrics = trainer.rfree_step(state, element["program"])
        else:
            inputs = to_global(trainer.mesh, element["inputs"], len(self.shards))
            if stale:
                inputs = inputs.with_coefficients(
                    old_logprobs=trainer.logprob_fn(state.params, inputs))
            t1 = time.perf_counter()
            state, metrics = trainer.step_fn(state, inputs)
        metrics = {k: float(v) for k, v in metrics.items()}  # waits for the step
        return state, metrics, info, t1 - t0, time.perf_counter() - t1

    def checkpoint(self, done: int, state: TrainState) -> None:
        """Save after `done` steps when due (every `checkpoint.every` and at the end); with
        `run.kill_after_checkpoint == done`, wait for the write and SIGKILL this process (the
        fault the resume tests recover from)."""
        cfg, ckpt = self.cfg, self.checkpointer
        if ckpt is None or (done % cfg.checkpoint.every != 0 and done != cfg.run.steps):
            return
        ckpt.save(done, state, self.iterator.get_state(), self.trainer.run_meta())
        if cfg.run.kill_after_checkpoint == done:
            ckpt.wait()
            say(f"checkpoint {done} committed; fault injection: SIGKILL")
            os.kill(os.getpid(), signal.SIGKILL)

    def close(self) -> None:
        """Release the checkpointer (its background writes are done by the end of `loop`)."""
        if self.checkpointer is not None:
            self.checkpointer.close()


def train(cfg: TrainConfig, *, resume: bool = False) -> None:
    """Run `cfg` from its trees to its summary (and the baseline comparison when
    `run.compare_baseline`); with `resume`, continue from the latest checkpoint in
    `checkpoint.dir`. A multi-process run calls `jtree.distributed.initialize_from_env` first."""
    if configure_host_malloc(cfg.run.host_malloc):  # before anything starts a jax backend
        say("host malloc: keeps freed memory (run.host_malloc; CPU steps reuse their temporaries)")
    run = TrainingRun.build(cfg)
    state, start = run.restore(resume)
    say(run.describe(state))
    t_run = time.perf_counter()
    state, history = run.loop(state, start)
    checkpoint_dir = run.checkpointer.directory if run.checkpointer is not None else None
    say(summary(history, time.perf_counter() - t_run, run.load_report.n_bad, checkpoint_dir))
    if cfg.run.compare_baseline and history:
        if jax.process_count() == 1:
            compare_with_baseline(cfg, run.trainer, run.builders, run.trees, state)
        else:
            say("compare_baseline: skipped (single-process check)")
    run.close()
