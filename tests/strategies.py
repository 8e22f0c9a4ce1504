"""Random branching trees for property tests (hypothesis strategies and plain generators), trees
whose per-path data agree on shared tokens (`consistent_tree`, `gspo_tree`), and the fixed tree
sets several test files share (`one_row_forests`, `multi_part_trees`).

Trees are generated as explicit random forests (several levels, many siblings, single-token nodes),
then paths are chosen to end at leaves *and* internal nodes, with duplicates. `sequences_tree`
returns the same data as token sequences merged through `TrajectoryTree.from_sequences`, which also
exercises the trie merge.
"""

from __future__ import annotations

import numpy as np
from hypothesis import reject
from hypothesis import strategies as st

from jtree.trees.tree import TrajectoryTree


def random_forest(
    rng: np.random.Generator,
    *,
    max_nodes: int = 10,
    max_seg: int = 5,
    vocab: int = 64,
    roots: int | None = None,
    extra_paths: int = 3,
    with_rl: bool = True,
) -> dict:
    """A random explicit forest with per-path data; returns TrajectoryTree.from_nodes kwargs."""
    n = int(rng.integers(1, max_nodes + 1))
    n_roots = int(roots if roots is not None else rng.integers(1, 3))
    parents = [-1 if i < n_roots or i == 0 else int(rng.integers(0, i)) for i in range(n)]
    seg_lens = [int(rng.choice([1, 1, 2, 3, max_seg])) for _ in range(n)]
    segments = [rng.integers(0, vocab, size=k).tolist() for k in seg_lens]
    children = {i for i in parents if i >= 0}
    leaves = [i for i in range(n) if i not in children]
    internal_ends = rng.choice(n, size=int(rng.integers(0, extra_paths + 1))).tolist()
    path_nodes = leaves + internal_ends  # internal ends and duplicates of leaves
    rng.shuffle(path_nodes)
    lengths = []
    for node in path_nodes:
        length, cur = 0, node
        while cur >= 0:
            length += seg_lens[cur]
            cur = parents[cur]
        lengths.append(length)
    kwargs: dict = {
        "parents": parents,
        "segments": segments,
        "path_nodes": path_nodes,
        "loss_masks": [(rng.random(n_) < 0.7).astype(int).tolist() for n_ in lengths],
        "weights": rng.uniform(0.5, 2.0, size=len(path_nodes)).tolist(),
    }
    if with_rl:
        kwargs["advantages"] = [
            float(rng.normal()) if rng.random() < 0.5 else rng.normal(size=n_).tolist()
            for n_ in lengths
        ]
        kwargs["old_logprobs"] = [(-rng.uniform(0.5, 6.0, size=n_)).tolist() for n_ in lengths]
    return kwargs


def explicit_tree(kwargs: dict) -> TrajectoryTree:
    return TrajectoryTree.from_nodes(**kwargs)


def seeded_forests(n: int, seed: int = 0, **kw) -> list[TrajectoryTree]:
    """`n` explicit random forests (`random_forest(**kw)`) drawn from one seed: a fixed batch of
    trees for tests that are not property tests."""
    rng = np.random.default_rng(seed)
    return [explicit_tree(random_forest(rng, **kw)) for _ in range(n)]


def sequences_tree(kwargs: dict) -> TrajectoryTree:
    """The same paths, given as plain sequences (merged by the trie builder)."""
    t = TrajectoryTree.from_nodes(**kwargs)
    seqs = [t.path_tokens(p) for p in range(t.n_paths)]
    return TrajectoryTree.from_sequences(
        seqs,
        loss_masks=list(t.loss_masks),
        advantages=None if t.advantages is None else list(t.advantages),
        old_logprobs=None if t.old_logprobs is None else list(t.old_logprobs),
        weights=t.weights,
        rewards=None if t.rewards is None else list(t.rewards),
    )


@st.composite
def forests(draw, n_trees: tuple[int, int] = (1, 3), **kw) -> list[TrajectoryTree]:
    """A list of random trees, each built explicitly or from sequences."""
    seed = draw(st.integers(0, 2**32 - 1))
    count = draw(st.integers(*n_trees))
    rng = np.random.default_rng(seed)
    trees = []
    for _ in range(count):
        kwargs = random_forest(rng, **kw)
        trees.append(sequences_tree(kwargs) if rng.random() < 0.5 else explicit_tree(kwargs))
    return trees


