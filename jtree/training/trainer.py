"""What a run's config alone determines: the mesh, the model graph and its parameter shardings, the
optimizer and the jitted step functions.

`Trainer` holds the ('data', 'fsdp', 'context', 'model') mesh, the model graph and its parameter
shardings, the optimizer and the jitted step functions (data parallel over rows, parameters and
optimizer state sharded over `fsdp`, tensor parallel inside shard_map). It needs no data, so
`jtree.launch.lower_step` lowers the very step a run trains with, and `jtree.memory` plans its
memory. The run itself (data, checkpoints, the loop) is `jtree.training.run`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jtree.config import TrainConfig, config_values
from jtree.layout.batch import DeviceBatch
from jtree.layout.planner import check_row_slices, check_steps_per_octave
from jtree.models import create_model
from jtree.models.architectures import architecture_of_config
from jtree.models.lora import lora_specs, model_params, trainable, trainable_grads, with_lora
from jtree.objectives.objective import finish_metrics, logprob_gap_sums
from jtree.parallel.context import (
    ContextCapacities,
    agreed,
    check_rows_within_processes,
    context_batch,
    context_capacities,
)
from jtree.parallel.sharding import (
    MODEL,
    context_size,
    describe_mesh,
    make_mesh,
    named,
    param_path,
    param_rules,
    param_specs,
)
from jtree.partitioning.redundancy_free.executor import RedundancyFreeStep
from jtree.partitioning.redundancy_free.mesh_executor import MeshRedundancyFreeStep
from jtree.step.critic_params import as_critic_trunk, flat_params, policy_params, with_named
from jtree.step.optimizer import (
    TrainState,
    apply_gradients,
    make_optimizer,
    state_shardings,
)
from jtree.step.train_step import (
    make_sharded_grad_fn,
    make_sharded_logprob_fn,
    make_train_step,
    sharded_graphdef,
)
from jtree.training.run_data import (
    rfree_capacity,
    to_global,
)


@jax.jit
def _engine_gap(trainer: jax.Array, engine: jax.Array, weight: jax.Array) -> jax.Array:
    """The mean |trainer - engine| log-prob over the trained tokens of a whole step's inputs."""
    return finish_metrics(logprob_gap_sums(trainer, engine, weight))["engine_logprob_gap"]


