"""Two processes joined by jax.distributed (localhost, one CPU device each, an FSDP mesh: fsdp=2,
so each process holds half of every parameter and of its optimizer state) train the same losses
as one process, and the checkpoint they write together restores to the one-process run's
parameters."""

import socket

import jax
import jax.numpy as jnp
import pytest

from jtree.training.checkpoint import Checkpointer, abstract_like
from jtree.config import load_config
from jtree.launch.train import main
from jtree.training.trainer import Trainer
from tests.run_util import finish, launch, read_metrics, tiny_overrides, xla_flags


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _two_processes(args: list[str], tmp_path, devices: int = 1) -> str:
    """Run `jtree.launch.train --config configs/tiny.yaml ARGS` as two processes joined by
    jax.distributed, `devices` CPU devices each; process 0's output (both must succeed)."""
    port = _free_port()
    procs = []
    for pid in range(2):
        env = {"JTREE_COORDINATOR": f"localhost:{port}", "JTREE_NUM_PROCESSES": "2",
               "JTREE_PROCESS_ID": str(pid),
               "XLA_FLAGS": xla_flags(devices)}
        log = tmp_path / f"proc{pid}"
        procs.append((launch(["--config", "configs/tiny.yaml", *args], log, env), log))
    results = [finish(p, log) for p, log in procs]
    for code, _, err in results:
        assert code == 0, err[-3000:]
    return results[0][1]


def test_two_processes_match_one(groups_file, tmp_path):
    common = tiny_overrides(groups_file, **{"run.steps": 3})
    single = tmp_path / "single.jsonl"
    assert main(["--config", "configs/tiny.yaml", *common, f"run.metrics_jsonl={single}",
                 f"checkpoint.dir={tmp_path}/single_ckpt"]) == 0

    multi = tmp_path / "multi.jsonl"
    out = _two_processes([*common, f"run.metrics_jsonl={multi}", "mesh.data=1", "mesh.fsdp=2",
                          f"checkpoint.dir={tmp_path}/ckpt"], tmp_path)
    assert "mesh data=1 x fsdp=2 x model=1 over 2 process(es)" in out
    a, b = read_metrics(single), read_metrics(multi)
    assert [r["step"] for r in b] == [0, 1, 2]
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
        assert y["n_tree_tokens"] == x["n_tree_tokens"]
    # Both checkpoints restored in this process (its own devices, the default mesh): the joint
    # one equals the single-process run's parameters. Measured against how far training moved
    # them from their initial values, not against their size: Adam normalizes each element's
    # update, so where a gradient is near zero the two runs' float32 sums (in another order) can
    # move an element by different fractions of the learning rate. A process's gradients dropped
    # or counted twice moves every parameter by a share of the update itself (measured here:
    # 3.4e-5 of the distance trained; a learning rate 1% off fails the loss check first).
    trainer = Trainer.build(load_config("configs/tiny.yaml", common))
    abstract = abstract_like(jax.eval_shape(trainer.init_fn), trainer.shardings)
    params = {}
    for name in ("single_ckpt", "ckpt"):
        ckpt = Checkpointer(tmp_path / name)
        params[name] = ckpt.restore(3, abstract).state.params
        ckpt.close()
    initial = jax.tree_util.tree_leaves(trainer.init_fn().params)
    leaves = zip(jax.tree_util.tree_leaves(params["ckpt"]),
                 jax.tree_util.tree_leaves(params["single_ckpt"]), initial, strict=True)
    moved = [float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b - p0)) for a, b, p0 in leaves]
    assert moved and max(moved) <= 1e-3, moved


def test_distributed_environment_is_validated():
    from jtree.parallel.distributed import initialize_from_env

    assert initialize_from_env({}) is False  # nothing set: one process
    with pytest.raises(ValueError, match=r"JTREE_NUM_PROCESSES, JTREE_PROCESS_ID not set"):
        initialize_from_env({"JTREE_COORDINATOR": "localhost:1234"})
    with pytest.raises(ValueError, match=r"JTREE_PROCESS_ID=2 is not in \[0, 2\)"):
        initialize_from_env({"JTREE_COORDINATOR": "localhost:1234", "JTREE_NUM_PROCESSES": "2",
                             "JTREE_PROCESS_ID": "2"})


@pytest.mark.slow
def test_context_parallel_over_two_processes_matches_one(groups_file, tmp_path):
    """Two processes of two CPU devices each, mesh data=2 x context=2: each process feeds the
    rows of its data shard, split over its own two devices, and the processes agree on one set
    of per-device capacities every step (`jtree.parallel.context.agreed`); the losses equal the
    one-process, one-device run's."""
    common = tiny_overrides(groups_file, **{"run.steps": 3})
    single = tmp_path / "single.jsonl"
    assert main(["--config", "configs/tiny.yaml", *common, f"run.metrics_jsonl={single}"]) == 0
    multi = tmp_path / "multi.jsonl"
    out = _two_processes([*common, f"run.metrics_jsonl={multi}", "mesh.data=2", "mesh.context=2"],
                         tmp_path, devices=2)
    assert "mesh data=2 x fsdp=1 x context=2 x model=1 over 2 process(es)" in out
    a, b = read_metrics(single), read_metrics(multi)
    assert [r["step"] for r in b] == [0, 1, 2]
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)


def test_a_row_over_several_processes_is_refused_by_name():
    """Each process feeds whole rows: a context x model group that spans processes fails naming
    the settings (checked on a stand-in mesh of devices of two processes)."""
    from types import SimpleNamespace

    import numpy as np

    from jtree.parallel.context import check_rows_within_processes

    devices = np.array([SimpleNamespace(process_index=i // 2) for i in range(4)])
    mesh = SimpleNamespace(devices=devices.reshape(1, 1, 4, 1),
                           shape={"data": 1, "fsdp": 1, "context": 4, "model": 1})
    with pytest.raises(ValueError, match=r"^mesh.context=4 x mesh.model=1: the devices of row "
                                         r"shard 0 span processes \[0, 1\]"):
        check_rows_within_processes(mesh)
    check_rows_within_processes(SimpleNamespace(devices=devices.reshape(2, 1, 2, 1),
                                                shape={"data": 2, "fsdp": 1, "context": 2,
                                                       "model": 1}))
