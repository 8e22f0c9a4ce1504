"""Redundancy-free partitioning (jtree.partitioning.redundancy_free): plans compute every tree token once, and running the
parts depth-first over cached prefixes gives the unpartitioned tree's log-probs, loss and gradients
(docs/design.md section 9 tolerances) for dense, MoE and hybrid (GDN) tiny models, at capacities down to
a few tokens (far below the longest shared prefix), with both prefix-backward modes.

Trees: `multi_part_trees` (two trees needing several parts, one small tree that fits whole and is
packed into a part row's spare room or a whole micro-batch) with per-path old log-probs that agree
on shared tokens, so PPO is one function of the tree. Rows are at most 16 tokens and the prefix has
one bucket, so each model compiles a handful of shapes; part rows fit their content (8 or 16
tokens) in the dense and GDN tests, and all have 16 tokens in the MoE test. Further tests pad parts
of branching trees to one prefix region per program, run several whole-tree micro-batches, and
count the compiles over steps of varied trees.
"""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings

from jtree.layout.planner import octave_step_length, row_length_ladder
from jtree.partitioning.redundancy_free.executor import RedundancyFreeStep
from jtree.partitioning.redundancy_free.layout import build_program, prefix_bucket, row_length
from jtree.partitioning.redundancy_free.plan import plan_parts
from jtree.partitioning.redundancy_free.schedule import child_order
from jtree.training.compile_log import CompileWatch
from jtree.trees.tree import TrajectoryTree
from tests.models_util import (
    four_expert_config,
    perturbed,
    perturbed_moe_model,
    tiny_config,
    tiny_lm,
    tiny_model,
)
from tests.redundancy_free_checks import (
    PPO,
    ROW,
    SFT,
    check_parts,
    on_path_tokens,
    subtree_need,
)
from tests.strategies import consistent_tree, forests, multi_part_trees

CHUNK = 3
FITTED = (8, 16, 32, 64)  # part row lengths finer than the default ladder, for tiny trees


def check_plan(tree: TrajectoryTree, capacity: int) -> None:
    parts = plan_parts(tree, capacity)
    owned = np.concatenate([p.own for p in parts])
    assert np.array_equal(np.sort(owned), on_path_tokens(tree))  # each token exactly once
    owner = np.full(tree.n_tree_tokens, -1)
    for k, p in enumerate(parts):
        assert 1 <= len(p.own) <= capacity
        owner[p.own] = k
    pred = tree.token_arrays["pred"]
    for k, p in enumerate(parts):
        if p.attach < 0:
            assert p.parent == -1
            assert np.all((pred[p.own] < 0) | (owner[np.maximum(pred[p.own], 0)] == k))
        else:
            assert p.parent < k and owner[p.attach] == p.parent and k in parts[p.parent].children
            # own tokens hang below the attach token: the prefix is each own token's path head
            outside = pred[p.own][owner[pred[p.own]] != k]
            assert np.all(outside == p.attach)
            chain = p.prefix
            assert chain[-1] == p.attach and len(chain) == tree.token_arrays["pos"][p.attach] + 1
            assert np.all(np.diff(chain) > 0) and np.all(pred[chain[1:]] == chain[:-1])


@settings(max_examples=60)
@given(forests(n_trees=(1, 1), max_nodes=14, max_seg=6))
def test_plan_computes_every_token_once_and_parts_hang_below_one_token(trees):
    for capacity in (1, 2, 3, 7, 40):
        check_plan(trees[0], capacity)


def test_plan_keeps_the_root_segment_whole_when_no_more_parts_result():
    """Capacity 10: the subtree of node 2 closes a full part (its children's 8 tokens + 2 of its
    3) and leaves 1 token open, with that part below it; at the root (4 tokens, open children of
    3, 1 and 3) walking up the root segment would close 10 tokens and leave a 1-token top part,
    both parts with children. Kept whole, the root part holds its segment, the 1-token remainder
    and one 3-token child; the other 3 tokens are a leaf part: 3 parts (ceil(21 / 10)), only the
    top one with children."""
    tree = TrajectoryTree.from_nodes(
        parents=[-1, 0, 0, 0, 2, 2],
        segments=[[1] * 4, [2] * 3, [3] * 3, [4] * 3, [5] * 4, [6] * 4])
    check_plan(tree, 10)
    parts = plan_parts(tree, 10)
    assert len(parts) == 3
    assert [len(p.own) for p in parts if p.children] == [8]
    assert parts[0].attach == -1 and len(parts[0].own) == 8
    assert sorted(len(p.own) for p in parts[1:]) == [3, 10]


