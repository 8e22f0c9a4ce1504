"""The end-to-end bench's workloads (`jtree.launch.bench.step`) and what the trainer's host does
for each before a step.

Synthetic trees at fixed POR on a projection-dominated and an attention-heavy model, agent-rollout
trees and chat conversations (the step bench's docstring says why these sizes). `prepare` builds a
mode's batch through the trainer's own step builder, so the bench's speedups are the trainer's;
`block_stats` counts the attention blocks the block-sparse kernels compute.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jtree.config import DataConfig
from jtree.config.architectures import Qwen3Config
from jtree.config.objective import Objective
from jtree.kernels.attention.xla import default_blocks, schedule_work
from jtree.kernels.block_tables import EMPTY, FULL, classify_blocks, round_up_to_blocks
from jtree.layout.flop_model import Work, tree_work
from jtree.layout.planner import StepPlan
from jtree.training.step_builders import step_builder, step_indices
from jtree.trees.chat import ByteTokenizer, conversation_tree
from jtree.trees.synthetic import AgentShape, agent_rollout_group, chat_record, por_forest, por_tree
from jtree.trees.tree import TrajectoryTree

SHAPES = {
    # Projections and MLP dominate: hidden 256, MLP 1024, 4 layers, paths of ~512 tokens.
    "proj": Qwen3Config(vocab_size=2048, hidden_size=256, intermediate_size=1024,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=64),
    # Attention dominates: hidden 64, one 64-wide head, rows of 16k, paths of ~2.7k tokens.
    "attn": Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=1, num_key_value_heads=1,
                        head_dim=64),
    # --quick: a one-layer model small enough that a workload runs in seconds (a smoke run).
    "tiny": Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16),
}
AUTO_MIN_GAIN = 1.05
CPU_IMPLS = ("cpu", "xla")  # the CPU attention kernels `auto` chooses between


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    shape: str
    seq_len: int
    make_trees: Callable[[], list[TrajectoryTree]]  # deterministic: cold trees on every call


def _synthetic(shape: str, seq_len: int, flat: int, path_len: int, por: float) -> Workload:
    vocab = SHAPES[shape].vocab_size

    def make() -> list[TrajectoryTree]:
        return por_forest(np.random.default_rng(int(por * 100)), flat, por, path_len=path_len,
                          max_tree_tokens=seq_len, vocab_size=vocab, trained_fraction=0.5)

    return Workload(f"{shape}/synthetic POR {por:.1f}", shape, seq_len, make)


def _agent(shape: str, seq_len: int, n_trees: int, agent: AgentShape) -> Workload:
    def make() -> list[TrajectoryTree]:
        rng = np.random.default_rng(7)
        return [agent_rollout_group(rng, agent) for _ in range(n_trees)]

    return Workload(f"{shape}/agent", shape, seq_len, make)


def _chat(shape: str, seq_len: int, n_records: int) -> Workload:
    def make() -> list[TrajectoryTree]:
        rng = np.random.default_rng(11)
        tok = ByteTokenizer()
        return [conversation_tree(chat_record(rng, system_words=80, turns=3, user_words=20,
                                              assistant_words=30, tool_words=40,
                                              reasoning_words=40), tok, where=f"chat {i}",
                                  vocab_size=SHAPES[shape].vocab_size)
                for i in range(n_records)]

    return Workload(f"{shape}/chat", shape, seq_len, make)


PROJ_FLAT_TOKENS = 12288  # see the module docstring: why a step of this size


def workloads(quick: bool = False) -> list[Workload]:
    """The bench's workloads; `quick`: two tiny synthetic ones (768 flat tokens each)."""
    if quick:
        return [_synthetic("tiny", 256, 768, 96, p) for p in (0.3, 0.7)]
    out = [_synthetic("proj", 4096, PROJ_FLAT_TOKENS, 512, p) for p in (0.0, 0.3, 0.5, 0.7, 0.9)]
    out += [_synthetic("attn", 16384, 32768, 2730, p) for p in (0.0, 0.3, 0.5, 0.7, 0.9)]
    out.append(_agent("proj", 4096, 1, AgentShape(vocab_size=2048, system_len=500, task_len=80,
                                                  turns=3, assistant_len=60, tool_len=100,
                                                  rollouts=6, think_len=60)))
    out.append(_agent("attn", 16384, 1, AgentShape(vocab_size=512, system_len=2000,
                                                   task_len=200, turns=3, assistant_len=200,
                                                   tool_len=400, rollouts=6, think_len=150)))
    out.append(_chat("proj", 8192, 2))
    return out


