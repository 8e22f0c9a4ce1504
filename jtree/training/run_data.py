"""What a training run trains on: the trees of `data.path`, the step builders of each layout
mode, the builder that feeds the run's pipeline for `run.mode`, and the placement of each step's
host-local arrays on the mesh (every process feeds the data shards its devices hold)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jtree.config import TrainConfig
from jtree.config.architectures import MOE_FEED_FORWARDS
from jtree.layout.batch import DeviceBatch
from jtree.layout.flop_model import FlopModel
from jtree.layout.pruning import PrunedTree, prune_trees, pruning_blocker
from jtree.parallel.sharding import batch_specs, row_shards
from jtree.training.report import say
from jtree.training.step_builders import (
    AutoStepBuilder,
    RfreeStepBuilder,
    RfreeStepConfig,
    StepBuilder,
    step_builder,
)
from jtree.training.tree_files import LoadReport, load_trees
from jtree.trees.routed_experts import Experts
from jtree.trees.traces import TRUNCATED_POLICIES
from jtree.trees.tree import TrajectoryTree


def host_data_shards(mesh: Mesh) -> tuple[int, ...]:
    """The row shards (data x fsdp, `jtree.parallel.sharding.row_shards`) whose devices live on this
    process (contiguous)."""
    pid = jax.process_index()
    groups = mesh.devices.reshape(row_shards(mesh), -1)  # a row shard's context x model group
    shards = tuple(i for i in range(len(groups))
                   if any(d.process_index == pid for d in groups[i]))
    if not shards or shards != tuple(range(shards[0], shards[-1] + 1)):
        raise ValueError(f"process {pid}: its devices hold data shards {shards}; expected a "
                         "non-empty contiguous range (check the mesh/device order)")
    return shards


def to_global(mesh: Mesh, local: DeviceBatch, n_local_shards: int) -> DeviceBatch:
    """Host-local [M, rows_local, ...] arrays -> global arrays split over `data` and `fsdp` (and
    their tokens over `context`: a batch laid out for it, `jtree.training.trainer.Trainer.place`)."""
    def one(value: np.ndarray, spec: jax.sharding.PartitionSpec) -> jax.Array:
        shape = (value.shape[0], value.shape[1] // n_local_shards * row_shards(mesh),
                 *value.shape[2:])
        return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), value, shape)

    return jax.tree_util.tree_map(one, local, batch_specs(local))


def rfree_capacity(cfg: TrainConfig) -> int:
    """`run.capacity` (default `data.seq_len`), checked against the rows it must fit."""
    capacity = cfg.data.seq_len if cfg.run.capacity is None else cfg.run.capacity
    if not 1 <= capacity <= cfg.data.seq_len:
        raise ValueError(f"run.capacity={capacity}: must be in [1, data.seq_len={cfg.data.seq_len}]")
    return capacity


def gdn_chunk_size(cfg: TrainConfig) -> int | None:
    """The GDN chunk size of the batches: `data.gdn_chunk_size` when the model has
    linear-attention layers, else None (no chunk tables)."""
    return cfg.data.gdn_chunk_size if cfg.model.config.decoder().needs_gdn_tables else None


def replay_shape(cfg: TrainConfig) -> tuple[int, int] | None:
    """With `objective.routing_replay`: (L, k), the model's MoE layers and experts per token,
    the shape of each token's routed experts; else None."""
    if not cfg.objective.routing_replay:
        return None
    layers = sum(kind.ffn in MOE_FEED_FORWARDS for kind in cfg.model.config.decoder().layers)
    return layers, cfg.model.config.num_experts_per_tok


def _experts(cfg: TrainConfig) -> Experts | None:
    """With `objective.routing_replay`: the model's routing, which traces' routed experts are
    read against (each turn's, a bad record when it does not fit); else None."""
    shape = replay_shape(cfg)
    return None if shape is None else Experts(*shape, cfg.model.config.num_experts)


def _check_replay(cfg: TrainConfig, trees: Sequence[TrajectoryTree], source: str) -> None:
    """Refuse routing replay on data that carries no routed experts (their shape and ids were
    checked against the model as each record was read)."""
    if all(t.routed_experts is None for t in trees):
        raise ValueError(f"objective.routing_replay: {source} carries no routed_experts "
                         "(the traces' turns give none), so there is no engine routing to replay")


