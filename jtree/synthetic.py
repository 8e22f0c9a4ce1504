"""Synthetic agent-rollout trees for demos, tests and benchmarks.

`agent_rollout_group` imitates what an agent RL run produces for one task: a long system prompt and
user task shared by every rollout, then turns in which the policy thinks, calls tools (sometimes
several in parallel, each continuing as its own branch), and reads tool results. Rollouts resample
at turn boundaries, so rollouts share prefixes of varying length. Think-mode turns whose reasoning
is dropped from later context become their own branch that ends at the turn (a path ending at an
internal node of the tree when a later rollout continues without the reasoning). Only assistant
tokens are trained (loss mask 1); prompt and tool tokens are context (mask 0). Each rollout gets a
group-normalized advantage, as in GRPO.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jtree.tree import TrajectoryTree


@dataclasses.dataclass(frozen=True)
class AgentShape:
    """Knobs of the generator (token counts are means of geometric-ish draws)."""

    vocab_size: int = 512
    system_len: int = 160
    task_len: int = 40
    turns: int = 3
    assistant_len: int = 48
    tool_len: int = 40
    rollouts: int = 6
    branch_prob: float = 0.5
    parallel_tools: int = 2
    think_len: int = 24
    think_prob: float = 0.3


def _segment(rng: np.random.Generator, mean: int, vocab: int) -> np.ndarray:
    n = max(1, int(rng.integers(mean // 2, mean * 3 // 2 + 1)))
    return rng.integers(1, vocab, size=n)


def agent_rollout_group(rng: np.random.Generator, shape: AgentShape = AgentShape()) -> TrajectoryTree:
    """One task's rollouts merged into a tree (see module docstring)."""
    v = shape.vocab_size
    prefix = np.concatenate([_segment(rng, shape.system_len, v), _segment(rng, shape.task_len, v)])
    prefix_mask = np.zeros(len(prefix))
    seqs: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    # Each open rollout is (tokens, mask); rollouts fork at turn boundaries.
    open_rollouts = [(prefix, prefix_mask)]
    for _ in range(shape.turns):
        nxt = []
        for toks, mask in open_rollouts:
            n_children = 1
            if rng.random() < shape.branch_prob and len(open_rollouts) + len(nxt) < shape.rollouts:
                n_children = min(shape.parallel_tools, shape.rollouts - len(nxt))
            for _ in range(max(1, n_children)):
                if rng.random() < shape.think_prob:
                    think = _segment(rng, shape.think_len, v)
                    act = _segment(rng, shape.assistant_len, v)
                    # The turn with its reasoning is trained once, as its own path...
                    seqs.append(np.concatenate([toks, think, act]))
                    masks.append(np.concatenate([mask, np.ones(len(think) + len(act))]))
                    # ...and later turns continue from a context without the reasoning.
                    assistant = act
                else:
                    assistant = _segment(rng, shape.assistant_len, v)
                tool = _segment(rng, shape.tool_len, v)
                nxt.append((
                    np.concatenate([toks, assistant, tool]),
                    np.concatenate([mask, np.ones(len(assistant)), np.zeros(len(tool))]),
                ))
        open_rollouts = nxt[: shape.rollouts]
    for toks, mask in open_rollouts:
        final = _segment(rng, shape.assistant_len, v)
        seqs.append(np.concatenate([toks, final]))
        masks.append(np.concatenate([mask, np.ones(len(final))]))
    rewards = rng.normal(size=len(seqs))
    adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    return TrajectoryTree.from_sequences(
        seqs, loss_masks=masks, advantages=list(adv), vocab_size=v
    )
