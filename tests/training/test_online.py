"""`jtree.training.online.OnlineTrainer`: trees built in Python trained step by step. Two steps on
a batch of branching trees equal `jtree train` fed the same trees from a file (one step per epoch
of the file: every tree in each step), in loss and in the parameters the file-fed run
checkpointed, though the two lay the trees out at different sizes; steps of varied batches share
compiled programs; bad trees are refused by name."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest

from jtree.config import load_config
from jtree.config.objective import OptimConfig
from jtree.training.online import OnlineTrainer, shape_bucket
from jtree.training.run import train
from jtree.training.run_data import load_training_trees
from jtree.trees.tree import TrajectoryTree
from tests.models_util import ROUNDING_LAMBDA, U32, rel_l2
from tests.run_util import VOCAB, checkpoint_params, read_metrics, tiny_overrides, write_groups

N_TREES = 6


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_groups(tmp_path_factory.mktemp("online") / "groups.jsonl", n_groups=N_TREES)


def config(data, tmp_path, *extra: str):
    return load_config(None, tiny_overrides(data, **{
        "data.trees_per_step": N_TREES, "run.steps": 2, "checkpoint.every": 2,
        "checkpoint.async_save": False}) + list(extra))


def adam_direction(moments: dict[str, np.ndarray], name: str, count: int,
                   optim: OptimConfig) -> np.ndarray:
    """AdamW's update over -learning rate (no weight decay) at step `count`, in float64, from the
    first and second moments a checkpoint holds."""
    mu = moments[f"[1][0]['mu']{name}"].astype(np.float64) / (1 - optim.b1 ** count)
    nu = moments[f"[1][0]['nu']{name}"].astype(np.float64) / (1 - optim.b2 ** count)
    return mu / (np.sqrt(nu) + optim.eps)


def assert_same_training(filed: Path, online: Path, records: list[dict], optim: OptimConfig
                         ) -> None:
    """The two runs' checkpoints after each step agree within float32 rounding's error model.
    The runs lay the trees out at different sizes, so every sum runs in another order:
    - the moments (sums of gradients over the step's tokens) within twice the n-term sum bound
      `ROUNDING_LAMBDA * sqrt(n) * U32` per leaf (two float32 results, each that far from the
      exact one; the second moment's squares double it again);
    - the parameters element by element within what their Adam updates explain:
      lr_t * |d_t(filed) - d_t(online)| summed over the steps, d_t each run's own update direction
      from its moments (`adam_direction`), plus the float32 rounding of those updates (twelve U32
      of each, as `tests.mesh_worker.update_rounding` counts them) and of each stored parameter.
      Adam divides by |g| + eps, so an entry whose gradient is near zero turns a rounding-sized
      gradient difference into an update difference up to lr: a fixed elementwise tolerance on
      the parameters fails by chance (one q_proj entry 1.4e-6 apart after two steps, its first
      gradient near zero), whereas this model is exact up to rounding."""
    params = {run: checkpoint_params(run, len(records)) for run in (filed, online)}
    carried = {name: np.zeros(p.shape) for name, p in params[filed].items()}
    stepped = {name: np.zeros(p.shape) for name, p in params[filed].items()}
    for step, record in enumerate(records, start=1):
        moments = {run: checkpoint_params(run, step, "opt_state") for run in (filed, online)}
        n = record["n_tree_tokens"]
        for name, want in moments[filed].items():
            if want.ndim and name.startswith(("[1][0]['mu']", "[1][0]['nu']")):
                bound = (4 if "['nu']" in name else 2) * ROUNDING_LAMBDA * np.sqrt(n) * U32
                assert rel_l2(moments[online][name], want) <= bound, (step, name)
        lr = record["learning_rate"]
        for name in carried:
            d_filed, d_online = (adam_direction(moments[run], name, step, optim)
                                 for run in (filed, online))
            carried[name] += lr * np.abs(d_filed - d_online)
            stepped[name] += lr * np.abs(d_filed)
    for name, want in params[filed].items():
        bound = carried[name] + U32 * (12 * stepped[name] + len(records) * np.abs(want))
        excess = np.abs(params[online][name].astype(np.float64) - want) / bound
        assert excess.max() <= 1.0, (name, excess.max())


def test_two_steps_equal_the_file_fed_run(data, tmp_path):
    filed = config(data, tmp_path, f"checkpoint.dir={tmp_path}/filed", "checkpoint.every=1",
                   f"run.metrics_jsonl={tmp_path}/filed.jsonl")
    train(filed)
    trees, _ = load_training_trees(filed)
    assert len(trees) == N_TREES and max(t.n_paths for t in trees) > 1  # branching groups
    online = OnlineTrainer.create(dataclasses.replace(
        filed, checkpoint=dataclasses.replace(filed.checkpoint, dir=str(tmp_path / "online")),
        run=dataclasses.replace(filed.run, metrics_jsonl=str(tmp_path / "online.jsonl"))))
    records = []
    for batch in (trees[::-1], trees):  # a step's order is free
        records.append(online.step(batch))
        online.save()
    online.close()
    expected = read_metrics(tmp_path / "filed.jsonl")
    for got, want in zip(records, expected, strict=True):
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=2e-6)
        np.testing.assert_allclose(got["grad_norm"], want["grad_norm"], rtol=2e-5)
        assert got["n_flat_tokens"] == want["n_flat_tokens"]
        assert got["n_tree_tokens"] == want["n_tree_tokens"]
        assert got["learning_rate"] == want["learning_rate"]
    assert read_metrics(tmp_path / "online.jsonl") == records
    assert_same_training(tmp_path / "filed", tmp_path / "online", records, filed.optim)
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
