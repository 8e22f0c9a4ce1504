"""Synthetic agent-rollout trees for demos, tests and benchmarks.

`agent_rollout_group` imitates what an agent RL run produces for one task: a long system prompt and
user task shared by every rollout, then turns in which the policy thinks, calls tools (sometimes
several in parallel, each continuing as its own branch), and reads tool results. Rollouts resample
at turn boundaries, so rollouts share prefixes of varying length. Think-mode turns whose reasoning
is dropped from later context become their own branch that ends at the turn (a path ending at an
internal node of the tree when a later rollout continues without the reasoning). Only assistant
tokens are trained (loss mask 1); prompt and tool tokens are context (mask 0). Each rollout gets a
random reward and its group-normalized advantage, as in GRPO (`jtree.objectives.advantages`, `grpo`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jtree.trees.tree import TrajectoryTree


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


def agent_rollout_group(rng: np.random.Generator, shape: AgentShape = AgentShape(),
                        system: np.ndarray | None = None) -> TrajectoryTree:
    """One task's rollouts merged into a tree (see module docstring). `system`: the system
    prompt's tokens (default: drawn for this group); give every group of a step the same array
    for an agent run's common system prompt and tool schemas."""
    v = shape.vocab_size
    if system is None:
        system = _segment(rng, shape.system_len, v)
    prefix = np.concatenate([system, _segment(rng, shape.task_len, v)])
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
        seqs, loss_masks=masks, advantages=list(adv), rewards=list(rewards), vocab_size=v
    )


# ---------------------------------------------------------------------- controlled-POR trees


def por_tree(rng: np.random.Generator, tree_tokens: int, n_paths: int, por: float, *,
             vocab_size: int = 512, trained_fraction: float = 1.0) -> TrajectoryTree:
    """A tree of exactly `tree_tokens` tokens and `n_paths` paths whose POR is `por` (to rounding).

    Shape: a shared prefix of P tokens, then `n_paths` branches of random lengths summing to
    `tree_tokens - P`. Flat tokens are P * n_paths + (tree_tokens - P), so
    POR = (n_paths - 1) * P / flat, which fixes P = tree_tokens * por / ((1 - por) (n_paths - 1)).
    With `por` 0 the tree is a forest of `n_paths` unrelated sequences (nothing is shared, so the
    tree layout is the baseline layout). Branch lengths are a random composition (paths differ in
    length, as rollouts do). The last `trained_fraction` of each branch is trained (loss mask 1),
    the prefix and the start of each branch are context.
    """
    if not 0.0 <= por < 1.0:
        raise ValueError(f"por: {por} must be in [0, 1)")
    if n_paths < 1 or (por > 0 and n_paths < 2):
        raise ValueError(f"n_paths: {n_paths} paths cannot share (need >= 2 for por > 0)")
    prefix = 0 if por == 0 else int(round(tree_tokens * por / ((1 - por) * (n_paths - 1))))
    rest = tree_tokens - prefix
    if prefix >= tree_tokens or rest < n_paths:
        raise ValueError(f"por={por} with {n_paths} paths leaves no room for {n_paths} branches "
                         f"in {tree_tokens} tokens (use more paths)")
    cuts = np.sort(rng.choice(np.arange(1, rest), size=n_paths - 1, replace=False))
    branch_lens = np.diff(np.concatenate([[0], cuts, [rest]]))
    segments = [rng.integers(1, vocab_size, size=n) for n in branch_lens]
    if prefix:
        parents = [-1] + [0] * n_paths
        segments = [rng.integers(1, vocab_size, size=prefix)] + segments
        path_nodes = list(range(1, n_paths + 1))
    else:
        parents, path_nodes = [-1] * n_paths, list(range(n_paths))
    masks = []
    for b in branch_lens:
        mask = np.zeros(prefix + b)
        mask[prefix + b - max(1, int(round(trained_fraction * b))):] = 1.0
        masks.append(mask)
    return TrajectoryTree.from_nodes(parents, segments, path_nodes=path_nodes, loss_masks=masks,
                                     vocab_size=vocab_size)


def por_forest(rng: np.random.Generator, flat_tokens: int, por: float, *, path_len: int,
               max_tree_tokens: int, **kwargs) -> list[TrajectoryTree]:
    """`por_tree`s holding about `flat_tokens` flat tokens in paths of about `path_len` tokens.

    Workloads of different POR then hold the same per-branch work (the baseline's cost stays put
    while the tree's shrinks) in paths of the same length (the same attention per token). The
    trees are as few as fit `max_tree_tokens` each; each gets n_paths = T / ((1 - POR) path_len)
    paths (at least what the POR needs). `kwargs` go to `por_tree`.
    """
    tree_total = flat_tokens * (1 - por)
    n_trees = max(1, int(np.ceil(tree_total / max_tree_tokens)))
    tree_tokens = int(round(tree_total / n_trees))
    n_paths = max(int(round(tree_tokens / ((1 - por) * path_len))), 1)
    if por > 0:
        n_paths = max(n_paths, int(np.floor(por / (1 - por))) + 2)
    return [por_tree(rng, tree_tokens, n_paths, por, **kwargs) for _ in range(n_trees)]


# ---------------------------------------------------------------------- chat conversations

_WORDS = ("the", "agent", "reads", "file", "returns", "value", "error", "test", "patch", "run",
          "search", "result", "function", "call", "config", "line", "fix", "output", "check",
          "build", "query", "table", "index", "step", "plan", "next", "because", "then", "and",
          "with", "missing", "import", "module", "path", "list", "count", "update", "diff")


def _text(rng: np.random.Generator, n_words: int) -> str:
    words = rng.choice(_WORDS, size=max(1, int(rng.integers(n_words // 2, n_words * 3 // 2 + 1))))
    return " ".join(words) + "."


def chat_record(rng: np.random.Generator, *, system_words: int = 120, turns: int = 6,
                user_words: int = 25, assistant_words: int = 40, tool_words: int = 60,
                tool_prob: float = 0.5, reasoning_prob: float = 0.4,
                reasoning_words: int = 50) -> dict:
    """One multi-turn conversation in the `{"messages": [...]}` format of `jtree.trees.chat`: a system
    prompt, then turns of a user message, an assistant reply (with `reasoning_content` sometimes:
    think-mode, dropped from later contexts) and sometimes a tool result the next assistant turn
    reads. Every assistant turn becomes a path of the conversation's tree."""
    messages = [{"role": "system", "content": _text(rng, system_words)}]
    for _ in range(turns):
        messages.append({"role": "user", "content": _text(rng, user_words)})
        reply = {"role": "assistant", "content": _text(rng, assistant_words)}
        if rng.random() < reasoning_prob:
            reply["reasoning_content"] = _text(rng, reasoning_words)
        messages.append(reply)
        if rng.random() < tool_prob:
            messages.append({"role": "tool", "content": _text(rng, tool_words)})
            messages.append({"role": "assistant", "content": _text(rng, assistant_words)})
    return {"messages": messages}
