import json

import jax
import numpy as np
import pytest

from jtree.config.objective import Objective
from jtree.layout.coefficients import batch_normalizer
from jtree.layout.flop_model import FlopModel
from jtree.layout.gdn_tables import default_chunk_count
from jtree.layout.planner import LayoutConfig
from jtree.step.batches import build_batch, stack_microbatches
from jtree.step.train_step import make_grad_fn
from jtree.training.pipeline import make_pipeline
from jtree.training.step_builders import (
    AutoStepBuilder,
    StepBuilder,
    StepConfig,
    all_units,
    rows_for_run,
    step_indices,
)
from jtree.training.tree_files import load_trees
from jtree.trees.synthetic import por_forest
from tests.models_util import tiny_config, tiny_model
from tests.run_util import VOCAB
from tests.strategies import seeded_forests


def _plan(mode="tree", shards=(0, 1), n_shards=2, rows=4, micro=2, per_step=6, seq_len=64,
          **layout):
    return StepConfig(mode, "token_mean", per_step, shards,
                      LayoutConfig(seq_len, n_shards, micro, rows, **layout))


def _builder(trees, plan):
    return StepBuilder(trees, all_units(trees, plan.mode, plan.layout.seq_len), plan)


def test_bad_group_lines_fail_with_file_and_line_or_are_skipped_and_counted(tmp_path):
    path = tmp_path / "g.jsonl"
    lines = [
        {"group": 0, "tokens": [1, 2, 3]},
        "{not json",
        {"group": 0, "tokens": [1, 2, 4]},
        {"group": 1, "tokens": [5, 6, VOCAB + 1]},
        {"group": 1, "tokenz": [5, 6]},
        {"group": 2, "tokens": [7, 8], "loss_mask": [1, 1, 1]},
        {"group": 3, "tokens": [9, 9]},
    ]
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    with pytest.raises(ValueError, match=rf"^{path}:2: invalid JSON"):
        load_trees(path, "groups", vocab_size=VOCAB)
    trees, report = load_trees(path, "groups", vocab_size=VOCAB, on_bad_record="skip")
    assert (report.n_lines, report.n_bad, report.n_trees) == (7, 4, 2)
    assert [t.n_paths for t in trees] == [2, 1]
    assert report.first_errors[1].startswith(f"{path}:4: tokens[2] = {VOCAB + 1} is outside")
    assert report.first_errors[2] == f"{path}:5: missing field 'tokens'"
    assert report.first_errors[3].startswith(f"{path}:6: loss_mask")


def test_bad_tree_lines_fail_with_file_and_line_or_are_skipped(tmp_path):
    path = tmp_path / "t.jsonl"
    good = {"parents": [-1, 0, 0], "segments": [[1, 2], [3], [4]]}
    cycle = {"parents": [1, 0], "segments": [[1], [2]]}
    path.write_text("\n".join(json.dumps(x) for x in (good, cycle, good)) + "\n")
    with pytest.raises(ValueError, match=rf"^{path}:2: node 0: parent chain forms a cycle"):
        load_trees(path, "trees", vocab_size=VOCAB)
    trees, report = load_trees(path, "trees", vocab_size=VOCAB, on_bad_record="skip")
    assert (len(trees), report.n_bad) == (2, 1)


def test_hosts_build_disjoint_shards_of_the_same_global_step():
    trees = seeded_forests(12, max_nodes=8)
    index = step_indices(len(trees), 6, seed=3)
    whole = _builder(trees, _plan(shards=(0, 1)))(index[1])
    first = _builder(trees, _plan(shards=(0,)))(index[1])
    second = _builder(trees, _plan(shards=(1,)))(index[1])
    for value, a, b in zip(*(jax.tree_util.tree_leaves(x["inputs"])
                             for x in (whole, first, second))):
        assert value.shape[:2] == (2, 8)
        np.testing.assert_array_equal(value, np.concatenate([a, b], axis=1))
    chosen = [trees[int(i)] for i in index[1]]
    assert whole["inputs"].row_norm.sum() == pytest.approx(
        batch_normalizer(chosen, "token_mean"), rel=1e-6)
    assert int(whole["info"]["n_tree_tokens"]) == sum(t.n_tree_tokens for t in chosen)
    assert int(whole["inputs"].valid.sum()) == sum(t.n_tree_tokens for t in chosen)


