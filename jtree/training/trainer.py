"""The trainer: a run of a `TrainConfig` on trees from JSONL, whichever entry point starts it
(`jtree train`, `python -m jtree.launch.train`).

`Trainer` holds what the config alone determines: the ('data', 'fsdp', 'context', 'model') mesh, the model graph and
its parameter shardings, the optimizer and the jitted step functions (data parallel over rows,
parameters and optimizer state sharded over `fsdp`, tensor parallel inside shard_map). It needs no data, so `jtree.launch.lower_step` lowers the very
step a run trains with. `TrainingRun` adds what the trees determine: the step builders of each
layout mode (`StepBuilders`), the data pipeline and the checkpointer; it restores a checkpoint
(data order included), trains with one record per step (`jtree.training.report`), saves checkpoints
(with the `run.kill_after_checkpoint` fault injection the resume tests use), says which config
keys differ from the checkpoint's on resume (refusing those that change the model or the data
order), logs every compile of the step (`jtree.training.compile_log`; compile time is kept out of tokens/s)
and, with
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

from jtree.training.baseline_check import compare_with_baseline
from jtree.layout.batch import DeviceBatch
from jtree.parallel.context import (
    ContextCapacities, agreed, check_rows_within_processes, context_batch, context_capacities,
)
from jtree.training.checkpoint import Checkpointer, abstract_like
from jtree.parallel.layer_stack import layer_groups
from jtree.training.compile_log import Compiles, CompileWatch
from jtree.config import TrainConfig, config_values
from jtree.step.critic_params import as_critic_trunk, flat_params, policy_params, with_named
from jtree.training.pipeline import LoadReport, make_pipeline
from jtree.training.host_allocator import configure_host_malloc
from jtree.kernels.tree_attention import resolve_impl
from jtree.training.metrics import MetricsLog
from jtree.models import create_model
from jtree.models.lora import lora_specs, model_params, trainable, trainable_grads, with_lora
from jtree.partitioning.redundancy_free.executor import RedundancyFreeStep
from jtree.partitioning.redundancy_free.mesh_executor import MeshRedundancyFreeStep
from jtree.layout.planner import check_row_slices, check_steps_per_octave
from jtree.training.run_data import (
    StepBuilders, host_data_shards, load_training_trees, rfree_capacity, run_step_builder,
    to_global,
)
from jtree.training.report import progress, progress_line, say, step_record, summary
from jtree.parallel.sharding import (
    MODEL, context_size, describe_mesh, make_mesh, named, param_path, param_rules, param_specs, row_shards,
)
from jtree.step.train_step import (
    TrainState, apply_gradients, make_optimizer, make_schedule, make_sharded_grad_fn, make_sharded_logprob_fn, make_train_step, old_logprobs_stale, sharded_graphdef, state_shardings,
)
from jtree.trees.tree import TrajectoryTree

@dataclasses.dataclass
class Trainer:
    """What the config alone determines: mesh, model graphs, parameter shardings, optimizer and
    the jitted step, log-prob and init functions. No data: `jtree.launch.lower_step` lowers the
    step a run trains with from it.

    `specs` lay out the trained parameters (a `jtree.models.lora.LoraParams` with `model.lora`)
    and their optimizer state (the step reads LoRA adapters in another layout,
    `jtree.models.lora.lora_specs`), `model_specs` the model's own (what a Hugging Face
    checkpoint loads into and the reference model runs on). `ref_logprob_fn` runs the reference
    model of `objective.reference` (None when the data carries the reference log-probs)."""

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
    model_specs: Any = None
    ref_logprob_fn: Any = None

    @classmethod
    def build(cls, cfg: TrainConfig) -> Trainer:
        """Compiles nothing: the model is built abstractly (shapes only) and the functions are
        jitted wrappers that compile on their first call."""
        critic, network = cfg.objective.critic, cfg.critic_network
        if critic is not None and cfg.model.lora is not None:
            raise ValueError("model.lora: not available with objective.critic (only the "
                             "adapters would train: the critic's parameters would stay frozen)")
        context = cfg.mesh.context
        check_row_slices(cfg.data.seq_len, context, ("mesh.context", "data.seq_len"))
        mesh = make_mesh(cfg.mesh)
        arch, mcfg = cfg.model.architecture, cfg.model.config
        check_reference(cfg)
        abstract = nnx.eval_shape(lambda: create_model(arch, mcfg, cfg.runtime, seed=cfg.run.seed,
                                                       **cfg.critic_model_args))
        _, abstract_model_params = nnx.split(abstract)
        abstract_params = jax.eval_shape(
            lambda p: with_lora(p, cfg.model.lora, cfg.run.seed), abstract_model_params)
        try:
            rules = param_rules(mcfg, mesh.shape[MODEL], critic=network)
        except ValueError as e:
            raise ValueError(f"model ({arch}) on mesh.model={mesh.shape[MODEL]}: {e}") from None
        try:
            specs, step_specs = lora_specs(abstract_params, rules, mesh)
            model_specs = param_specs(abstract_model_params, rules, mesh)
        except ValueError as e:
            raise ValueError(f"model ({arch}) on mesh {describe_mesh(mesh)}: {e}") from None
        if context > 1 and cfg.run.mode == "redundancy_free":
            raise ValueError(f"run.mode=redundancy_free with mesh.context={context}: parts of "
                             "trees do not run under context parallelism yet; set "
                             "mesh.context=1 or another run.mode")
        if context > 1:
            check_rows_within_processes(mesh)
        try:
            graphdef = sharded_graphdef(abstract, model_specs, mesh)
        except ValueError as e:
            raise ValueError(f"model ({arch}) on mesh {describe_mesh(mesh)}: {e}") from None
        optimizer = make_optimizer(cfg.optim, None if critic is None else critic.learning_rate)
        shardings = state_shardings(optimizer, abstract_params, named(mesh, specs), mesh)
        grad_fn = make_sharded_grad_fn(graphdef, cfg.objective, mesh, step_specs)
        step = make_train_step(graphdef, optimizer, cfg.objective, grad_fn=grad_fn)
        replicated = NamedSharding(mesh, P())
        step_fn = jax.jit(step, out_shardings=(shardings, replicated), donate_argnums=0)
        chunk = cfg.objective.logprob_chunk
        logprob_fn = jax.jit(make_sharded_logprob_fn(graphdef, mesh, step_specs, chunk))
        ref_logprob_fn = None
        if cfg.objective.reference is not None:  # the policy alone, without the critic
            policy = nnx.eval_shape(lambda: create_model(arch, mcfg, cfg.runtime))
            ref_specs = policy_params(model_specs)
            ref_logprob_fn = jax.jit(make_sharded_logprob_fn(
                sharded_graphdef(policy, ref_specs, mesh), mesh, ref_specs, chunk))

        def init() -> TrainState:
            params = nnx.split(create_model(arch, mcfg, cfg.runtime, seed=cfg.run.seed,
                                            **cfg.critic_model_args))[1]
            if network is not None and critic.init_from == "policy":
                params = with_named(params, as_critic_trunk(flat_params(params)))
            params = with_lora(params, cfg.model.lora, cfg.run.seed)
            return TrainState(params, optimizer.init(trainable(params)),
                              jnp.zeros((), jnp.int32))

        init_fn = jax.jit(init, out_shardings=shardings)
        rfree_step = None
        if cfg.run.mode == "redundancy_free":
            rfree_step = make_rfree_step(cfg, mesh, nnx.split(abstract)[0], optimizer,
                                         sharded=(graphdef, step_specs, shardings))
        return cls(cfg, mesh, graphdef, specs, shardings, optimizer, step_fn, logprob_fn, init_fn,
                   rfree_step, model_specs, ref_logprob_fn)

    def laid_out(self, local: DeviceBatch, capacities: ContextCapacities | None = None
                 ) -> DeviceBatch:
        """A host step batch as this mesh runs it: on a context-parallel mesh laid out per device
        (`jtree.parallel.context.context_batch`: halo, score layout, GDN tables) at `capacities`
        (default: what it needs, agreed over the processes), else as is."""
        context = context_size(self.mesh)
        if context == 1:
            return local
        conv_kernel = getattr(self.cfg.model.config, "linear_conv_kernel_dim", None)
        if capacities is None:
            capacities = agreed(context_capacities(local, context, conv_kernel))
        return context_batch(local, context, conv_kernel=conv_kernel, capacities=capacities)

    def place(self, local: DeviceBatch, n_local_shards: int) -> DeviceBatch:
        """A host step batch (this process's `n_local_shards` row shards) as global arrays on
        the mesh, laid out for it (`laid_out`)."""
        return to_global(self.mesh, self.laid_out(local), n_local_shards)

    def initial_state(self) -> TrainState:
        """A fresh TrainState: random init, or the weights of `model.init_from` (and of a
        separate critic's `objective.critic.init_from` checkpoint) placed directly onto the mesh
        (each host reads only what its devices hold)."""
        path = self.cfg.model.init_from
        critic = self.cfg.objective.critic
        if path is None and (critic is None or critic.checkpoint_dir is None):
            return self.init_fn()
        params = self.load_hf(path, "model.init_from") if critic is None else \
            self.critic_start_params()
        if self.cfg.model.lora is not None:
            params = jax.jit(lambda p: with_lora(p, self.cfg.model.lora, self.cfg.run.seed),
                             out_shardings=self.shardings.params)(params)
        opt_state = jax.jit(lambda p: self.optimizer.init(trainable(p)),
                            out_shardings=self.shardings.opt_state)(params)
        return TrainState(params, opt_state,
                          jax.device_put(jnp.zeros((), jnp.int32), self.shardings.step))

    def critic_start_params(self) -> Any:
        """The starting parameters of a run with a critic and a Hugging Face checkpoint to load
        (`model.init_from`, a separate critic's `init_from`): what the checkpoints hold from
        them, the rest (value heads, a `random` critic, an unloaded policy) from the seeded
        init, of which only those parameters are computed (`jtree.step.critic_params`)."""
        cfg = self.cfg
        critic, path = cfg.objective.critic, cfg.model.init_from
        loaded = {}
        if path is not None:
            loaded = flat_params(self.load_hf(path, "model.init_from"))
            if critic.separate and critic.init_from == "policy":
                loaded |= as_critic_trunk(loaded)
        if critic.checkpoint_dir is not None:
            loaded |= as_critic_trunk(flat_params(self.load_hf(
                critic.checkpoint_dir, "objective.critic.init_from", cfg.critic_network,
                "critic.")))
        fresh = jax.eval_shape(self.init_fn).params
        where = flat_params(self.shardings.params)
        rest = {k: where[k] for k in flat_params(fresh) if k not in loaded}
        seeded = jax.jit(lambda: {k: v for k, v in flat_params(self.init_fn().params).items()
                                  if k in rest}, out_shardings=rest)()
        return jax.jit(lambda values: with_named(fresh, values),
                       out_shardings=self.shardings.params)(loaded | seeded)

    def load_hf(self, path: str, key: str, config: Any = None, prefix: str = "") -> Any:
        """The model parameters of Hugging Face checkpoint `path` placed directly onto the mesh
        (each host reads only what its devices hold), laid out as the parameters under `prefix`
        ('critic.': the separate critic's; what the run does not hold, replicated); its
        config.json must agree with `config` (default: `model`; an error names `key`, the
        config key that gave `path`, and the field)."""
        from jtree.hf import load

        mcfg = self.cfg.model.config if config is None else config
        section = "model" if config is None else "objective.critic.network"
        by_name = {param_path(p).replace("/", "."): s for p, s in
                   jax.tree_util.tree_flatten_with_path(named(self.mesh, self.model_specs))[0]}
        replicated = NamedSharding(self.mesh, P())
        loaded, model = load(path, self.cfg.runtime, shardings=lambda name, shape: by_name.get(
            prefix + name, replicated))
        for field in dataclasses.fields(mcfg):
            ours, theirs = getattr(mcfg, field.name), getattr(loaded, field.name)
            # initializer_range only shapes a random init, which a loaded model does not have.
            if field.name != "initializer_range" and ours != theirs:
                raise ValueError(f"{key}: {section}.{field.name}: the config has {ours!r}, "
                                 f"{path}/config.json has {theirs!r}")
        return nnx.split(model)[1]

    def reference_params(self) -> Any:
        """The reference model's parameters (`objective.reference`), laid out like the model's:
        `initial` the run's starting weights (as a fresh run starts: `model.init_from` or the
        seeded init, with LoRA the base), else the Hugging Face checkpoint it names."""
        ref = self.cfg.objective.reference
        if ref != "initial":
            return self.load_hf(ref, "objective.reference")
        start = self.initial_state().params
        return jax.jit(lambda p: policy_params(model_params(p)), out_shardings=named(
            self.mesh, policy_params(self.model_specs)))(start)

    def run_meta(self) -> dict[str, Any]:
        """What a checkpoint keeps of the run that wrote it: its whole config (dotted keys), so
        a resume says what changed and refuses what would not continue the same run
        (`check_resumable`)."""
        return {"config": config_values(self.cfg)}


def check_reference(cfg: TrainConfig) -> None:
    """`objective.reference` names a model for the KL term: it needs `kind: ppo` with
    `kl_coef` > 0, and a layout the reference forward runs on (not redundancy-free parts)."""
    obj = cfg.objective
    if obj.reference is None:
        return
    if obj.kind != "ppo" or obj.kl_coef <= 0:
        raise ValueError(f"objective.reference: {obj.reference!r} is the KL term's reference "
                         f"model, but objective.kind={obj.kind} with kl_coef={obj.kl_coef} has "
                         "no KL term (set kind: ppo and kl_coef > 0, or unset reference)")
    if cfg.run.mode == "redundancy_free":
        raise ValueError("objective.reference: run.mode=redundancy_free runs no reference "
                         "forward on its parts; give ref_logprobs in the data or use another "
                         "run.mode")


def make_rfree_step(cfg: TrainConfig, mesh: Mesh, graphdef: Any, optimizer: Any, *,
                    sharded: tuple[Any, Any, TrainState] | None = None
                    ) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]:
    """The `run.mode=redundancy_free` step: `jtree.partitioning.redundancy_free` gradients, then the optimizer update.
    On one device the parts run as separate calls (`RedundancyFreeStep`); on a larger mesh in
    lockstep over its row shards inside one sharded call (`MeshRedundancyFreeStep`), which needs
    `sharded` = (the model for shard_map, the parameters' specs, the state's shardings)."""
    rfree_capacity(cfg)
    check_steps_per_octave(cfg.run.row_steps_per_octave, "run.row_steps_per_octave")
    if mesh.devices.size > 1:
        if cfg.run.prefix_backward == "residuals":
            raise ValueError(f"run.prefix_backward=residuals: not available on a mesh of "
                             f"{mesh.devices.size} devices ({describe_mesh(mesh)}), where a "
                             "part with children runs its forward again for its backward; set "
                             "run.prefix_backward=recompute (or auto)")
        sharded_graphdef, specs, shardings = sharded
        grads_on_mesh = MeshRedundancyFreeStep(sharded_graphdef, cfg.objective, mesh, specs)
        update = jax.jit(apply_gradients(optimizer), donate_argnums=0,
                         out_shardings=(shardings, NamedSharding(mesh, P())))

        def mesh_step(state: TrainState, program) -> tuple[TrainState, dict[str, jax.Array]]:
            return update(state, *grads_on_mesh(state.params, program))

        return mesh_step
    grads_of = RedundancyFreeStep(graphdef, cfg.objective,
                                  prefix_backward=cfg.run.prefix_backward)
    update = jax.jit(apply_gradients(optimizer), donate_argnums=0)
    if cfg.model.lora is None:
        def step(state: TrainState, program) -> tuple[TrainState, dict[str, jax.Array]]:
            return update(state, *grads_of(state.params, program))

        return step
    # LoRA: the parts differentiate the merged model's parameters; the chain rule through the
    # merge turns those gradients into the adapters'.
    merge, to_trainable = jax.jit(model_params), jax.jit(trainable_grads)

    def lora_step(state: TrainState, program) -> tuple[TrainState, dict[str, jax.Array]]:
        loss, metrics, grads = grads_of(merge(state.params), program)
        return update(state, loss, metrics, to_trainable(state.params, grads))

    return lora_step


# Config keys a resumed run may change although they are part of a fixed section (`model.`,
# `data.`): where the weights first came from, how many workers read data. How the model runs
# (`runtime.*`) is not a fixed section.
RESUME_MAY_CHANGE = ("model.init_from", "data.worker_count")


def resume_refusal(key: str) -> str | None:
    """Why a resumed run must keep `key` as the checkpoint has it, or None when it may change:
    the model (its shapes and initialization) and the data order (which trees each step trains
    on, and how they are laid out) are what makes a resumed run continue the one that was
    stopped. Optimizer, objective, run length, logging, mesh and checkpoint settings may
    change."""
    if key in RESUME_MAY_CHANGE:
        return None
    if key.startswith("model."):
        return "it changes the model"
    if key.startswith("data.") or key in ("run.mode", "run.seed"):
        return "it changes the data order or the initialization"
    return None


def critic_resume_refusal(saved: dict[str, Any] | None, config: dict[str, Any] | None
                          ) -> str | None:
    """Why a resumed run may not change `objective.critic` from `saved` to `config` (their
    `config_values`), or None: adding or removing the critic, or changing where its values
    come from (head or separate model, the separate network) or whether it has a learning rate
    of its own, changes the parameters or the optimizer state the checkpoint holds. GAE and the
    value loss's settings, the learning rate's value and `init_from` may change."""
    if (saved is None) != (config is None):
        return "it adds or removes the value head or the separate critic (its settings may change)"
    if saved is None:
        return None
    for field, what in (("model", "where the values come from"),
                        ("network", "the critic's network")):
        if saved.get(field) != config.get(field):
            return f"it changes {what} ({field})"
    if (saved.get("learning_rate") is None) != (config.get("learning_rate") is None):
        return ("it adds or removes the critic's learning rate (a step of the optimizer, whose "
                "state the checkpoint holds)")
    return None


def check_resumable(meta: dict[str, Any], config: dict[str, Any], where: str) -> None:
    """Say which keys of `config` (this run's `config_values`) differ from those of the
    checkpoint's run meta, each with its old and new value, and refuse the checkpoint when one
    of them may not change (`resume_refusal`), naming the key."""
    if "config" not in meta:
        raise ValueError(f"{where}: its run meta holds no config ({sorted(meta)}), so this run "
                         "cannot check it continues the same run")
    saved = meta["config"]
    changed = sorted(k for k in set(saved) | set(config) if saved.get(k) != config.get(k))
    refused = []
    for key in changed:
        why = resume_refusal(key)
        if key == "objective.critic":
            why = critic_resume_refusal(saved.get(key), config.get(key))
        say(f"--resume: {key} changed from {saved.get(key)!r} to {config.get(key)!r}"
            + (f": refused, {why}" if why else ": allowed"))
        if why:
            refused.append(f"{key} ({saved.get(key)!r} -> {config.get(key)!r}): {why}")
    if refused:
        raise ValueError(f"{where}: {'; '.join(refused)}; set it back to resume this "
                         "checkpoint, or train into a new checkpoint.dir")


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

    def restore(self, resume: bool) -> tuple[TrainState, int]:
        """(state, first step): the latest checkpoint's, data order included, when `resume` and
        one exists; otherwise a fresh state at step 0. Loads the reference model of
        `objective.reference` too (its weights do not depend on the checkpoint)."""
        if self.cfg.objective.reference is not None:
            with progress(f"loading the reference model ({self.cfg.objective.reference})"):
                self.reference = self.trainer.reference_params()
        ckpt = self.checkpointer
        if resume and ckpt is None:
            raise ValueError("--resume: checkpoint.dir is not set")
        restored = ckpt.restore_latest(
            abstract_like(jax.eval_shape(self.trainer.init_fn), self.trainer.shardings),
            on_corrupt=self.cfg.checkpoint.on_corrupt, log=say,
            layer_groups=layer_groups(self.cfg.model.config.decoder().layers),
            check_meta=lambda meta, where: check_resumable(meta, self.trainer.run_meta()["config"],
                                                           where),
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
        if cfg.model.lora is not None:
            n_lora = sum(x.size for x in jax.tree_util.tree_leaves(trainable(state.params)))
            n_params = f"{n_params - n_lora:,} frozen + {n_lora:,} LoRA"
        else:
            n_params = f"{n_params:,}"
        rt = cfg.runtime
        attention = resolve_impl(rt.attention_impl, dtype=rt.dtype, head_dim=mcfg.head_dim)
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
        metrics_log = MetricsLog(cfg.run.metrics_jsonl, cfg.run.tensorboard_dir,
                                 first_step=start, enabled=jax.process_index() == 0)
        schedule = make_schedule(cfg.optim)
        history = []
        for step in range(start, cfg.run.steps):
            state, metrics, info, host_s, device_s, compiles = self.train_step(state, step)
            record = step_record(step, metrics, info, host_s, device_s, compiles,
                                 float(schedule(step)))
            history.append(record)
            metrics_log.write(record)
            if step % cfg.run.log_every == 0 or step == cfg.run.steps - 1:
                say(progress_line(record))
                if "mode_reason" in info:
                    say(f"           auto mode: {info['mode']} ({info['mode_reason']})")
            self.checkpoint(step + 1, state)
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
        shape = "; ".join(new.values())
        if new:
            say(f"compiling the step for shape {shape} ...")
            self.compiled_shapes.update(new)
        before = self.compile_watch.total
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
            t1 = time.perf_counter()
            if stale:
                inputs = inputs.with_coefficients(
                    old_logprobs=trainer.logprob_fn(state.params, inputs))
            if self.reference is not None:  # the KL term's reference: a forward on this batch
                inputs = inputs.with_coefficients(
                    ref_logprobs=trainer.ref_logprob_fn(self.reference, inputs))
            state, metrics = trainer.step_fn(state, inputs)
        metrics = {k: float(v) for k, v in metrics.items()}  # waits for the step
        device_s = time.perf_counter() - t1
        compiles = self.compile_watch.total - before
        if compiles.n:
            say(f"compiling the step for shape {shape}: done in {compiles.seconds:.1f} s "
                f"({compiles.n} program(s))" if new else
                f"compiled the step again at shapes seen before: {compiles.n} program(s) in "
                f"{compiles.seconds:.1f} s")
        return state, metrics, info, t1 - t0, device_s - compiles.seconds, compiles

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
        """Release the checkpointer: waits for its background writes and stops its threads, so
        a run that stops on an error exits without Orbax's teardown noise after the error."""
        if self.checkpointer is not None:
            self.checkpointer.close()


def step_shapes(element: dict[str, Any]) -> dict[tuple, str]:
    """What a pipeline element's step compiles for, each with its description: the shapes of its
    input arrays (a jit compiles once per distinct set), described by the micro-batches x rows x
    row length of `tokens` and every input of another shape. A redundancy-free program runs one
    call per part and one for the trees that fit a row whole, each compiling per input shapes."""
    if "program" not in element:
        return {_shape_key(element["inputs"]): _describe(element["inputs"])}
    program = element["program"]
    calls = [part.inputs for part in program.parts]
    if program.whole is not None:
        calls.append(program.whole.inputs())
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


def train(cfg: TrainConfig, *, resume: bool = False) -> None:
    """Run `cfg` from its trees to its summary (and the baseline comparison when
    `run.compare_baseline`); with `resume`, continue from the latest checkpoint in
    `checkpoint.dir`. A multi-process run calls `jtree.parallel.distributed.initialize_from_env` first."""
    if configure_host_malloc(cfg.run.host_malloc):  # before anything starts a jax backend
        say("host malloc: keeps freed memory (run.host_malloc; CPU steps reuse their temporaries)")
    run = TrainingRun.build(cfg)
    try:
        with run.compile_watch:
            state, start = run.restore(resume)
            say(run.describe(state))
            t_run = time.perf_counter()
            state, history = run.loop(state, start)
            checkpoint_dir = run.checkpointer.directory if run.checkpointer is not None else None
            say(summary(history, time.perf_counter() - t_run, run.load_report.n_bad,
                        checkpoint_dir))
            if cfg.run.compare_baseline and history:
                if jax.process_count() == 1:
                    before = run.compile_watch.total
                    compare_with_baseline(cfg, run.trainer, run.builders, run.trees, state)
                    done = run.compile_watch.total - before
                    say(f"compare_baseline: {done.n} compile(s) in {done.seconds:.1f} s")
                else:
                    say("compare_baseline: skipped (single-process check)")
            if cfg.run.mode != "redundancy_free":  # its parts run their own functions
                # The jit's own cache: one entry per step program this run compiled.
                say(f"step programs compiled: {run.trainer.step_fn._cache_size()}")
    finally:
        run.close()
