"""Two processes joined by jax.distributed (localhost, one CPU device each, an FSDP mesh: fsdp=2,
so each process holds half of every parameter and of its optimizer state) train the same losses
as one process, and the checkpoint they write together restores to the one-process run's
parameters."""

import socket

import jax
import pytest

from jtree.checkpoint import Checkpointer, abstract_like
from jtree.config import load_config
from jtree.launch.train import main
from jtree.trainer import Trainer
from tests.models_util import rel_l2
from tests.run_util import finish, launch, read_metrics, tiny_overrides


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_match_one(groups_file, tmp_path):
    common = tiny_overrides(groups_file, **{"run.steps": 3})
    single = tmp_path / "single.jsonl"
    assert main(["--config", "configs/tiny.yaml", *common, f"run.metrics_jsonl={single}",
                 f"checkpoint.dir={tmp_path}/single_ckpt"]) == 0

    multi = tmp_path / "multi.jsonl"
    port = _free_port()
    procs = []
    for pid in range(2):
        env = {"JTREE_COORDINATOR": f"localhost:{port}", "JTREE_NUM_PROCESSES": "2",
               "JTREE_PROCESS_ID": str(pid)}
        log = tmp_path / f"proc{pid}"
        procs.append((launch(["--config", "configs/tiny.yaml", *common,
                              f"run.metrics_jsonl={multi}", "mesh.data=1", "mesh.fsdp=2",
                              f"checkpoint.dir={tmp_path}/ckpt"], log, env), log))
    results = [finish(p, log) for p, log in procs]
    for code, out, err in results:
        assert code == 0, err[-3000:]
    assert "mesh data=1 x fsdp=2 x model=1 over 2 process(es)" in results[0][1]
    a, b = read_metrics(single), read_metrics(multi)
    assert [r["step"] for r in b] == [0, 1, 2]
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
        assert y["n_tree_tokens"] == x["n_tree_tokens"]
    # Both checkpoints restored in this process (its own devices, the default mesh): the joint
    # one equals the single-process run's parameters (float32 tolerances of docs/design.md).
    trainer = Trainer.build(load_config("configs/tiny.yaml", common))
    abstract = abstract_like(jax.eval_shape(trainer.init_fn), trainer.shardings)
    params = {}
    for name in ("single_ckpt", "ckpt"):
        ckpt = Checkpointer(tmp_path / name)
        params[name] = ckpt.restore(3, abstract).state.params
        ckpt.close()
    pairs = list(zip(jax.tree_util.tree_leaves(params["ckpt"]),
                     jax.tree_util.tree_leaves(params["single_ckpt"])))
    assert pairs and max(rel_l2(a, b) for a, b in pairs) <= 1e-5


def test_distributed_environment_is_validated():
    from jtree.distributed import initialize_from_env

    assert initialize_from_env({}) is False  # nothing set: one process
    with pytest.raises(ValueError, match=r"JTREE_NUM_PROCESSES, JTREE_PROCESS_ID not set"):
        initialize_from_env({"JTREE_COORDINATOR": "localhost:1234"})
    with pytest.raises(ValueError, match=r"JTREE_PROCESS_ID=2 is not in \[0, 2\)"):
        initialize_from_env({"JTREE_COORDINATOR": "localhost:1234", "JTREE_NUM_PROCESSES": "2",
                             "JTREE_PROCESS_ID": "2"})