def check_training_trees(cfg: TrainConfig, trees: Sequence[TrajectoryTree], source: str) -> None:
    """Refuse trees that lack what the objective reads: a reward per path for the critic's GAE,
    the engine's log-probs for the off-policy weights, routed experts for routing replay.
    `source` names where the trees came from in the error."""
    if cfg.objective.critic is not None:
        missing = next((i for i, t in enumerate(trees) if t.rewards is None), None)
        if missing is not None:
            raise ValueError(f"{source}: tree {missing}: no reward (objective.critic computes "
                             "GAE from one reward per path)")
    if cfg.objective.off_policy.enabled:
        missing = next((i for i, t in enumerate(trees) if t.old_logprobs is None), None)
        if missing is not None:
            raise ValueError(f"{source}: tree {missing}: no old_logprobs (objective.off_policy."
                             f"{cfg.objective.off_policy.setting} weighs by the engine's "
                             "behavior log-probs: records' old_logprobs, traces' output_logprobs)")
    if cfg.objective.routing_replay:
        _check_replay(cfg, trees, source)


def load_training_trees(cfg: TrainConfig) -> tuple[list[TrajectoryTree], LoadReport]:
    """The trees of `data.path` (bad records handled as `data.on_bad_record` says), announced
    with their sharing."""
    d = cfg.data
    max_path_len = None if cfg.run.mode == "redundancy_free" else d.seq_len  # rfree splits paths
    trees, report = load_trees(d.path, d.format, vocab_size=cfg.model.config.vocab_size,
                               on_bad_record=d.on_bad_record, tokenizer=d.tokenizer,
                               trace_drift=d.trace_drift, truncated=d.truncated,
                               aborted=d.aborted,
                               max_path_len=max_path_len,
                               advantage=cfg.objective.advantage_estimator,
                               turn_discount=cfg.objective.turn_discount,
                               shared_masks=cfg.objective.kind == "gspo",
                               experts=_experts(cfg))
    check_training_trees(cfg, trees, d.path)
    total = sum((t.stats() for t in trees[1:]), trees[0].stats())
    say(f"data: {len(trees)} trees from {d.path} ({d.format}): {total.n_flat_tokens} flat tokens, "
        f"{total.n_tree_tokens} tree tokens, POR {total.por:.3f}"
        + (f"; skipped {report.n_bad} bad record(s), first: {report.first_errors[0]}"
           if report.n_bad else "")
        + (f"; branched {report.n_branched} trace rollout(s) where their turns drift, first: "
           f"{report.first_branches[0]}" if report.n_branched else "")
        + (f"; {report.n_truncated} trace turn(s) cut at the engine's length limit "
           f"(data.truncated={d.truncated}: {TRUNCATED_POLICIES[d.truncated]})"
           if report.n_truncated else "")
        + (f"; dropped {report.n_dropped} trace rollout(s) (data.truncated / data.aborted = "
           f"drop), first: {report.first_dropped[0]}" if report.n_dropped else ""))
    return trees, report


def pruned_trees(cfg: TrainConfig, trees: Sequence[TrajectoryTree]) -> list[PrunedTree] | None:
    """The run's trees pruned of their zero-gradient paths when `data.prune_zero_gradient` asks
    for it (None otherwise), announced with what it saves or why nothing is prunable."""
    if not cfg.data.prune_zero_gradient:
        return None
    if cfg.run.mode == "redundancy_free":
        say("data.prune_zero_gradient: not applied in run.mode=redundancy_free")
        return None
    router_aux = bool(getattr(cfg.model.config, "output_router_logits", False))
    blocker = pruning_blocker(cfg.objective, router_aux)
    pruned = prune_trees(trees, cfg.objective, router_aux)
    saved = sum(p.saved_tokens for p in pruned)
    total = sum(t.n_tree_tokens for t in trees)
    say("data.prune_zero_gradient: " + (f"nothing to prune ({blocker})" if blocker else
        f"{saved} of {total} tree tokens on zero-advantage paths only, left out; "
        f"{sum(p.tree is None for p in pruned)} tree(s) dropped whole"))
    return pruned


def check_share_prefixes(cfg: TrainConfig, n_data: int) -> None:
    """Refuse `data.share_prefixes: across_groups` where nothing is shared (`run.mode=baseline`
    trains every path alone), else announce how the steps merge their groups."""
    if cfg.data.share_prefixes != "across_groups":
        return
    if cfg.run.mode == "baseline":
        raise ValueError("data.share_prefixes=across_groups: run.mode=baseline trains every path "
                         "alone, so nothing is shared; use run.mode=tree, auto or redundancy_free")
    bins = (f"{n_data} data shard(s)" if cfg.run.mode == "redundancy_free" else
            f"{n_data} data shard(s) x {cfg.data.micro_batches} micro-batch(es)")
    say(f"data.share_prefixes: across_groups: each step's trees merged at their common prefixes, "
        f"one tree per bin of {bins}; advantages stay per group")