# ----------------------------------------------------------------------------- one mode's batch


ROW_STEPS_PER_OCTAVE = 32  # the trainer's data.row_steps_per_octave the bench runs with
BATCHES = (f"times the trainer's batches (jtree.training.step_builders.step_builder: 1 data shard x 1 micro-batch, "
           f"rows_for_run rows, data.row_steps_per_octave={ROW_STEPS_PER_OCTAVE})")


@dataclasses.dataclass
class Prepared:
    inputs: dict[str, jax.Array]
    plan: StepPlan
    end: np.ndarray  # [micro_batches, rows, S] attention ends (the block statistics read them)
    work: Work  # what the step's units need, padding excluded


def prepare(trees: Sequence[TrajectoryTree], mode: str, seq_len: int,
            row_steps_per_octave: int = ROW_STEPS_PER_OCTAVE,
            normalization: str = Objective().normalization) -> Prepared:
    """What the trainer's host does before a step, through the trainer's own builder
    (`jtree.training.step_builders.step_builder`, as `jtree.training.run_data` calls it): a run whose one step holds all
    `trees` on one data shard, one micro-batch, rows from `rows_for_run`, row lengths from
    `row_steps_per_octave` steps per octave; units (parts of trees larger than a row, or paths),
    the step's plan, linearized arrays on the device. `normalization`: the loss coefficients'
    (the objective's)."""
    data = DataConfig(seq_len=seq_len, trees_per_step=len(trees),
                      row_steps_per_octave=row_steps_per_octave)
    builder = step_builder(trees, data, mode, normalization=normalization,
                           n_shards=1, shards=(0,), steps=1)
    indices = step_indices(len(trees), data.trees_per_step, data.shuffle_seed)[0]
    plan = builder.plan(indices)
    inputs = builder.build(indices, plan)["inputs"]
    units = [u for i in indices for u in builder.units[int(i)]]
    return Prepared(jax.device_put(inputs), plan, inputs.mask.end, tree_work(units)[0])


def block_stats(ends: Sequence[np.ndarray], work: Work) -> dict[str, float]:
    """Attention blocks of the block-sparse kernels' default size (`xla` and `cpu` share it): non-empty and full block counts, the
    blocks its schedule computes per non-empty block, and the visible pairs per computed pair."""
    nonempty = full = computed = computed_pairs = 0
    for end in ends:
        block_q, block_kv = default_blocks(end.shape[1])
        s = round_up_to_blocks(end.shape[1], block_q, block_kv)
        padded = np.concatenate([end, np.arange(end.shape[1], s, dtype=np.int32)[None]
                                 .repeat(end.shape[0], 0) + 1], axis=1)
        classes = classify_blocks(padded, block_q, block_kv)
        nonempty += int((classes != EMPTY).sum())
        full += int((classes == FULL).sum())
        blocks = schedule_work(padded, block_q=block_q, block_kv=block_kv)[0]
        computed += blocks
        computed_pairs += blocks * block_q * block_kv
    return {"nonempty_blocks": nonempty, "full_fraction": full / max(nonempty, 1),
            "computed_per_nonempty": computed / max(nonempty, 1),
            "pair_efficiency": work.pairs / max(computed_pairs, 1)}


def host_seconds(workload: Workload, mode: str, repeats: int) -> float:
    """Median host preparation time from freshly built trees (no cached layouts)."""
    times = []
    for _ in range(repeats):
        trees = workload.make_trees()
        t0 = time.perf_counter()
        prepared = prepare(trees, mode, workload.seq_len)
        jax.block_until_ready(prepared.inputs)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def fixed_cost_inputs(cfg: Qwen3Config) -> Prepared:
    """A step on one row of 64 tokens (one path): what a step costs with (almost) no tokens, i.e.
    an upper bound of its fixed cost (optimizer update, per-op dispatch, loss set-up; it still
    holds 64 tokens of work)."""
    tree = por_tree(np.random.default_rng(0), 64, 1, 0.0, vocab_size=cfg.vocab_size)
    return prepare([tree], "tree", 64)