def fitting_layout(layout, trees, seq_len: int, **kw):
    """`layout(trees, seq_len, **kw)` (`linearize`, `linearize_baseline`), rejecting the example
    when the drawn trees do not fit the test's fixed rows: a tree longer than a row or more rows
    than `n_rows` (a property of the draw, not of the code under test)."""
    try:
        return layout(trees, seq_len, **kw)
    except ValueError as e:
        if str(e).startswith("n_rows=") or f"more than seq_len={seq_len}" in str(e):
            reject()
        raise


def one_row_forests(vocab: int) -> list[TrajectoryTree]:
    """Two random forests (several levels, siblings, paths ending at internal nodes, duplicate
    paths) and a hand-made tree, small enough to pack into one row of 128 tokens."""
    trees = [TrajectoryTree.from_nodes(**random_forest(np.random.default_rng(s), max_nodes=9,
                                                        vocab=vocab, with_rl=False))
             for s in (11, 5)]
    trees.append(TrajectoryTree.from_sequences(
        [[1, 2, 3, 4, 5], [1, 2, 3, 9], [1, 2, 3], [1, 2, 3, 9], [1, 7, 8, 8, 8, 2]]))
    nodes = sum(t.n_nodes for t in trees)
    assert max(int(t.node_levels.max()) for t in trees) >= 3 and nodes >= 10
    assert any(len(set(t.path_nodes.tolist())) < t.n_paths for t in trees)  # duplicates
    return trees


def consistent_tree(rng: np.random.Generator, **kw) -> TrajectoryTree:
    """A random branching tree whose per-path old log-probs agree on shared tokens (as they do
    when the rollout engine's values are exact), so the PPO loss is one function of the tree."""
    t = TrajectoryTree.from_nodes(**random_forest(rng, **kw))
    per_token = -rng.uniform(3.6, 4.6, size=t.n_tree_tokens)
    olds = [per_token[t.path_token_index(p)] for p in range(t.n_paths)]
    return TrajectoryTree.from_nodes(
        t.parents.tolist(), list(t.segments), path_nodes=t.path_nodes.tolist(),
        loss_masks=list(t.loss_masks), advantages=list(t.advantages), old_logprobs=olds,
        weights=t.weights,
    )


def gspo_tree(rng: np.random.Generator, **kw) -> TrajectoryTree:
    """A random multi-level tree (internal and duplicate path ends) whose paths agree on the loss
    mask and old log-prob of every token they share, one advantage per path."""
    shape = TrajectoryTree.from_nodes(**random_forest(rng, with_rl=False, **kw))
    mask = (rng.random(shape.n_tree_tokens) < 0.75).astype(int)
    old = -rng.uniform(0.5, 3.0, size=shape.n_tree_tokens)
    paths = [shape.path_token_index(p) for p in range(shape.n_paths)]
    return TrajectoryTree.from_nodes(
        shape.parents.tolist(), list(shape.segments), path_nodes=shape.path_nodes.tolist(),
        loss_masks=[mask[i] for i in paths], old_logprobs=[old[i] for i in paths],
        advantages=rng.normal(size=shape.n_paths).tolist(),
        weights=rng.uniform(0.5, 2.0, size=shape.n_paths).tolist())


def multi_part_trees(seed: int) -> list[TrajectoryTree]:
    """Two trees that need several parts at capacity 16 (partitioning, redundancy-free), and a
    small one that fits whole; old log-probs consistent on shared tokens."""
    rng = np.random.default_rng(seed)
    big = []
    while len(big) < 2:
        t = consistent_tree(rng, max_nodes=12, max_seg=4, roots=1, extra_paths=3)
        if t.n_tree_tokens > 24 and t.path_lengths.max() <= 16 and t.n_paths >= 4:
            big.append(t)
    small = consistent_tree(rng, max_nodes=3, max_seg=3, roots=1)
    return big + [small]