@dataclasses.dataclass
class Trainer:
    """What the config alone determines: mesh, model graphs, parameter shardings, optimizer and
    the jitted step, log-prob and init functions. No data: `jtree.launch.lower_step` lowers the
    step a run trains with from it.

    `specs` lay out the trained parameters (a `jtree.models.lora.LoraParams` with `model.lora`)
    and their optimizer state (the step reads LoRA adapters in another layout,
    `jtree.models.lora.lora_specs`), `model_specs` the model's own (what a Hugging Face
    checkpoint loads into and the reference model runs on). `ref_logprob_fn` runs the reference
    model of `objective.reference` (None when the data carries the reference log-probs);
    `teacher` is the distillation teacher of `objective.distill` (None without one)."""

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
    teacher: Teacher | None = None

    @classmethod
    def build(cls, cfg: TrainConfig, devices: Sequence[jax.Device] | None = None) -> Trainer:
        """Compiles nothing: the model is built abstractly (shapes only) and the functions are
        jitted wrappers that compile on their first call. The mesh spans `devices` (default every
        device of every process); `jtree.launch.compile` passes a target's compile-only devices,
        so the same step is built for a chip this host does not have."""
        critic, network = cfg.objective.critic, cfg.critic_network
        if critic is not None and cfg.model.lora is not None:
            raise ValueError("model.lora: not available with objective.critic (only the "
                             "adapters would train: the critic's parameters would stay frozen)")
        context = cfg.mesh.context
        check_row_slices(cfg.data.seq_len, context, ("mesh.context", "data.seq_len"))
        mesh = make_mesh(cfg.mesh, devices)
        arch, mcfg = cfg.model.architecture, cfg.model.config
        check_reference(cfg)
        check_distill(cfg)
        check_off_policy(cfg)
        abstract = nnx.eval_shape(lambda: create_model(arch, mcfg, cfg.runtime, seed=cfg.run.seed,
                                                       **cfg.model_args))
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
        chunk, temperature = cfg.objective.logprob_chunk, cfg.objective.temperature
        logprob_fn = jax.jit(make_sharded_logprob_fn(graphdef, mesh, step_specs, chunk,
                                                     temperature))
        ref_logprob_fn = None
        if cfg.objective.reference is not None:  # the policy alone, without the critic
            policy = nnx.eval_shape(lambda: create_model(arch, mcfg, cfg.runtime))
            ref_specs = policy_params(model_specs)
            ref_logprob_fn = jax.jit(make_sharded_logprob_fn(
                sharded_graphdef(policy, ref_specs, mesh), mesh, ref_specs, chunk, temperature))
        teacher = None if cfg.objective.distill is None else Teacher.build(cfg, mesh)

        def init() -> TrainState:
            params = nnx.split(create_model(arch, mcfg, cfg.runtime, seed=cfg.run.seed,
                                            **cfg.model_args))[1]
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
                   rfree_step, model_specs, ref_logprob_fn, teacher)

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

    def train_on(self, state: TrainState, inputs: DeviceBatch, *, old_logprobs_stale: bool,
                 engine_logprobs: bool, reference: Any = None, teacher: Any = None
                 ) -> tuple[TrainState, dict[str, jax.Array]]:
        """One optimizer step on placed `inputs`, with the forwards it needs first: the old
        log-probs from the current parameters when the batch's are missing or stale
        (`jtree.step.batches.old_logprobs_stale`), the reference model's log-probs for the KL
        term when `reference` (its parameters, `reference_params`) is given, and the
        distillation teacher's scores when `teacher` (its parameters, `Teacher.params`) is.

        `engine_logprobs`: whether the batch's old log-probs are the rollout engine's. The RL
        metric `engine_logprob_gap` compares them with the trainer's: the step's own when it
        trains on them, the recomputed ones when they are stale; without them it is left out."""
        gap = None
        if old_logprobs_stale:
            recomputed = self.logprob_fn(state.params, inputs)
            if engine_logprobs:
                c = inputs.coefficients
                gap = _engine_gap(recomputed, c.old_logprobs, c.weight)
            inputs = inputs.with_coefficients(old_logprobs=recomputed)
        if reference is not None:
            inputs = inputs.with_coefficients(ref_logprobs=self.ref_logprob_fn(reference, inputs))
        if teacher is not None:
            inputs = self.teacher.score(teacher, inputs)
        state, metrics = self.step_fn(state, inputs)
        if "engine_logprob_gap" in metrics and old_logprobs_stale:
            metrics = {k: v for k, v in metrics.items() if k != "engine_logprob_gap"}
            if gap is not None:
                metrics["engine_logprob_gap"] = gap
        return state, metrics

    def initial_state(self) -> TrainState:
        """A fresh TrainState: random init, or the weights of `model.init_from` (and of a
        separate critic's `objective.critic.init_from` checkpoint) placed directly onto the mesh
        (each host reads only what its devices hold)."""
        path = self.cfg.model.init_from
        critic = self.cfg.objective.critic
        if path is None and (critic is None or critic.checkpoint_dir is None):
            return self.init_fn()
        depth = self.cfg.model_args["mtp_depth"]
        if critic is None and self.loaded_mtp_depth(path) == depth:
            params = self.load_hf(path, "model.init_from", mtp_depth=depth)
        else:
            params = self.start_params()
        if self.cfg.model.lora is not None:
            params = jax.jit(lambda p: with_lora(p, self.cfg.model.lora, self.cfg.run.seed),
                             out_shardings=self.shardings.params)(params)
        opt_state = jax.jit(lambda p: self.optimizer.init(trainable(p)),
                            out_shardings=self.shardings.opt_state)(params)
        return TrainState(params, opt_state,
                          jax.device_put(jnp.zeros((), jnp.int32), self.shardings.step))

    def loaded_mtp_depth(self, path: str | None) -> int:
        """How many of the run's MTP layers (`objective.mtp_depth` with `objective.mtp_weight`)
        the Hugging Face checkpoint `path` supplies, with the MTP modules' shared fc and norms
        (0: all MTP modules start from the seeded init)."""
        from jtree.hf import carries_mtp, mtp_depth_in

        depth = self.cfg.model_args["mtp_depth"]
        if path is None or not depth or not carries_mtp(self.cfg.model.config):
            return 0
        return min(depth, mtp_depth_in(path))

    def start_params(self) -> Any:
        """The starting parameters of a run with a Hugging Face checkpoint to load that does not
        hold all of them (`model.init_from` without all the run's MTP layers, a critic's
        `init_from`): what the checkpoints hold, the rest (value heads, a `random` critic, an
        unloaded policy, MTP modules) from the seeded init, of which only those parameters are
        computed (`jtree.step.critic_params`)."""
        cfg = self.cfg
        critic, path = cfg.objective.critic, cfg.model.init_from
        loaded = {}
        if path is not None:
            loaded = flat_params(self.load_hf(path, "model.init_from",
                                              mtp_depth=self.loaded_mtp_depth(path)))
            if critic is not None and critic.separate and critic.init_from == "policy":
                loaded |= as_critic_trunk(loaded)
        if critic is not None and critic.checkpoint_dir is not None:
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

    def load_hf(self, path: str, key: str, config: Any = None, prefix: str = "", *,
                mtp_depth: int = 0) -> Any:
        """The model parameters of Hugging Face checkpoint `path` placed directly onto the mesh
        (each host reads only what its devices hold), laid out as the parameters under `prefix`
        ('critic.': the separate critic's; what the run does not hold, replicated), with its
        first `mtp_depth` MTP layers (`jtree.hf.load`); its config.json must agree with
        `config` (default: `model`; an error names `key`, the config key that gave `path`, and
        the field)."""
        from jtree.hf import load

        mcfg = self.cfg.model.config if config is None else config
        section = "model" if config is None else "objective.critic.network"
        loaded, model = load(path, self.cfg.runtime, mtp_depth=mtp_depth,
                             shardings=shardings_by_name(self.mesh, self.model_specs, prefix))
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


