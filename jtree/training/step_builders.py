"""Step builders: a step's tree indices -> this host's linearized arrays, in each layout mode.

A tree larger than a row is cut into capacity parts (`jtree.partitioning.partition`); the baseline
packs paths. Every host plans the same global step (`jtree.layout.planner.plan_step`: units
balanced over the global data shards x micro-batches, packed into rows, the row length, score
width and GDN chunk capacity), so all hosts agree on shapes and statistics without talking to each
other, and linearizes only the shards its devices hold, where the plan puts them. Loss
coefficients stay raw (normalizer 1) and `row_norm` carries each row's share of the normalizer;
the train step divides by the global sum (`jtree.objectives.objective.normalize_coefficients`),
so no host needs another host's trees.

Models with linear-attention layers also get the gated-delta-rule chunk tables
(`LayoutConfig.gdn_chunk_size`), with the one chunk capacity the plan gives every micro-batch and
shard of the step (or `gdn_chunks` fixed for the whole run). `AutoStepBuilder` picks tree or
baseline mode per step by the FLOP model; `RfreeStepBuilder` builds redundancy-free programs.

With `data.share_prefixes: across_groups` (`CrossGroup`) a tree-mode step's units are not the
trees' own: the step's trees are balanced over its data shards x micro-batches and merged per bin
(`jtree.layout.cross_group`), and each bin's merged tree (cut into capacity parts when larger than
a row) is that bin's units, which the planner packs where they are (`plan_step(bins=...)`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal

import grain
import numpy as np

from jtree.config import DataConfig
from jtree.config.objective import Normalization
from jtree.config.run import ROW_STEPS_PER_OCTAVE
from jtree.layout.baseline import flatten_paths
from jtree.layout.batch import DeviceBatch, concatenate_rows, padding, stack
from jtree.layout.coefficients import batch_normalizer, path_coefficients
from jtree.layout.cross_group import merge_per_bin
from jtree.layout.flop_model import FlopModel, choose_mode, tree_work
from jtree.layout.linearize import linearize
from jtree.layout.microbatches import unit_counts
from jtree.layout.off_policy import behavior_disagreement
from jtree.layout.planner import (
    LayoutConfig,
    RowPlan,
    StepPlan,
    check_steps_per_octave,
    plan_step,
    row_length_ladder,
    rows_to_hold,
)
from jtree.layout.pruning import PrunedTree
from jtree.layout.routing import RoutingCounts, routing_counts
from jtree.objectives.pairs import padding_pairs, pair_count, pair_width, with_pairs
from jtree.partitioning.partition import Method as PartitionMethod
from jtree.partitioning.partition import partition
from jtree.partitioning.redundancy_free.layout import build_program
from jtree.trees.part import TreePart
from jtree.trees.tree import TrajectoryTree

Mode = Literal["tree", "baseline"]


@dataclasses.dataclass(frozen=True)
class CrossGroup:
    """How a tree-mode step merges its trees across groups (`data.share_prefixes:
    across_groups`): each bin's merged tree is cut by `partition_method` when larger than a row;
    `shared_masks` merges tokens only where the paths agree on their trained bit (GSPO)."""

    partition_method: PartitionMethod = "heuristic"
    shared_masks: bool = False


@dataclasses.dataclass(frozen=True)
class StepUnits:
    """The units of one step and what the planner needs of them: `counts` (`unit_counts`),
    `pairs` each unit's critic pairs (None without a critic), `bins` each bin's units when
    cross-group merging placed them (None: the planner balances), `merge_saved` the tree tokens
    the merge computes once instead of once per group."""

    units: list[TrajectoryTree]
    counts: dict[str, Any]
    pairs: list[int] | None
    bins: tuple[tuple[int, ...], ...] | None = None
    merge_saved: int = 0


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """What every step of a run is built with: `mode`, `normalization`, `trees_per_step`, the
    global data shards this host feeds (`shards`, out of `layout.n_shards`) and the layout policy
    (`jtree.layout.planner.LayoutConfig`: micro-batches, rows per micro-batch, row lengths, GDN chunk
    tables). With `critic` (PPO's critic, `jtree.objectives.critic`) or `off_policy` (the
    off-policy weights, `jtree.objectives.off_policy`) every micro-batch carries its (path,
    trained token) pairs (`jtree.objectives.pairs`), `pair_len` of them per row (None: the step's
    own need); with `off_policy` the step's info carries the trees'
    `offpolicy_behavior_disagreement`. `cross_group`: merge each step's trees per bin
    (`CrossGroup`; tree mode only). `routing` (L, k: the model's MoE layers and experts per
    token) turns routing replay on: every micro-batch carries the units' routed experts
    (`jtree.layout.routing`; -1 on a unit without them and on padding) and the step's info its
    `routing_disagreement` and `routing_coverage` (`routing_info`)."""

    mode: Mode
    normalization: Normalization
    trees_per_step: int
    shards: tuple[int, ...]
    layout: LayoutConfig
    critic: bool = False
    off_policy: bool = False
    pair_len: int | None = None
    cross_group: CrossGroup | None = None
    routing: tuple[int, int] | None = None

    @property
    def pairs(self) -> bool:
        """Whether the steps carry (path, trained token) pairs."""
        return self.critic or self.off_policy

    def __post_init__(self) -> None:
        if self.layout.micro_batches is None:
            raise ValueError("layout.micro_batches: a run's steps need a fixed count")
        if not self.shards or not all(0 <= s < self.layout.n_shards for s in self.shards):
            raise ValueError(f"shards: {self.shards} must be non-empty indices of the "
                             f"{self.layout.n_shards} data shards")
        if self.cross_group is not None and self.mode != "tree":
            raise ValueError(f"cross_group: merges trees in tree mode, not in {self.mode} mode")


def training_units(tree: TrajectoryTree, mode: Mode, seq_len: int,
                   method: PartitionMethod = "heuristic") -> list[TrajectoryTree]:
    """What gets packed into rows: the tree, its capacity parts when it is larger than a row
    (`jtree.partitioning.partition` with `method`, exact: each path owned by one part), or its paths
    (baseline)."""
    if mode == "baseline":
        return flatten_paths([tree])
    if tree.n_tree_tokens <= seq_len:
        return [tree]
    return list(partition(tree, seq_len, method).parts)


def routing_info(trees: Sequence[TrajectoryTree]) -> dict[str, np.ndarray]:
    """Routing replay's gauges of a step's trees (`jtree.layout.routing.RoutingCounts`): the
    fraction of shared routed tokens whose paths' engine routings differ (the first path's is
    replayed), and the fraction of trained tokens that replay an engine routing."""
    counts = sum((routing_counts(t) for t in trees), RoutingCounts())
    return {"routing_disagreement": np.float64(counts.disagreement),
            "routing_coverage": np.float64(counts.coverage),
            "routing_disagreeing_tokens": np.int64(counts.disagreeing)}


def unit_routing(unit: TrajectoryTree, shape: tuple[int, int]) -> list[np.ndarray]:
    """`unit`'s per-path routed experts, -1 throughout (the trainer's own routing) when it
    carries none."""
    if unit.routed_experts is not None:
        return list(unit.routed_experts)
    return [np.full((n, *shape), -1, np.int32) for n in unit.path_lengths]


def signal_means(trees: Sequence[TrajectoryTree], normalization: Normalization
                 ) -> dict[str, np.float64]:
    """The mean reward (`reward_mean`) and advantage (`advantage_mean`) of a step's trees, each
    weighted as the objective weighs it, so the log shows the signal the step learns from rather
    than an average over records the loss counts differently: trained token t of path p counts
    by its loss coefficient c[p, t] (`jtree.layout.coefficients.path_coefficients`: the path's
    weight, over its trained tokens under `seq_mean_token_mean`), a path's reward by its share
    sum_t c[p, t]. So under `seq_mean_token_mean` each path counts by its weight (its advantage
    the mean over its trained tokens), under `token_mean` and `seq_mean_token_sum` each trained
    token does. The batch normalizer cancels; off-policy importance weights are not applied.
    A mean is left out when a tree lacks its data or the step trains no token."""
    coefficients = [path_coefficients(t, normalization, 1.0) for t in trees]
    shares = [np.array([c.sum(dtype=np.float64) for c in cs]) for cs in coefficients]
    total = float(sum(s.sum() for s in shares))
    means = {}
    if total <= 0:
        return means
    if all(t.rewards is not None for t in trees):
        means["reward_mean"] = np.float64(
            sum(float(s @ t.rewards) for s, t in zip(shares, trees)) / total)
    if all(t.advantages is not None for t in trees):
        means["advantage_mean"] = np.float64(sum(
            float(c.astype(np.float64) @ a) for cs, t in zip(coefficients, trees)
            for c, a in zip(cs, t.advantages)) / total)
    return means


def step_info(trees: Sequence[TrajectoryTree], units: Sequence[TrajectoryTree],
              normalization: Normalization, pruned_tokens: int = 0, merge_saved: int = 0
              ) -> dict[str, np.ndarray]:
    """Global statistics of a step (every host computes them from the same trees, before any
    pruning: the old log-probs' disagreement decides a recompute as in the unpruned step, and
    the zero-advantage paths pruning leaves out still count in `signal_means`, as in the
    step's normalizer); `pruned_tokens`: the tree tokens pruning left out
    (`jtree.layout.pruning`); `merge_saved`: those merging across groups computes once instead
    of once per group (`jtree.layout.cross_group`), whose units' old log-probs are judged too (a
    merged token takes one value for the paths of several groups)."""
    stats = sum((t.stats() for t in trees[1:]), trees[0].stats())
    has_old = all(t.old_logprobs is not None for t in trees)
    disagreement = 0.0
    if has_old:
        judged = list(trees) + (list(units) if merge_saved else [])
        for t in judged:  # position 0 is never scored, as in `linearize`
            old = [np.concatenate([[0.0], o[1:]]) for o in t.old_logprobs]
            disagreement = max(disagreement, t.tree_token_values(old)[1])
    work = tree_work(units)[0]  # what the units need: the model FLOPs of the step (utilization)
    return {
        "n_trees": np.int64(len(trees)), "n_paths": np.int64(stats.n_paths),
        "n_tree_tokens": np.int64(stats.n_tree_tokens),
        "n_flat_tokens": np.int64(stats.n_flat_tokens),
        "n_computed_tokens": np.int64(sum(u.n_tree_tokens for u in units)),
        "n_computed_pairs": np.int64(work.pairs), "n_scored_tokens": np.int64(work.scored),
        "n_pruned_tokens": np.int64(pruned_tokens),
        "n_merge_saved_tokens": np.int64(merge_saved),
        "has_old_logprobs": np.bool_(has_old),
        "old_logprob_disagreement": np.float64(disagreement),
        **signal_means(trees, normalization),
    }


class StepBuilder:
    """Grain transform: the tree indices of one global step -> this host's step inputs.

    Output: `{"inputs": DeviceBatch [micro_batches, rows * len(shards), row_len] with `row_norm`,
    "info": step_info(...)}`. `units[i]` are the training units of `trees[i]` (`all_units`).
    The step is planned once (`plan`, `jtree.layout.planner.plan_step`) and laid out where the plan
    says (`build`); every host plans the same global step.

    With `pruned` (`jtree.layout.pruning`, one per tree) the units are those of the pruned trees,
    and the step's normalizer stays the unpruned one: what the dropped paths' shares add up to
    goes to the first row of data shard 0 (the device sums every row's share). A step whose
    trees were all pruned away trains the shortest path of its first tree, whose coefficients are
    zero, so that every step has a unit to lay out.

    With `config.cross_group` the units are made per step (`StepUnits.bins`, the module
    docstring) and `units` is None; the last few steps' units are kept, since planning and
    building a step both read them.
    """

    _KEEP_STEPS = 4  # merged steps kept: a step is planned, then built

    def __init__(self, trees: Sequence[TrajectoryTree],
                 units: Sequence[Sequence[TrajectoryTree]] | None, config: StepConfig,
                 counts: Sequence[dict[str, Any]] | None = None,
                 pruned: Sequence[PrunedTree] | None = None):
        """`counts`: the units' `unit_counts` per tree, when already computed (the same units).
        `units`: each tree's units; None exactly when `config.cross_group` merges per step."""
        if (units is None) != (config.cross_group is not None):
            raise ValueError("units: give each tree's units, or None with config.cross_group")
        self.trees, self.config = list(trees), config
        self.units = None if units is None else list(units)
        self.pruned = None if pruned is None else list(pruned)
        self.counts = (None if units is None else list(counts) if counts is not None else
                       [unit_counts(us, config.layout.gdn_chunk_size, config.layout.context)
                        for us in self.units])
        self.pair_counts = ([[pair_count(u) for u in us] for us in self.units]
                            if config.pairs and units is not None else None)
        self._merged: dict[tuple[int, ...], StepUnits] = {}

    def step_units(self, indices: np.ndarray) -> StepUnits:
        """The units of the step `indices` with what the planner needs of them (a stand-in when
        pruning left none: the shortest path of the first tree)."""
        ids = [int(i) for i in indices]
        if self.config.cross_group is not None:
            return self._merged_units(tuple(ids))
        units = [u for i in ids for u in self.units[i]]
        if not units:
            return self._with_counts(self._stand_in(ids))
        pairs = (None if self.pair_counts is None else
                 [n for i in ids for n in self.pair_counts[i]])
        return StepUnits(units, {k: None if self.counts[ids[0]][k] is None else
                                 [n for i in ids for n in self.counts[i][k]]
                                 for k in self.counts[ids[0]]}, pairs)

    def _stand_in(self, ids: Sequence[int]) -> list[TrajectoryTree]:
        first = self.trees[ids[0]]
        return [TreePart.from_paths(first, [int(np.argmin(first.path_lengths))])]

    def _with_counts(self, units: list[TrajectoryTree],
                     bins: tuple[tuple[int, ...], ...] | None = None,
                     merge_saved: int = 0) -> StepUnits:
        layout = self.config.layout
        return StepUnits(units, unit_counts(units, layout.gdn_chunk_size, layout.context),
                         [pair_count(u) for u in units] if self.config.pairs else None,
                         bins, merge_saved)

    def _merged_units(self, ids: tuple[int, ...]) -> StepUnits:
        """The step's (pruned) trees merged per bin (`jtree.layout.cross_group.merge_per_bin`),
        each bin's merged tree cut into capacity parts when larger than a row."""
        if ids in self._merged:
            return self._merged[ids]
        trees = [t for t in (self.trees[i] if self.pruned is None else self.pruned[i].tree
                             for i in ids) if t is not None]
        if not trees:
            return self._with_counts(self._stand_in(ids))
        layout, cross = self.config.layout, self.config.cross_group
        merged = merge_per_bin(trees, layout.n_shards * layout.micro_batches,
                               shared_masks=cross.shared_masks)
        units: list[TrajectoryTree] = []
        bins = []
        for tree in merged.trees:
            own = [] if tree is None else training_units(tree, "tree", layout.seq_len,
                                                         cross.partition_method)
            bins.append(tuple(range(len(units), len(units) + len(own))))
            units.extend(own)
        out = self._with_counts(units, tuple(bins), merged.saved_tokens)
        if len(self._merged) >= self._KEEP_STEPS:
            self._merged.pop(next(iter(self._merged)))
        self._merged[ids] = out
        return out

    def plan(self, indices: np.ndarray) -> StepPlan:
        """Where every unit of the step goes, and the step's shape."""
        step = self.step_units(indices)
        return plan_step([u.n_tree_tokens for u in step.units], self.config.layout,
                         bins=step.bins, **step.counts)

    def rows_to_hold(self, steps: Sequence[np.ndarray]) -> int:
        """The fewest rows per micro-batch that hold each of `steps` (tree indices) at
        `seq_len` (`jtree.layout.planner.rows_to_hold`)."""
        units = [self.step_units(indices) for indices in steps]
        return rows_to_hold([[u.n_tree_tokens for u in s.units] for s in units],
                            self.config.layout, [s.bins for s in units])

    def __call__(self, indices: np.ndarray) -> dict[str, Any]:
        return self.build(indices, self.plan(indices))

    def build(self, indices: np.ndarray, plan: StepPlan) -> dict[str, Any]:
        """This host's step inputs of the step `indices`, laid out where `plan` (this builder's
        plan of those indices) says."""
        step = self.step_units(indices)
        units = step.units
        pair_len = None
        if self.config.pairs:
            pair_len = self.config.pair_len or self.pair_len(indices, plan)
        micro = []
        for m in range(plan.micro_batches):
            parts = [self._linearize([units[i] for i in plan.units[plan.bin(s, m)]],
                                     plan.placements[plan.bin(s, m)], plan, pair_len)
                     for s in self.config.shards]
            micro.append(concatenate_rows(parts))
        saved = 0
        if self.pruned is not None:
            saved = sum(self.pruned[int(i)].saved_tokens for i in indices)
            micro[0] = self._with_dropped_shares(micro[0], indices, units)
        trees = [self.trees[int(i)] for i in indices]
        info = step_info(trees, units, self.config.normalization, saved, step.merge_saved)
        if self.config.off_policy:
            info["offpolicy_behavior_disagreement"] = np.float64(
                max(behavior_disagreement(t) for t in trees))
        if self.config.routing is not None:  # merged: a token's paths span groups
            info.update(routing_info(units if step.merge_saved else trees))
        return {"inputs": stack(micro), "info": info}

    def _with_dropped_shares(self, first: DeviceBatch, indices: np.ndarray,
                             units: Sequence[TrajectoryTree]) -> DeviceBatch:
        """The first micro-batch with the normalizer shares of the paths pruning dropped added to
        data shard 0's first row (on the host feeding shard 0), so the rows of all hosts still
        sum to the unpruned step's normalizer."""
        if self.config.shards[0] != 0:  # shards are contiguous: shard 0 comes first
            return first
        dropped = (sum(self.pruned[int(i)].normalizer for i in indices)
                   - sum(batch_normalizer([u], self.config.normalization) for u in units))
        row_norm = first.row_norm.astype(np.float64)
        row_norm[0] += dropped
        return dataclasses.replace(first, row_norm=row_norm.astype(np.float32))

    def pair_len(self, indices: np.ndarray, plan: StepPlan) -> int:
        """The pair width of the step `indices` laid out by `plan`: the most pairs any row
        of any shard and micro-batch holds, on `jtree.objectives.pairs.pair_width`'s ladder."""
        counts = self.step_units(indices).pairs
        need = max((sum(counts[units[i]] for i in row)
                    for units, placement in zip(plan.units, plan.placements)
                    for row in placement.rows), default=0)
        return pair_width(need)

    def _linearize(self, units: list[TrajectoryTree], placement: RowPlan, plan: StepPlan,
                   pair_len: int | None) -> DeviceBatch:
        config = self.config
        chunk_size = config.layout.gdn_chunk_size
        if not units:  # a bin that got no tree
            empty = padding(plan.rows, plan.row_len, score_len=plan.score_len,
                            gdn_chunk_size=chunk_size, gdn_chunks=plan.gdn_chunks)
            pairs = None if pair_len is None else padding_pairs(
                plan.rows, pair_len, critic=config.critic, off_policy=config.off_policy)
            routed = None if config.routing is None else np.full(
                (plan.rows, plan.row_len, *config.routing), -1, np.int32)
            return dataclasses.replace(empty, row_norm=np.zeros(plan.rows, np.float32),
                                       pairs=pairs, routed_experts=routed)
        routed = (None if config.routing is None else
                  [unit_routing(u, config.routing) for u in units])
        batch = linearize(units, plan.row_len, normalization=config.normalization,
                          normalizer=1.0, plan=placement, score_len=plan.score_len,
                          gdn_chunk_size=chunk_size, gdn_chunks=plan.gdn_chunks,
                          routed_experts=routed)
        if pair_len is not None:
            batch = with_pairs(batch, pair_len, critic=config.critic,
                               off_policy=config.off_policy)
        row_norm = np.zeros(plan.rows, np.float64)
        for t, r in zip(batch.layout.trees, batch.layout.rows):
            row_norm[r] += batch_normalizer([t], config.normalization)
        return dataclasses.replace(batch.inputs, row_norm=row_norm.astype(np.float32))


class AutoStepBuilder:
    """Grain transform that trains each step in tree mode or in baseline mode, whichever the cost
    model (`jtree.layout.flop_model.choose_mode`) predicts faster: baseline when the predicted gain of tree
    mode is below `min_gain` (little sharing, so the tree layout's padding and partitioning
    cannot pay). Both modes give the same loss and gradients; the choice only changes speed.
    `builders` maps "tree" and "baseline" to their `StepBuilder`s (same trees, each with its own
    step shape). `info` gains the chosen `mode`, the `predicted_gain` and the `mode_reason`.
    """

    def __init__(self, builders: dict[str, StepBuilder], flop_model: FlopModel,
                 min_gain: float):
        if set(builders) != {"tree", "baseline"}:
            raise ValueError(f"builders: need 'tree' and 'baseline', got {sorted(builders)}")
        self.builders, self.flop_model, self.min_gain = builders, flop_model, min_gain
        self.trees = builders["tree"].trees
        self.config = builders["tree"].config

    def __call__(self, indices: np.ndarray) -> dict[str, Any]:
        plans = {mode: b.plan(indices) for mode, b in self.builders.items()}
        padded = {mode: p.n_rows * p.row_len for mode, p in plans.items()}  # all data shards
        choice = choose_mode(self.flop_model, [self.trees[int(i)] for i in indices],
                             tree_tokens=padded["tree"], baseline_tokens=padded["baseline"],
                             min_gain=self.min_gain)
        element = self.builders[choice.mode].build(indices, plans[choice.mode])
        element["info"] = dict(element["info"], mode=choice.mode,
                               predicted_gain=np.float64(choice.predicted_gain),
                               mode_reason=choice.reason)
        return element


@dataclasses.dataclass(frozen=True)
class RfreeStepConfig:
    """What every redundancy-free step is built with (`RfreeStepBuilder`). `merge_into`: with
    `data.share_prefixes: across_groups`, the step's trees are merged into that many trees, one
    per row shard (`jtree.layout.cross_group.merge_per_bin`; a part tree runs on one shard), and
    a merged tree larger than the capacity is split into parts over cached prefixes like any."""

    normalization: Normalization
    seq_len: int
    capacity: int
    trees_per_step: int
    gdn_chunk_size: int | None = None
    row_steps_per_octave: int = ROW_STEPS_PER_OCTAVE
    uniform: bool = False  # part rows of one shape, for the mesh executor (jtree.partitioning.redundancy_free.mesh_executor)
    merge_into: int | None = None


class RfreeStepBuilder:
    """Grain transform for `run.mode=redundancy_free`: the tree indices of one step -> the step's
    `jtree.partitioning.redundancy_free` program (`{"program": RfreeProgram, "info": step_info(...)}`), run part by part
    on one device by `jtree.partitioning.redundancy_free.executor.RedundancyFreeStep`, or with `uniform` in lockstep
    over a mesh by `jtree.partitioning.redundancy_free.mesh_executor.MeshRedundancyFreeStep`."""

    def __init__(self, trees: Sequence[TrajectoryTree], config: RfreeStepConfig):
        self.trees, self.config = list(trees), config

    def __call__(self, indices: np.ndarray) -> dict[str, Any]:
        trees = [self.trees[int(i)] for i in indices]
        config = self.config
        units, saved = trees, 0
        if config.merge_into is not None:
            merged = merge_per_bin(trees, config.merge_into)
            units = [t for t in merged.trees if t is not None]
            saved = merged.saved_tokens
        program = build_program(units, config.capacity, seq_len=config.seq_len,
                                normalization=config.normalization,
                                gdn_chunk_size=config.gdn_chunk_size,
                                row_steps_per_octave=config.row_steps_per_octave,
                                uniform=config.uniform)
        info = dict(step_info(trees, units, config.normalization, merge_saved=saved),
                    n_computed_tokens=np.int64(program.n_computed))
        return {"program": program, "info": info}


def all_units(trees: Sequence[TrajectoryTree | None], mode: Mode, seq_len: int,
              method: PartitionMethod = "heuristic") -> list[list[TrajectoryTree]]:
    """`training_units` of every tree, computed once for the run (none for a tree pruning left
    empty, None)."""
    return [[] if t is None else training_units(t, mode, seq_len, method) for t in trees]


def rows_for_run(units: Sequence[Sequence[TrajectoryTree]], seq_len: int, trees_per_step: int,
                 n_bins: int, seed: int, steps: int) -> int:
    """The fewest rows per micro-batch that hold every one of the first `steps` steps, each
    balanced over `n_bins` data shards x micro-batches and packed at `seq_len`
    (`jtree.layout.planner.rows_to_hold`)."""
    index = step_indices(len(units), trees_per_step, seed)
    return rows_to_hold([[u.n_tree_tokens for i in index[k] for u in units[int(i)]]
                         for k in range(steps)], LayoutConfig(seq_len, micro_batches=n_bins))


def step_builder(trees: Sequence[TrajectoryTree], data: DataConfig, mode: Mode, *,
                 normalization: Normalization, n_shards: int, shards: Sequence[int], steps: int,
                 gdn_chunk_size: int | None = None, critic: bool = False, off_policy: bool = False,
                 context: int = 1, pruned: Sequence[PrunedTree] | None = None,
                 shared_masks: bool = False, routing: tuple[int, int] | None = None,
                 round_up: Callable[[int], int] | None = None) -> StepBuilder:
    """The `StepBuilder` a run with data config `data` trains `mode` with, on `n_shards` data
    shards of which this host feeds `shards`: units from `all_units`, `data.rows_per_micro_batch`
    rows per micro-batch or else the fewest that hold the run's `steps` steps (`rows_for_run`),
    row lengths from `data.row_steps_per_octave` (`jtree.layout.planner.row_length_ladder`), and the
    score width and GDN chunk capacity (unless `data.gdn_chunks` fixes it) at the most any of
    those steps needs: the run compiles one step program per row length.
    `gdn_chunk_size`: chunk tables of that size (models with linear-attention layers).
    `critic`, `off_policy`: the steps carry (path, trained token) pairs for PPO's critic and the
    off-policy weights (`jtree.objectives.pairs`), as many per row as any step needs.
    `context`: devices of the `context` mesh axis each row is split over (`mesh.context`; the
    planner balances them by attention work, `jtree.layout.context_rows`).
    `pruned`: the trees pruned of their zero-gradient paths (`jtree.layout.pruning.prune_trees`),
    laid out in their place with the unpruned normalizer.
    With `data.share_prefixes: across_groups` a tree-mode step merges its trees per bin
    (`CrossGroup`; `shared_masks`: only where the paths agree on the trained bit, for GSPO).
    `routing` (the model's MoE layers and experts per token): routing replay (`StepConfig`).
    `round_up`: applied to each size the steps fix (rows unless `data.rows_per_micro_batch` gives
    them, the score width, GDN chunks, pairs), so that a caller building each step on its own
    trees (`jtree.training.online`) compiles a bounded number of shapes."""
    grow = round_up or (lambda n: n)
    if data.row_steps_per_octave is not None:
        check_steps_per_octave(data.row_steps_per_octave, "data.row_steps_per_octave")
    cross = (CrossGroup(data.partition_method, shared_masks)
             if data.share_prefixes == "across_groups" and mode == "tree" else None)
    units = None if cross is not None else all_units(
        trees if pruned is None else [p.tree for p in pruned], mode, data.seq_len,
        data.partition_method)
    row_lengths = (None if data.row_steps_per_octave is None
                   else row_length_ladder(data.seq_len, data.row_steps_per_octave))
    layout = LayoutConfig(data.seq_len, n_shards, data.micro_batches, data.rows_per_micro_batch,
                          row_lengths, gdn_chunk_size, data.gdn_chunks if gdn_chunk_size else None,
                          context=context)
    config = StepConfig(mode, normalization, data.trees_per_step, tuple(shards), layout, critic,
                        off_policy, cross_group=cross, routing=routing)
    index = step_indices(len(trees), data.trees_per_step, data.shuffle_seed)
    if layout.rows is None:
        rows = (rows_for_run(units, data.seq_len, data.trees_per_step,
                             n_shards * data.micro_batches, data.shuffle_seed, steps)
                if cross is None else StepBuilder(trees, None, config, pruned=pruned)
                .rows_to_hold([index[k] for k in range(steps)]))
        config = dataclasses.replace(config, layout=dataclasses.replace(layout, rows=grow(rows)))
        layout = config.layout
    builder = StepBuilder(trees, units, config, pruned=pruned)
    plans = [builder.plan(index[k]) for k in range(steps)]
    if not plans:
        return builder
    fixed = dataclasses.replace(
        layout, score_len=grow(max(p.score_len for p in plans)),
        gdn_chunks=None if gdn_chunk_size is None else (
            data.gdn_chunks or grow(max(p.gdn_chunks for p in plans))))
    pair_len = grow(max(builder.pair_len(index[k], p) for k, p in enumerate(plans))) \
        if config.pairs else None
    return StepBuilder(trees, units, dataclasses.replace(config, layout=fixed,
                                                         pair_len=pair_len), builder.counts,
                       pruned)


def step_indices(n_trees: int, trees_per_step: int, seed: int) -> grain.MapDataset:
    """Tree indices of every step: a seeded shuffle of all trees, reshuffled every epoch."""
    return (grain.MapDataset.range(n_trees).seed(seed).shuffle().repeat()
            .batch(trees_per_step, drop_remainder=True))