def test_plan_rejects_bad_capacity_and_prefix_buckets():
    tree = multi_part_trees(seed=7)[0]
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="capacity"):
            plan_parts(tree, bad)
    with pytest.raises(ValueError, match="prefix_buckets"):
        build_program([tree], 4, seq_len=ROW, prefix_buckets=[2])
    with pytest.raises(ValueError, match="seq_len"):
        build_program([tree], 8, seq_len=4)
    with pytest.raises(ValueError, match="row_lengths"):
        build_program([tree], 4, seq_len=ROW, row_lengths=[8, 32])
    assert [prefix_bucket(n) for n in (0, 1, 8, 9, 33, 100)] == [0, 8, 8, 12, 48, 128]
    assert [octave_step_length(n, 8) for n in (1, 9, 33, 100, 200, 257)] == [8, 16, 40, 104, 208,
                                                                            288]


def longest_shared_prefix(trees) -> int:
    """Length of the longest prefix that several paths share."""
    best = 0
    for t in trees:
        shared = np.bincount(t.flat_token_index, minlength=t.n_tree_tokens) > 1
        best = max([best] + (t.token_arrays["pos"][shared] + 1).tolist())
    return best


def test_program_computes_each_token_once_and_packs_small_trees():
    trees = multi_part_trees(seed=7)
    assert longest_shared_prefix(trees) == 8  # capacities 5, 3 and 2 below cut shared prefixes
    for capacity in (16, 5, 3, 2):
        program = build_program(trees, capacity, seq_len=ROW)
        assert program.n_computed == sum(len(on_path_tokens(t)) for t in trees)
        assert len(program.parts) >= 2
    # Capacity 16: the small tree rides in a part row's spare room; a 3-token-capacity row of 3
    # tokens has no room, so it goes to an ordinary micro-batch.
    assert build_program(trees, 16, seq_len=ROW).whole is None
    assert build_program(trees, 3).whole_trees == (2,)
    # With one row length every part row has the same shapes (one compile per jitted piece).
    program = build_program(trees, 3, seq_len=ROW, row_lengths=[ROW])
    shapes = [tuple(v.shape for v in jax.tree_util.tree_leaves(p.inputs)) for p in program.parts]
    assert set(shapes) == {shapes[0]}
    # Every part has the prefix region of the longest prefix; parts at the top of a tree read
    # padding only.
    for capacity in (5, 3, 2):
        program = build_program(trees, capacity, seq_len=ROW)
        longest = max(len(prefix_tokens(program, k)) for k in range(len(program.parts)))
        assert {p.prefix_len for p in program.parts} == {prefix_bucket(longest)}
        for p in program.parts:
            if p.parent < 0:
                j = np.arange(p.prefix_len)
                np.testing.assert_array_equal(p.inputs.mask.prefix_end[0], j + 1)  # padding only
                np.testing.assert_array_equal(p.inputs.prefix_pred[0], -1)


def prefix_tokens(program, k: int) -> np.ndarray:
    """The prefix slots of part k that hold tokens (the rest are padding)."""
    part = program.parts[k]
    return np.zeros(0, np.int32) if part.gather_index is None else np.flatnonzero(
        part.gather_index[0] >= 0)


def test_part_rows_fit_their_content():
    """A part row is the smallest allowed length holding its tokens (and the small trees packed
    after them): by default tree mode's row lengths (`row_length_ladder`);
    `row_lengths=[seq_len]` gives every part row the full length."""
    trees = multi_part_trees(seed=7)
    assert [row_length(n, 256) for n in (1, 64, 65, 129, 193, 300)] == [64, 64, 128, 192, 256,
                                                                       256]
    assert [row_length(n, 256, steps_per_octave=1) for n in (65, 129)] == [128, 256]
    assert [row_length(n, 1280) for n in (300, 600)] == [320, 640]
    assert [row_length(n, 64, [16, 32]) for n in (1, 20, 40)] == [16, 32, 64]
    assert {row_length(n, 256) for n in range(1, 300)} == set(row_length_ladder(256, 8))
    for capacity in (16, 5, 2):
        fitted = build_program(trees, capacity, seq_len=64, row_lengths=FITTED)
        for p in fitted.parts:
            content = sum(len(m.tokens) for m in p.members)
            assert p.inputs.shape[1] == row_length(content, 64, FITTED)
            assert p.inputs.valid[0, :content].all() and not p.inputs.valid[0, content:].any()
        fixed = build_program(trees, capacity, seq_len=64, row_lengths=[64])
        assert {p.inputs.shape[1] for p in fixed.parts} == {64}
        assert fitted.n_computed == fixed.n_computed
        ladder = build_program(trees, capacity, seq_len=256)
        assert {p.inputs.shape[1] for p in ladder.parts} == {64}  # parts of <= 16 + 3 tokens
    for bad in (0, 3, 2.0, True):
        with pytest.raises(ValueError, match="row_steps_per_octave"):
            build_program(trees, 5, seq_len=64, row_steps_per_octave=bad)


