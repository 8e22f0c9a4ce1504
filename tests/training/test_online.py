"""`jtree.training.online.OnlineTrainer`: trees built in Python trained step by step. Two steps on
a batch of branching trees equal `jtree train` fed the same trees from a file (one step per epoch
of the file: every tree in each step), in loss and in the parameters the file-fed run
checkpointed, though the two lay the trees out at different sizes; steps of varied batches share
compiled programs; bad trees are refused by name."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jtree.config import load_config
from jtree.training.online import OnlineTrainer, shape_bucket
from jtree.training.run import train
from jtree.training.run_data import load_training_trees
from jtree.trees.tree import TrajectoryTree
from tests.run_util import VOCAB, checkpoint_params, read_metrics, tiny_overrides, write_groups

N_TREES = 6


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_groups(tmp_path_factory.mktemp("online") / "groups.jsonl", n_groups=N_TREES)


def config(data, tmp_path, *extra: str):
    return load_config(None, tiny_overrides(data, **{
        "data.trees_per_step": N_TREES, "run.steps": 2, "checkpoint.every": 2,
        "checkpoint.async_save": False}) + list(extra))


def test_two_steps_equal_the_file_fed_run(data, tmp_path):
    filed = config(data, tmp_path, f"checkpoint.dir={tmp_path}/filed",
                   f"run.metrics_jsonl={tmp_path}/filed.jsonl")
    train(filed)
    trees, _ = load_training_trees(filed)
    assert len(trees) == N_TREES and max(t.n_paths for t in trees) > 1  # branching groups
    online = OnlineTrainer.create(dataclasses.replace(
        filed, checkpoint=dataclasses.replace(filed.checkpoint, dir=str(tmp_path / "online")),
        run=dataclasses.replace(filed.run, metrics_jsonl=str(tmp_path / "online.jsonl"))))
    records = [online.step(trees[::-1]), online.step(trees)]  # a step's order is free
    online.save()
    online.close()
    expected = read_metrics(tmp_path / "filed.jsonl")
    for got, want in zip(records, expected, strict=True):
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=2e-6)
        np.testing.assert_allclose(got["grad_norm"], want["grad_norm"], rtol=2e-5)
        assert got["n_flat_tokens"] == want["n_flat_tokens"]
        assert got["n_tree_tokens"] == want["n_tree_tokens"]
    assert read_metrics(tmp_path / "online.jsonl") == records
    want, got = checkpoint_params(tmp_path / "filed", 2), checkpoint_params(tmp_path / "online", 2)
    assert want.keys() == got.keys()
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)
    assert OnlineTrainer.create(dataclasses.replace(
        filed, checkpoint=dataclasses.replace(filed.checkpoint, dir=str(tmp_path / "online"))),
        resume=True).steps_done == 2


def test_varied_batches_compile_a_bounded_number_of_steps(tmp_path):
    data = write_groups(tmp_path / "groups.jsonl", n_groups=16)
    cfg = config(data, tmp_path)
    trees, _ = load_training_trees(cfg)
    online = OnlineTrainer.create(cfg)
    sizes = [3, 5, 6, 7, 9, 10, 11, 13, 14, 16]
    rows = []
    for n in sizes:
        record = online.step(trees[:n])
        assert np.isfinite(record["loss"]) and record["n_trees"] == n
        rows.append(online._builder(trees[:n]).config.layout.rows)
    # 1 to 8 rows per micro-batch, rounded up to 1, 2, 4 or 8, and two score widths: a handful of
    # step programs, where each row count compiled its own (measured without the buckets: 8).
    assert sorted(set(rows)) == [1, 2, 4, 8], rows
    assert online.trainer.step_fn._cache_size() <= 5, online.trainer.step_fn._cache_size()
    assert [shape_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]


def test_bad_trees_are_refused_by_name(data, tmp_path):
    cfg = config(data, tmp_path)
    online = OnlineTrainer.create(cfg)
    good = TrajectoryTree.from_sequences([[1, 2, 3, 4], [1, 2, 5]])
    cases = [
        ([], "trees: a step needs at least one tree"),
        ([good, [1, 2, 3]], "trees[1]: expected a TrajectoryTree, got list"),
        ([good, TrajectoryTree.from_sequences([[1, VOCAB]])],
         f"trees[1]: token id {VOCAB} is outside the model's vocabulary of {VOCAB}"),
        ([TrajectoryTree.from_sequences([[1] * 129, [1, 2]])],
         "trees[0]: path 0 has 129 tokens, more than a row holds (data.seq_len=128)"),
    ]
    for trees, message in cases:
        with pytest.raises((ValueError, TypeError)) as e:
            online.step(trees)
        assert str(e.value).startswith(message), (str(e.value), message)
    assert online.steps_done == 0 and not online.history
    with pytest.raises(ValueError, match="run.mode=redundancy_free: not available in process"):
        OnlineTrainer.create(config(data, tmp_path, "run.mode=redundancy_free"))
    jax.clear_caches()
