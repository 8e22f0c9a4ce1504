"""A whole run config (`TrainConfig`: one section per dataclass) read from YAML with `key.path=value`
overrides, and the sections that belong to no other layer: data, run, mesh, checkpoints.

The `model` section names its `architecture` (a key of
`jtree.config.architectures.ARCHITECTURE_CONFIGS`) and is validated against that architecture's
config class, which holds only Hugging Face config fields; how to run the model (attention kernel,
dtypes, rematerialization) is the `runtime` section (`jtree.config.runtime.RuntimeConfig`). This
package imports nothing else of jtree but kernel names: a config is read without loading a step,
a planner or a model. Checks that need the planner (row ladders) are made where the planner is
used (`jtree.training`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from jtree.config.model import ModelSpec, critic_network
from jtree.config.objective import Objective, OptimConfig
from jtree.config.runtime import RuntimeConfig
from jtree.config.schema import (
    AT_LEAST_ONE,
    NON_NEGATIVE,
    POSITIVE,
    Domain,
    DomainError,
    apply_overrides,
    check_domains,
    from_dict,
    within,
)

# The Gated DeltaNet chunk length every GDN table uses unless `data.gdn_chunk_size` says otherwise.
DEFAULT_CHUNK_SIZE = 64
# How many row lengths per octave the redundancy-free layout fits part rows to by default.
ROW_STEPS_PER_OCTAVE = 8


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where training trees come from and how they are batched (`jtree.training.pipeline`).

    `format`: `groups` (JSONL, one sequence per line with a group id; one tree per group),
    `trees` (JSONL, one explicit tree per line), `chat` (JSONL, `{"messages": [...]}` per line,
    tokenized with `tokenizer`: `bytes` for the built-in byte tokenizer, else a local
    tokenizer.json or Hugging Face tokenizer directory) or `traces` (JSONL, one engine rollout
    per line, token-in / token-out; one tree per group; `jtree.trees.traces`). `trace_drift`: a
    trace whose turn does not extend the previous turn's tokens is `reject`ed as a bad record or
    `branch`ed into a new path at the first difference. `truncated`: what a trace turn the engine
    cut at its length limit (`finish_reason: length`) gets: `train` (as any turn), `mask`
    (default; DAPO's overlong masking: no loss on its output tokens, still context for the tokens
    after them, since its reward scores an answer the limit cut off, not the policy's choice to
    stop, and training on it teaches the model to stop short; the rollout stays in its group's
    reward statistics) or `drop` (the rollout is left out); the count is logged. `aborted`: a
    rollout with an aborted turn (`finish_reason: abort`) is never trained: a bad record
    (`refuse`, default) or left out and counted (`drop`). Each step trains on `trees_per_step`
    trees, spread over the data-parallel shards and `micro_batches` per shard, each micro-batch
    packed into `rows_per_micro_batch` rows of `seq_len` tokens (None: the fewest rows that hold
    every step of the run); a tree larger than `seq_len` is cut into parts by `partition_method`
    (`jtree.partitioning.partition`). `on_bad_record`: `raise` (stop at file:line) or `skip` (count and
    report). `worker_count` > 0 linearizes in that many grain worker processes. Models with
    linear-attention layers (Qwen3-Next) get Gated DeltaNet chunk tables with chunks of
    `gdn_chunk_size` tokens and `gdn_chunks` chunks per row (None: the smallest bucket of
    `jtree.layout.gdn_tables.default_chunk_count` that holds the step, so a run compiles for a few
    shapes; fix it to compile once, a step that needs more then fails naming it); other models
    ignore both. `row_steps_per_octave`: None gives every row `seq_len` tokens; a power of two k
    lets each step take the shortest row length that holds it in its rows from a ladder of k
    lengths per octave (multiples of 64; `jtree.layout.planner`): less padding on small steps, up to k
    row shapes per octave to compile. `prune_zero_gradient`: leave out of every step the paths
    whose advantage is 0 on every trained token, and the tree nodes only they need
    (`jtree.layout.pruning`; exact: the loss and gradients do not change; off by default because
    per-token metrics such as the entropy then cover only the tokens trained on).
    `share_prefixes`: `within_groups` (default) trains each group (one tree) as read;
    `across_groups` merges the trees of each step per data shard x micro-batch at their common
    prefixes (`jtree.layout.cross_group`), so a system prompt common to every group is computed
    once per merged tree; advantages stay per group (computed when the trees are read) and the
    loss and gradients do not change.
    """

    path: str = "data/sample_groups.jsonl"
    format: Literal["groups", "trees", "chat", "traces"] = "groups"
    seq_len: int = within(AT_LEAST_ONE, 1024)
    trees_per_step: int = within(AT_LEAST_ONE, 8)
    micro_batches: int = within(AT_LEAST_ONE, 1)
    rows_per_micro_batch: int | None = within(AT_LEAST_ONE, None)
    shuffle_seed: int = within(NON_NEGATIVE, 0)
    partition_method: Literal["heuristic", "dp_single", "dp_multi"] = "heuristic"
    on_bad_record: Literal["raise", "skip"] = "raise"
    tokenizer: str = "bytes"
    trace_drift: Literal["reject", "branch"] = "reject"
    truncated: Literal["train", "mask", "drop"] = "mask"
    aborted: Literal["refuse", "drop"] = "refuse"
    worker_count: int = within(NON_NEGATIVE, 0)
    gdn_chunk_size: int = within(AT_LEAST_ONE, DEFAULT_CHUNK_SIZE)
    gdn_chunks: int | None = within(AT_LEAST_ONE, None)
    row_steps_per_octave: int | None = within(AT_LEAST_ONE, None)
    prune_zero_gradient: bool = False
    share_prefixes: Literal["within_groups", "across_groups"] = "within_groups"

    def __post_init__(self) -> None:
        check_domains(self)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints (`jtree.training.checkpoint`): saved every `every` steps and at the end into
    `dir` (None: no checkpoints), the last `keep` kept; `async_save` writes in the background.
    `on_corrupt`: what `--resume` does when the latest checkpoint is uncommitted, incomplete or
    unreadable: `fallback` (log it and resume from the newest intact one) or `raise`."""

    dir: str | None = None
    every: int = within(AT_LEAST_ONE, 100)
    keep: int = within(AT_LEAST_ONE, 3)
    async_save: bool = True
    on_corrupt: Literal["fallback", "raise"] = "fallback"

    def __post_init__(self) -> None:
        check_domains(self)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The training run: length, mode, seed, logging.

    `metrics_jsonl`: a file that gets one JSON object per step; `tensorboard_dir`: scalars for
    TensorBoard (needs the `tensorboardX` package); `wandb_project`: the same scalars to that
    Weights & Biases project (needs the `wandb` package, `pip install 'jtree[wandb]'`; the run's
    settings go in as its W&B config), as run `wandb_name` (None: W&B names it) in `wandb_mode`
    (`online`, `offline`: files only, `wandb sync` later, `disabled`; None: the `WANDB_MODE`
    environment variable, else online), its files under `wandb_dir` (None: W&B's default, the
    working directory or `WANDB_DIR`); `wandb_id`: the W&B run to continue (None: a new one, its
    id stored here in the run's checkpoints, so `--resume` continues the same W&B run). `mode`: `tree`, `baseline` (every path its own
    sequence), or `auto`: each step in tree mode unless the cost model predicts a gain below
    `auto_min_gain` over the baseline, then in baseline mode (same loss either way; the choice and
    its reason are logged per step), or `redundancy_free`: trees larger than `capacity` tokens
    (default `data.seq_len`) split into parts that reuse their ancestors' cached prefixes
    (`jtree.partitioning.redundancy_free`; single device only), `prefix_backward` choosing how a part with children gets
    its backward (`residuals`, `recompute` or `auto`) and `row_steps_per_octave` how finely part
    rows are fitted to their tokens (`jtree.partitioning.redundancy_free.layout.row_length`, tree
    mode's `row_length_ladder`: more steps, less padding, more shapes to compile). `host_malloc`: `keep` makes glibc keep freed
    host memory so CPU steps stop page-faulting their temporaries every step
    (`jtree.training.host_allocator`; the process keeps its peak host memory), `default` leaves malloc
    alone, `auto` keeps it on the CPU backend only. `kill_after_checkpoint`: fault injection for
    resume tests, the process SIGKILLs itself once the checkpoint of that step is committed.
    """

    steps: int = within(NON_NEGATIVE, 20)  # 0: read and check the data, train nothing
    seed: int = within(NON_NEGATIVE, 0)
    mode: Literal["tree", "baseline", "auto", "redundancy_free"] = "tree"
    auto_min_gain: float = within(POSITIVE, 1.05)
    capacity: int | None = within(AT_LEAST_ONE, None)
    prefix_backward: Literal["residuals", "recompute", "auto"] = "auto"
    row_steps_per_octave: int = within(AT_LEAST_ONE, ROW_STEPS_PER_OCTAVE)
    host_malloc: Literal["auto", "keep", "default"] = "auto"
    log_every: int = within(AT_LEAST_ONE, 1)
    compare_baseline: bool = True
    timing_repeats: int = within(AT_LEAST_ONE, 5)
    metrics_jsonl: str | None = None
    tensorboard_dir: str | None = None
    wandb_project: str | None = None
    wandb_name: str | None = None
    wandb_mode: Literal["online", "offline", "disabled"] | None = None
    wandb_dir: str | None = None
    wandb_id: str | None = None
    kill_after_checkpoint: int | None = within(AT_LEAST_ONE, None)

    def __post_init__(self) -> None:
        check_domains(self)
        if self.wandb_project is None:
            for field in ("wandb_name", "wandb_mode", "wandb_dir", "wandb_id"):
                if getattr(self, field) is not None:
                    raise ValueError(f"{field}: {getattr(self, field)!r} is a setting of the "
                                     "W&B run, which wandb_project turns on (it is not set)")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh shape: `data` x `fsdp` x `context` x `model` devices; -1 for `data` means all devices
    left over. `fsdp` > 1 shards parameters and optimizer state over that many data-parallel
    devices; `context` > 1 splits every row's tokens over that many devices."""

    data: int = within(Domain(low=1, also=(-1,)), -1)
    fsdp: int = within(AT_LEAST_ONE, 1)
    context: int = within(AT_LEAST_ONE, 1)
    model: int = within(AT_LEAST_ONE, 1)

    def __post_init__(self) -> None:
        check_domains(self)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A run config: one section per dataclass. `model` is what the checkpoint holds, `runtime`
    how it is run (attention kernel, dtypes, remat; never part of a checkpoint's config.json)."""

    model: ModelSpec = dataclasses.field(default_factory=ModelSpec)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    objective: Objective = dataclasses.field(default_factory=Objective)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        if self.objective.routing_replay:
            self._refuse_routing_replay()
        if self.objective.mtp_weight:
            self._refuse_mtp()
        if (self.data.format == "chat" and self.data.tokenizer == "bytes"
                and self.model.init_from is not None):
            # Byte ids fit inside any real vocabulary, so nothing downstream would notice.
            raise ValueError(f"data.tokenizer: 'bytes' (the default) with model.init_from="
                             f"{self.model.init_from}: chat text would be tokenized into byte ids "
                             "the checkpoint never learned; set data.tokenizer to the "
                             "checkpoint's tokenizer (its directory or tokenizer.json)")
        critic = self.objective.critic
        if critic is None or not critic.separate:
            return
        network = critic_network(self.model, critic)
        object.__setattr__(self, "objective", dataclasses.replace(
            self.objective, critic=dataclasses.replace(critic, network=network)))

    def _refuse_routing_replay(self) -> None:
        """`objective.routing_replay` needs a MoE model and traces (the data's routed experts are
        checked when the trees are read: `jtree.training.run_data`), and a mode whose rows carry
        them: redundancy-free parts are laid out by their own layout, which does not."""
        key = "objective.routing_replay"
        if getattr(self.model.config, "num_experts", 0) <= 0:
            raise ValueError(f"{key}: model.architecture {self.model.architecture!r} has no MoE "
                             "layers to replay")
        if self.data.format != "traces":
            raise ValueError(f"{key}: needs data.format 'traces' (routed_experts per output "
                             f"token), not {self.data.format!r}")
        if self.run.mode == "redundancy_free":
            raise ValueError(f"{key}: not available with run.mode=redundancy_free (its part rows "
                             "and cached prefixes carry no routed experts); use run.mode tree, "
                             "baseline or auto")

    def _refuse_mtp(self) -> None:
        """`objective.mtp_weight` gathers each token's MTP input at its parent's position in the
        same row (`jtree.models.mtp`): not where a parent sits on another device (context
        parallelism) or in a cached prefix (redundancy-free parts). LoRA runs (their frozen
        base, adapter targets and peft export) do not carry MTP modules."""
        key = "objective.mtp_weight"
        if self.run.mode == "redundancy_free":
            raise ValueError(f"{key}: not available with run.mode=redundancy_free (a part's "
                             "first tokens read their parent's state from a cached prefix); use "
                             "run.mode tree, baseline or auto")
        if self.mesh.context > 1:
            raise ValueError(f"{key}: not available with mesh.context={self.mesh.context} (a "
                             "token's parent may sit on another device); set mesh.context=1")
        if self.model.lora is not None:
            raise ValueError(f"{key}: not available with model.lora (LoRA runs do not carry "
                             "MTP modules)")

    @property
    def model_args(self) -> dict[str, Any]:
        """`jtree.models.create_model`'s arguments beyond the architecture for this run: a
        `value_head` on the policy trunk (`objective.critic.model: head`) or a separate `critic`
        network, and the MTP modules of `objective.mtp_depth` when `objective.mtp_weight` > 0."""
        critic, objective = self.objective.critic, self.objective
        return {"value_head": critic is not None and not critic.separate,
                "critic": self.critic_network,
                "mtp_depth": objective.mtp_depth if objective.mtp_weight else 0}

    @property
    def critic_network(self) -> Any:
        """The separate critic's architecture config (`objective.critic.model: separate`), None
        without one."""
        critic = self.objective.critic
        return critic.network if critic is not None and critic.separate else None


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read a YAML config (or start from defaults when `path` is None) and apply overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    try:
        return from_dict(TrainConfig, apply_overrides(data, overrides))
    except DomainError as e:
        raise e.sourced(_source(e.key, path, overrides)) from None
    except ValueError as e:
        raise ValueError(f"{path or 'config'}: {e}") from None


def _source(key: str, path: str | Path | None, overrides: Sequence[str]) -> str:
    """Where the setting `key` of a loaded config came from: `override` when a command-line
    override sets it (or a section above it), else the YAML file's name."""
    for item in overrides:
        name = item.partition("=")[0]
        if key == name or key.startswith(f"{name}."):
            return "override"
    return Path(path).name if path is not None else "defaults"


def config_values(cfg: TrainConfig) -> dict[str, Any]:
    """Every setting of `cfg` under the dotted key an override names it by (`model.hidden_size`,
    `data.seq_len`), its value as JSON reads it back (tuples as lists), so a config saved with a
    checkpoint compares equal to the config that wrote it."""
    out: dict[str, Any] = {}
    for field in dataclasses.fields(cfg):
        section = getattr(cfg, field.name)
        values = dataclasses.asdict(section)
        if isinstance(section, ModelSpec):  # the architecture's fields sit directly under model.
            values = {"architecture": section.architecture, "init_from": section.init_from,
                      "lora": values["lora"], **values["config"]}
        for key, value in values.items():
            out[f"{field.name}.{key}"] = json.loads(json.dumps(value))
    return out