def trained_modes(cfg: TrainConfig) -> tuple[str, ...]:
    """The layout modes whose steps the run trains on: `auto` chooses between tree and baseline
    per step; `redundancy_free` trains on programs, not on laid-out rows."""
    return {"auto": ("tree", "baseline"), "redundancy_free": ()}.get(cfg.run.mode,
                                                                    (cfg.run.mode,))


class StepBuilders:
    """The `StepBuilder` of each layout mode over the run's trees, each built once, so the run's
    pipeline and the baseline comparison lay out the same steps at the same shapes. The trained
    modes get `data.rows_per_micro_batch` rows (default: the fewest that hold every step of the
    run); a mode built later on demand gets the fewest that hold every step of the run. Every
    mode splits its rows over the `mesh.context` devices by attention work (gaps at slice ends,
    `jtree.layout.context_rows`), as the step it feeds runs them."""

    def __init__(self, cfg: TrainConfig, trees: Sequence[TrajectoryTree], n_data: int,
                 shards: tuple[int, ...]):
        self._cfg, self._trees, self.n_data, self._shards = cfg, trees, n_data, shards
        check_share_prefixes(cfg, n_data)
        self._pruned = pruned_trees(cfg, trees)
        self._built: dict[str, StepBuilder] = {}
        self.rows: dict[str, int] = {}
        for mode in trained_modes(cfg):
            self._build(mode, cfg.data.rows_per_micro_batch)

    def __getitem__(self, mode: str) -> StepBuilder:
        """The builder of `mode`, built now if the run does not train on it."""
        if mode not in self._built:
            self._build(mode, None)
        return self._built[mode]

    def _build(self, mode: str, rows: int | None) -> None:
        cfg = self._cfg
        data = dataclasses.replace(cfg.data, rows_per_micro_batch=rows)
        builder = step_builder(self._trees, data, mode, normalization=cfg.objective.normalization,
                               n_shards=self.n_data, shards=self._shards, steps=cfg.run.steps,
                               gdn_chunk_size=gdn_chunk_size(cfg),
                               critic=cfg.objective.critic is not None,
                               off_policy=cfg.objective.off_policy.enabled,
                               context=cfg.mesh.context, pruned=self._pruned,
                               shared_masks=cfg.objective.kind == "gspo",
                               routing=replay_shape(cfg))
        self._built[mode] = builder
        self.rows[mode] = builder.config.layout.rows


def run_step_builder(cfg: TrainConfig, trees: Sequence[TrajectoryTree], builders: StepBuilders,
                     n_devices: int = 1
                     ) -> tuple[StepBuilder | AutoStepBuilder | RfreeStepBuilder, str]:
    """What feeds the run's pipeline for `run.mode`, and a description of its layout
    (`n_devices`: the mesh's; a redundancy-free run on more than one lays its parts out for the
    mesh executor)."""
    d = cfg.data
    if cfg.run.mode == "redundancy_free":
        capacity = rfree_capacity(cfg)
        config = RfreeStepConfig(cfg.objective.normalization, d.seq_len, capacity,
                                 d.trees_per_step, gdn_chunk_size(cfg),
                                 cfg.run.row_steps_per_octave, uniform=n_devices > 1,
                                 merge_into=builders.n_data
                                 if d.share_prefixes == "across_groups" else None)
        how = ("one device call per part" if n_devices == 1 else
               "rows of one shape per step, part trees in lockstep over the row shards")
        return RfreeStepBuilder(trees, config), (
            f"parts of <= {capacity} tokens in rows fitted to them (at most {d.seq_len}), {how}")
    modes = trained_modes(cfg)
    builder = (AutoStepBuilder({m: builders[m] for m in modes}, FlopModel.for_config(
        cfg.model.config), cfg.run.auto_min_gain) if cfg.run.mode == "auto"
        else builders[cfg.run.mode])
    rows = "/".join(f"{builders.rows[m]}" for m in modes)
    length = (f"{d.seq_len}" if d.row_steps_per_octave is None else
              f"<= {d.seq_len} ({d.row_steps_per_octave} lengths per octave)")
    split = ("" if cfg.mesh.context == 1 else
             f", each row over {cfg.mesh.context} context devices balanced by attention work")
    return builder, (f"{d.micro_batches} micro-batch(es) x {rows} rows ({'/'.join(modes)}) x "
                     f"{length} per data shard{split}")