def shardings_by_name(mesh: Mesh, specs: Any, prefix: str = ""
                      ) -> Callable[[str, tuple[int, ...]], NamedSharding]:
    """A checkpoint loader's placement (`jtree.hf.load`'s `shardings`): the sharding `specs`
    give the parameter named `prefix` + name on `mesh`; a parameter they do not hold is
    replicated."""
    by_name = {param_path(p).replace("/", "."): s for p, s in
               jax.tree_util.tree_flatten_with_path(named(mesh, specs))[0]}
    replicated = NamedSharding(mesh, P())
    return lambda name, shape: by_name.get(prefix + name, replicated)


@dataclasses.dataclass(frozen=True)
class Teacher:
    """The distillation teacher of `objective.distill`: its checkpoint directory, its
    parameters' specs on the run's mesh (its own sharding rules, from its own config.json, so a
    teacher larger than the policy, or of another architecture, runs as itself), and the jitted
    forward that scores a step's batch with it at `objective.temperature`, no gradient: the
    log-prob of every token [M, rows, S] for the `sampled` estimator, its whole log-softmax
    [M, rows, S, vocab] for `full`. One forward over the tree batch scores each shared prefix
    once, as the reference model's does."""

    path: str
    specs: Any
    mesh: Mesh
    runtime: Any
    full_vocabulary: bool
    logprob_fn: Any

    @classmethod
    def build(cls, cfg: TrainConfig, mesh: Mesh) -> Teacher:
        """Reads the teacher's config.json only (no weights); refuses a vocabulary other than
        the policy's, whose token ids the teacher would score as other tokens."""
        from jtree.hf import read_model_config

        distill = cfg.objective.distill
        path, full = distill.teacher, distill.estimator == "full"
        if full and (mesh.shape[MODEL] > 1 or context_size(mesh) > 1):
            raise ValueError(f"objective.distill.estimator: full carries the teacher's whole "
                             f"vocabulary per token, on one device's rows (mesh.model="
                             f"{mesh.shape[MODEL]}, mesh.context={context_size(mesh)}; set both "
                             "to 1 or use estimator sampled)")
        config = read_model_config(path)
        if config.vocab_size != cfg.model.config.vocab_size:
            raise ValueError(f"objective.distill.teacher: {path} has vocab_size "
                             f"{config.vocab_size}, the policy {cfg.model.config.vocab_size} "
                             "(the teacher must share the policy's tokenizer)")
        abstract = nnx.eval_shape(lambda: create_model(
            architecture_of_config(config).name, config, cfg.runtime))
        try:
            specs = param_specs(nnx.split(abstract)[1], param_rules(config, mesh.shape[MODEL]),
                                mesh)
            graphdef = sharded_graphdef(abstract, specs, mesh)
        except ValueError as e:
            raise ValueError(f"objective.distill.teacher ({path}) on mesh "
                             f"{describe_mesh(mesh)}: {e}") from None
        obj = cfg.objective
        return cls(path, specs, mesh, cfg.runtime, full, jax.jit(make_sharded_logprob_fn(
            graphdef, mesh, specs, obj.logprob_chunk, obj.temperature, full_vocabulary=full)))

    def score(self, params: Any, inputs: DeviceBatch) -> DeviceBatch:
        """`inputs` with the teacher's scores of its tokens, where the loss reads them: the
        log-probs as `coefficients.teacher_logprobs`, or the whole log-softmax as
        `teacher_dist`."""
        scores = self.logprob_fn(params, inputs)
        if self.full_vocabulary:
            return dataclasses.replace(inputs, teacher_dist=scores)
        return inputs.with_coefficients(teacher_logprobs=scores)

    def params(self) -> Any:
        """The teacher's weights placed directly onto the mesh by its specs (each host reads
        only what its devices hold)."""
        from jtree.hf import load

        _, model = load(self.path, self.runtime,
                        shardings=shardings_by_name(self.mesh, self.specs))
        return nnx.split(model)[1]


def check_distill(cfg: TrainConfig) -> None:
    """`objective.distill` needs the teacher's forward on the step's batch, which
    redundancy-free parts do not run."""
    if cfg.objective.distill is not None and cfg.run.mode == "redundancy_free":
        raise ValueError("objective.distill: run.mode=redundancy_free runs no teacher forward on "
                         "its parts; use run.mode tree, baseline or auto")


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


def check_off_policy(cfg: TrainConfig) -> None:
    """`objective.off_policy` needs the step's (path, trained token) pairs and the trainer's old
    log-probs recomputed on the batch (`jtree.objectives.off_policy`): redundancy-free parts
    carry neither."""
    if not cfg.objective.off_policy.enabled:
        return
    if cfg.run.mode == "redundancy_free":
        raise ValueError(f"objective.off_policy.{cfg.objective.off_policy.setting}: not "
                         "available with run.mode=redundancy_free (its parts run no old "
                         "log-prob forward and carry no per-path pairs); use run.mode tree, "
                         "baseline or auto")


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