@pytest.mark.parametrize("steps", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("min_step", [2, 8])
def test_octave_step_lengths_bound_padding_and_count(steps, min_step):
    """Lengths on the grid of `steps` per octave (steps of at least `min_step` tokens): the
    smallest grid length holding n, padding below max(n / steps, min_step), at most `steps`
    lengths per octave."""
    n = np.arange(1, 4097)
    lengths = np.array([octave_step_length(int(k), steps, min_step) for k in n])
    assert np.all(lengths >= n) and np.all(np.diff(lengths) >= 0)
    assert np.all(lengths[n <= 8] == 8) and np.all(lengths % min_step == 0)
    big = n > 8
    assert np.all(lengths[big] - n[big] < np.maximum(min_step, n[big] / steps))
    grid = np.unique(lengths)
    assert np.all(lengths[grid - 1] == grid)  # a grid length holds itself: smallest fit
    assert len(grid) <= steps * 9 + 1  # 8, then the octaves (8, 16], ..., (2048, 4096]
    assert {256, 512, 4096} <= set(grid)  # powers of two are on every grid


def test_child_order_minimizes_need_over_every_order():
    import itertools

    trees = multi_part_trees(seed=7)
    for capacity in (5, 3, 2):
        program = build_program(trees, capacity)  # default buckets: parts differ in size
        order = child_order(program)
        for k, part in enumerate(program.parts):
            best = min(subtree_need(program, [o if j != k else perm for j, o in enumerate(order)],
                                    k)
                       for perm in itertools.islice(itertools.permutations(part.children), 720))
            assert subtree_need(program, order, k) == best


def test_dense_equals_unpartitioned_tree():
    graphdef, params = tiny_model(seed=3)
    check_parts(graphdef, params, SFT, capacities=(16, 5, 2), modes=("residuals", "auto"))


def test_temperature_equals_unpartitioned_tree():
    """At `objective.temperature` 0.7 the parts' loss, gradients and log-probs equal the
    unpartitioned tree's, whose log-probs tests/hf/test_hf_torch.py holds to transformers'."""
    graphdef, params = tiny_model(seed=3)
    check_parts(graphdef, params, dataclasses.replace(PPO, temperature=0.7), capacities=(5,),
           modes=("residuals",))


def test_moe_equals_unpartitioned_tree_with_pooled_router_loss():
    graphdef, params = perturbed_moe_model("moe")
    check_parts(graphdef, params, PPO, capacities=(5,), modes=("residuals",), row_lengths=[ROW])


def test_padded_parts_of_branching_trees_equal_unpartitioned_tree():
    """Trees that branch at several levels, with siblings and paths ending at internal nodes, cut
    into parts whose rows and prefix regions are padded (parts of at most 5 or 3 tokens in rows
    of 8 or 16; every prefix padded to the bucket of the program's longest one, a larger bucket
    than some parts' own): loss, gradients and log-probs equal the unpartitioned trees' (tree
    mode, which shares no redundancy-free code)."""
    trees = multi_part_trees(seed=2)
    for t in trees[:2]:  # the two split into parts (the third is packed whole)
        assert int(t.node_levels.max()) >= 4
        assert np.bincount(t.parents[t.parents >= 0]).max() >= 3  # siblings
        assert np.isin(t.path_nodes, t.parents).any()  # a path ends at an internal node
    for capacity in (5, 3):
        program = build_program(trees, capacity, seq_len=ROW, row_lengths=(8, ROW))
        (p_len,) = {p.prefix_len for p in program.parts}
        own = [prefix_bucket(len(prefix_tokens(program, k))) for k, p in enumerate(program.parts)
               if p.parent >= 0]
        assert min(own) < p_len  # prefixes padded beyond their own bucket
        assert any(not p.inputs.valid[0].all() for p in program.parts)  # padded rows
    graphdef, params = tiny_model(seed=5)
    check_parts(graphdef, params, SFT, capacities=(5, 3), modes=("auto",), trees=trees,
           prefix_buckets=None)


def test_compiles_are_bounded_by_row_lengths_and_prefix_regions():
    """Steps of varied trees (other structures, capacities, numbers of parts and children,
    prefix lengths): each jitted piece of the executor compiles at most once per (row length,
    prefix region) pair, since a program has one prefix region and its part structure is data,
    not shape; steps on new trees at shapes seen before compile nothing. Counted by jit cache
    entries and XLA compiles (`CompileWatch`), not time."""
    graphdef, params = tiny_model(seed=3)
    step = RedundancyFreeStep(graphdef, SFT, prefix_backward="auto")
    programs = [build_program(multi_part_trees(seed), capacity, seq_len=ROW,
                              row_lengths=(8, ROW))
                for seed in (7, 2, 3, 4) for capacity in (5, 3)]
    assert all(len({p.prefix_len for p in prog.parts}) == 1 for prog in programs)
    pairs = {(p.inputs.shape[1], p.prefix_len) for prog in programs for p in prog.parts}
    assert len(pairs) <= 2 * 2  # row lengths (8, 16) x prefix regions (8, 12)
    assert sum(len(prog.parts) for prog in programs) > 30 * len(pairs)
    per_part = (step._leaf, step._forward, step._backward, step._outputs,
                step._forward_backward, step._extend, step._extend_back, step._accumulate)
    cached = [fn._cache_size() for fn in per_part]  # a jit of a module function shares its cache
    compiles = []
    with CompileWatch() as watch:
        for prog in programs:
            before = watch.total.n
            step(params, prog)
            compiles.append(watch.total.n - before)
    for fn, n in zip(per_part, cached):
        assert fn._cache_size() - n <= len(pairs)
    assert compiles[4:] == [0] * 4, compiles  # seeds 3 and 4: new trees, no new shapes


def test_whole_tree_micro_batches_equal_unpartitioned_tree():
    """Small trees that fit no part row run as whole micro-batches, one call each (three here),
    with the MoE router load pooled over the whole program: PPO's loss, metrics (the clip
    fraction a ratio of sums over the micro-batches and the parts) and gradients equal the
    unpartitioned trees'."""
    rng = np.random.default_rng(3)
    small = []
    while len(small) < 4:
        t = consistent_tree(rng, max_nodes=4, max_seg=3, roots=1)
        if 4 <= t.n_tree_tokens <= 8:
            small.append(t)
    trees = multi_part_trees(seed=7)[:2] + small
    assert len(build_program(trees, 8).whole.batches) == 3
    graphdef, params = perturbed_moe_model("moe")
    check_parts(graphdef, params, PPO, capacities=(8,), modes=("residuals",), trees=trees,
           row_lengths=None, prefix_buckets=None, seq_len=8)


def gdn_only_model():
    """A one-layer Gated DeltaNet model with a dense MLP: the GDN prefix path (conv context,
    states at attach tokens) at a fraction of the hybrid MoE model's compile time."""
    cfg = four_expert_config("next", mlp_only_layers=(0,), num_hidden_layers=1,
                             layer_types=("linear_attention",))
    return nnx.split(tiny_lm(cfg, 0))


def test_gdn_equals_unpartitioned_tree():
    graphdef, params = gdn_only_model()
    check_parts(graphdef, params, SFT, capacities=(5,), modes=("recompute",), chunk=CHUNK)


def scanned_model(kind: str):
    """Two layers run as one scan (`runtime.scan_layers`): attention + MLP ("dense") or Gated
    DeltaNet + MLP ("gdn") layers, so per-layer prefix caches go into the scan body stacked and
    exports come out per layer."""
    cfg = tiny_config() if kind == "dense" else four_expert_config(
        "next", mlp_only_layers=(0, 1), num_hidden_layers=2, layer_types=("linear_attention",) * 2)
    graphdef, params = nnx.split(tiny_lm(cfg, 0, scan_layers=True))
    return graphdef, perturbed(params, scale=0.2)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "gdn"])
def test_scanned_layers_equal_unpartitioned_tree(kind):
    graphdef, params = scanned_model(kind)
    check_parts(graphdef, params, SFT, capacities=(5,),
           modes=("residuals",) if kind == "dense" else ("recompute",),
           chunk=CHUNK if kind == "gdn" else None)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "moe", "hybrid"])
@pytest.mark.parametrize("objective", [SFT, PPO], ids=["sft", "ppo"])
def test_equals_unpartitioned_tree_slow(kind, objective):
    # Every kind, objective and prefix-backward mode; the capacities split between the two
    # objectives and paired with the modes (each shape of rows compiles its own program), so
    # each kind sees all four capacities and every mode under both objectives. The hybrid
    # (Qwen3.5-MoE: Gated DeltaNet, attention and MoE layers) runs the GDN prefix path of the
    # GDN-only model (the default test's) at every capacity and mode.
    graphdef, params = {"dense": lambda: tiny_model(seed=3)}.get(
        kind, lambda: perturbed_moe_model(kind))()
    check_parts(graphdef, params, objective, capacities=(16, 3) if objective is SFT else (5, 2),
           modes=("residuals", "recompute", "auto"),
           chunk=CHUNK if kind == "hybrid" else None, paired=True)
