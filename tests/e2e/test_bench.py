"""The benchmark's measurement path on a tiny model: both modes prepared from the same trees, the
work counted, the automatic choice made, and the table / JSON / PNG written. No timing is
asserted (timings are benchmarks, not tests)."""

import json

import numpy as np
import pytest

from jtree.launch.bench import step as bench
from jtree.launch.bench import workloads
from jtree.trees.synthetic import por_forest
from tests.models_util import tiny_config


@pytest.fixture
def tiny_shape(monkeypatch):
    monkeypatch.setitem(workloads.SHAPES, "tiny", tiny_config(head_dim=16, num_hidden_layers=1))
    return "tiny"


def _workload(shape: str, por: float) -> workloads.Workload:
    def make():
        return por_forest(np.random.default_rng(3), 768, por, path_len=96, max_tree_tokens=256,
                          vocab_size=64, trained_fraction=0.5)
    return workloads.Workload(f"{shape}/synthetic POR {por:.1f}", shape, 256, make)


def test_measure_counts_both_modes_on_the_same_trees_and_writes_outputs(tiny_shape, tmp_path):
    step, state = bench.make_step(workloads.SHAPES[tiny_shape], "xla")
    row, state = bench.measure(_workload(tiny_shape, 0.7), step, state, min_reps=1, max_reps=1,
                               budget_s=0.0)
    rows = [row]
    # The tree computes ~30% of the flat tokens; attention makes the FLOP ideal a bit lower.
    assert row["token_bound"] == pytest.approx(1 / (1 - row["por"]), rel=0.05)
    assert 1.0 < row["ideal_speedup"] <= row["token_bound"]
    assert row["auto_mode"] == ("tree" if row["auto_predicted_gain"] >= workloads.AUTO_MIN_GAIN
                                else "baseline")
    assert row["repeats"] == 1 and row["tree_device_s"] > 0 and row["base_device_s"] > 0
    assert len(row["fixed_times_s"]) == 1 and row["fixed_share_tree"] == pytest.approx(
        row["fixed_s"] / row["tree_device_s"])
    assert 0 < row["tree_host_fraction"] < 1 and row["tree_peak_mib"] > 0
    assert row["tree_minor_faults"] >= 0 and row["base_minor_faults"] >= 0
    assert row["tree_computed_per_nonempty"] == 1.0  # the xla schedule does no extra blocks
    # utilization: model FLOPs of what each mode needs, MFU against the same rounds' matmul
    assert row["tree_model_flops"] < row["base_model_flops"]
    assert row["tree_mfu"] > 0 and row["base_mfu"] > 0 and row["matmul_flops_per_s"] > 0
    assert row["tree_mfu_peak"] is None  # a CPU has no datasheet peak
    assert len(row["matmul_times_s"]) == 1
    bench.write(tmp_path, "test machine", rows, 1.0)
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert [r["workload"] for r in saved["rows"]] == [r["workload"] for r in rows]
    table = (tmp_path / "bench.md").read_text()
    assert table.count("\n| tiny/synthetic") == 1 and "| tree MFU |" in table
    assert (tmp_path / "bench.png").stat().st_size > 1000


def test_auto_check_compares_the_kernels_in_the_same_rounds():
    """--check-auto's verdict: the faster kernel by the median same-round ratio, and parity
    when the rounds' interval holds 1."""
    from jtree.launch.bench.harness import Timings

    def timings(cpu: list[float], xla: list[float]) -> Timings:
        return Timings({"tree": cpu, "tree xla": xla}, {}, {}, {}, {})

    names = {"cpu": "tree", "xla": "tree xla"}
    slow_cpu = bench.auto_check(timings([2.0, 2.1, 2.2], [1.0, 1.0, 1.0]), "cpu", names)
    assert slow_cpu["cpu_over_xla"] == pytest.approx(2.1)
    assert slow_cpu["faster_attention"] == "xla" and not slow_cpu["auto_attention_is_faster"]
    assert slow_cpu["attention_verdict"] == "xla faster"
    mixed = bench.auto_check(timings([0.9, 1.1, 0.95, 1.05], [1.0] * 4), "xla", names)
    assert mixed["attention_verdict"] == "parity"


def test_op_profile_sums_xla_thunks_by_kind():
    import jax
    import jax.numpy as jnp

    from jtree.launch.bench.split import op_profile

    x = jnp.ones((256, 256))
    f = jax.jit(lambda a: jnp.tanh(a @ a) + 1.0)
    jax.block_until_ready(f(x))
    kinds = op_profile(lambda: f(x), repeats=2)
    assert kinds and all(s > 0 and n > 0 for s, n in kinds.values())
    assert not any(k == "while" or "::" in k for k in kinds)
    assert all(not k[-1].isdigit() or "." not in k for k in kinds)  # numbered fusions merged


def test_peer_bench_smoke(tmp_path):
    """bench_peer --quick --ceiling: jtree and transformers train the same paths from the same
    weights with the same loss (equal first-step losses), and the outputs hold the speedup, the
    MFU and each half's MFU."""
    pytest.importorskip("transformers")
    from jtree.launch.bench import peer as bench_peer

    assert bench_peer.main(["--quick", "--repeats", "1", "--ceiling", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench_peer.json").read_text())["result"]
    assert set(result["impls"]) == {"cpu", "xla"} and result["auto_attention"] in result["impls"]
    for impl in result["impls"].values():
        assert impl["loss_first"] == pytest.approx(result["peer_loss_first"], rel=1e-5)
        assert impl["speedup_vs_peer"] > 0 and impl["mfu"] > 0
        assert impl["speedup_over_token_bound"] == pytest.approx(
            impl["speedup_vs_peer"] / result["token_bound"])
    assert result["peer_tokens"] == result["n_flat_tokens"]
    # --ceiling: the step without attention and each kernel's attention alone, with their MFU
    assert set(result["ceiling"]) == {"tree, attention stubbed", "attention cpu", "attention xla"}
    assert all(p["mfu"] > 0 and p["model_flops"] > 0 for p in result["ceiling"].values())
    assert "| speedup / token bound |" in (tmp_path / "bench_peer.md").read_text()