@pytest.mark.parametrize("mode, seq_len", [("baseline", 64), ("tree", None)])
def test_raw_coefficients_with_row_norm_give_the_normalized_loss(mode, seq_len):
    """The pipeline's raw coefficients + per-row normalizer shares == host-normalized batch of
    whole trees; in tree mode with seq_len = the longest path, so that some trees fit whole and
    others are cut into parts."""
    trees = seeded_forests(6, seed=1, max_nodes=8)
    graphdef, params = tiny_model(seed=4)
    objective = Objective(kind="sft", normalization="token_mean")
    if seq_len is None:
        seq_len = max(int(t.path_lengths.max()) for t in trees)
        assert max(t.n_tree_tokens for t in trees) > seq_len
    units = all_units(trees, mode, seq_len)
    if seq_len < 64:
        assert len(sum(units, [])) > len(trees)  # some trees really are partitioned
    rows = rows_for_run(units, seq_len, 6, 2, seed=0, steps=1)
    plan = _plan(mode, shards=(0,), n_shards=1, rows=rows, seq_len=seq_len)
    element = StepBuilder(trees, units, plan)(np.arange(6))
    assert element["info"]["n_computed_tokens"] >= element["info"]["n_tree_tokens"]
    grad_fn = jax.jit(make_grad_fn(graphdef, objective))
    loss_raw, _, g_raw = grad_fn(params, element["inputs"])
    reference = build_batch(trees, 64, mode=mode, normalization="token_mean")
    loss_ref, _, g_ref = grad_fn(params, stack_microbatches([reference]))
    assert float(loss_raw) == pytest.approx(float(loss_ref), rel=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(g_raw), jax.tree_util.tree_leaves(g_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def test_shuffle_is_seeded_covers_each_epoch_and_iterator_state_resumes():
    a, b = step_indices(8, 4, seed=0), step_indices(8, 4, seed=1)
    assert sorted(np.concatenate([a[0], a[1]]).tolist()) == list(range(8))
    assert sorted(np.concatenate([a[2], a[3]]).tolist()) == list(range(8))
    assert np.concatenate([a[0], a[1]]).tolist() != np.concatenate([a[2], a[3]]).tolist()
    assert np.concatenate([a[0], a[1]]).tolist() != np.concatenate([b[0], b[1]]).tolist()

    trees = seeded_forests(8, seed=2, max_nodes=8)
    units = all_units(trees, "tree", 64)
    plan = _plan(shards=(0,), n_shards=1, rows=rows_for_run(units, 64, 3, 2, 5, 10), per_step=3)
    it = iter(make_pipeline(StepBuilder(trees, units, plan), seed=5))
    for _ in range(3):
        next(it)
    state = it.get_state()
    expected = [next(it)["inputs"].tokens for _ in range(2)]
    again = iter(make_pipeline(StepBuilder(trees, units, plan), seed=5))
    again.set_state(json.loads(json.dumps(state)))
    for want in expected:
        np.testing.assert_array_equal(next(again)["inputs"].tokens, want)


def test_auto_mode_picks_by_predicted_gain_and_both_modes_give_the_same_loss():
    """Low sharing -> baseline, high sharing -> tree, with the reason in `info`; the step's loss
    and gradients are the same whichever mode runs it (the choice only changes speed)."""
    graphdef, params = tiny_model(seed=5)
    objective = Objective(kind="sft", normalization="token_mean")
    grad_fn = jax.jit(make_grad_fn(graphdef, objective))
    flop_model = FlopModel.for_config(tiny_config())
    for por, want in ((0.0, "baseline"), (0.8, "tree")):
        trees = por_forest(np.random.default_rng(2), 240, por, path_len=40, max_tree_tokens=60,
                           vocab_size=64)
        builders = {}
        for mode in ("tree", "baseline"):
            units = all_units(trees, mode, 64)
            rows = rows_for_run(units, 64, len(trees), 1, seed=0, steps=1)
            builders[mode] = StepBuilder(trees, units, _plan(mode, shards=(0,), n_shards=1,
                                                             rows=rows, micro=1,
                                                             per_step=len(trees)))
        auto = AutoStepBuilder(builders, flop_model, min_gain=1.05)
        element = auto(np.arange(len(trees)))
        assert element["info"]["mode"] == want, element["info"]["mode_reason"]
        stats = sum((t.stats() for t in trees[1:]), trees[0].stats())
        assert f"POR {stats.por:.3f}" in element["info"]["mode_reason"]
        other = builders["tree" if want == "baseline" else "baseline"](np.arange(len(trees)))
        loss_a, _, g_a = grad_fn(params, element["inputs"])
        loss_b, _, g_b = grad_fn(params, other["inputs"])
        assert float(loss_a) == pytest.approx(float(loss_b), rel=1e-6)
        for a, b in zip(jax.tree_util.tree_leaves(g_a), jax.tree_util.tree_leaves(g_b)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def _chunks_used(gdn_chunk_tokens: np.ndarray) -> int:
    """The most chunks holding a token in any row."""
    return int((gdn_chunk_tokens >= 0).any(axis=-1).sum(axis=-1).max())


@pytest.mark.parametrize("mode", ["tree", "baseline"])
def test_gdn_chunk_tables_share_one_bucketed_capacity_per_step(mode):
    """Every micro-batch and shard of a step gets the same chunk capacity: the bucket of the
    fullest row of the whole step (computed alike by every host); bins left empty get tables of
    that capacity holding nothing."""
    trees = seeded_forests(12, seed=3, max_nodes=8)
    index = step_indices(len(trees), 3, seed=0)
    for k in range(4):
        parts = []
        for shards in ((0, 1), (0,), (1,)):
            plan = _plan(mode, shards=shards, per_step=3, rows=8, gdn_chunk_size=3)
            parts.append(_builder(trees, plan)(index[k])["inputs"])
        whole, first, second = parts
        for key in ("chunk_tokens", "chunk_src", "token_slot"):
            np.testing.assert_array_equal(
                getattr(whole.gdn, key),
                np.concatenate([getattr(first.gdn, key), getattr(second.gdn, key)], axis=1))
        tables = whole.gdn.chunk_tokens  # [micro, rows, NC, C]
        used = _chunks_used(tables)
        assert tables.shape[2] == default_chunk_count(64, 3, used) >= used
        per_bin = lambda x: x.reshape((2, 2, 8) + x.shape[2:])  # noqa: E731  [micro, shard, ...]
        empty = ~per_bin(whole.valid).any(axis=(2, 3))
        if mode == "tree":
            assert empty.any()  # 3 trees for 4 bins: a bin with no tree
        assert np.all(per_bin(tables)[empty] == -1)
        assert np.all(whole.gdn.token_slot[~whole.valid] == -1)
    plan = _plan(mode, per_step=3, rows=8, gdn_chunk_size=3, gdn_chunks=2)
    with pytest.raises(ValueError, match=r"gdn_chunks=2: row \d+ needs \d+ chunks"):
        _builder(trees, plan)(index[0])
