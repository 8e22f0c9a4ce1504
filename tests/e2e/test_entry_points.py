"""Every entry point under `launch/` and every `jtree` subcommand prints a usage line for `--help`,
and every bench (and the sample-data script) runs at its smallest sizes and writes its outputs
(`OUT/NAME.json|md|png`, `jtree.launch.bench.harness`). Numbers are not checked: timings are benchmarks,
not tests.

Run elsewhere at their smallest sizes: `launch/train.py` (tests/e2e/test_launch_train.py),
`launch/device_check.py` (tests/e2e/test_device_check.py),
`launch/lower_step.py` (tests/e2e/test_lower.py), `jtree stats` (tests/e2e/test_cli.py),
`jtree compare-torch` (tests/hf/test_hf_torch.py), `jtree export-hf` (tests/hf/test_export_hf.py),
`mgpu_interpret IN OUT` (tests/kernels/test_attention_mgpu.py).

Benches run in this process with `--host-malloc default` (keeping freed memory would change
malloc for every later test of the worker).
"""

import importlib
import json
import subprocess
import sys

import pytest

from jtree.cli import main as jtree_main

# Modules under jtree.launch; the benches' output files are named `bench` (the step bench) and
# `bench_NAME` (module bench.NAME).
LAUNCH = ("bench.step", "bench.attention", "bench.attention_gpu", "bench.context",
          "bench.cross_group", "bench.gdn", "bench.partition", "bench.peer",
          "bench.redundancy_free", "bench.split", "bench.window",
          "device_check", "make_sample_data", "lower_step", "memory_plan", "train")
SUBCOMMANDS = ("stats", "compare-torch", "export-hf")


def _module(output: str) -> str:
    """The module under jtree.launch that writes `output`.json."""
    return "bench.step" if output == "bench" else output.replace("bench_", "bench.", 1)


@pytest.mark.parametrize("module", LAUNCH)
def test_launch_entry_point_prints_usage(module, capsys):
    main = importlib.import_module(f"jtree.launch.{module}").main
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("usage: ")


def test_mgpu_interpret_prints_usage():
    """Its own process, as it is always run (it sizes jax's CPU thread pool at import)."""
    proc = subprocess.run([sys.executable, "-m", "jtree.launch.bench.mgpu_interpret", "--help"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: ")


def test_mgpu_interpret_refuses_one_file():
    proc = subprocess.run([sys.executable, "-m", "jtree.launch.bench.mgpu_interpret", "in.npz"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "give IN.npz and OUT.npz, or neither" in proc.stderr


@pytest.mark.parametrize("command", [None, *SUBCOMMANDS])
def test_jtree_subcommand_prints_usage(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        jtree_main([command, "--help"] if command else ["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: jtree" + (f" {command}" if command else ""))


def _run(module: str, args: list[str], tmp_path) -> dict:
    """Run a bench's main on `args` with `--out tmp_path`; its JSON results."""
    main = importlib.import_module(f"jtree.launch.{_module(module)}").main
    assert main([*args, "--out", str(tmp_path)]) == 0
    assert (tmp_path / f"{module}.md").read_text().count("\n|") >= 2  # header + a row
    return json.loads((tmp_path / f"{module}.json").read_text())


def _png(tmp_path, module: str) -> None:
    assert (tmp_path / f"{module}.png").stat().st_size > 1000


def test_bench_quick(tmp_path):
    data = _run("bench", ["--quick", "--only", "POR 0.7", "--host-malloc", "default"], tmp_path)
    assert [r["workload"] for r in data["rows"]] == ["tiny/synthetic POR 0.7"]
    assert data["rows"][0]["repeats"] == 1
    _png(tmp_path, "bench")


def test_bench_context_quick(tmp_path):
    """Planning only: the balanced split is no worse than the even one, every device counted."""
    data = _run("bench_context", ["--quick", "--config", "configs/tiny.yaml", "--context", "4"],
                tmp_path)
    _png(tmp_path, "bench_context")
    assert data["context"] == 4 and len(data["devices"]) == 4
    assert data["worst_balanced_ratio"] <= data["worst_even_ratio"]
    for row in data["summary"]:
        assert sum(row["tokens"]) == row["tree_tokens"]


@pytest.mark.slow  # profiles two bench workloads (about 20 s)
def test_bench_split_quick(tmp_path):
    data = _run("bench_split", ["--quick", "--repeats", "1", "--host-malloc", "default"],
                tmp_path)
    (split,) = data["splits"].values()
    assert split["tree_step_s"] > 0 and split["baseline_step_s"] > 0
    assert split["tree_mfu"] > 0 and split["matmul_flops_per_s"] > 0


def test_bench_split_names_the_workloads_when_one_is_unknown():
    from jtree.launch.bench.split import split

    with pytest.raises(ValueError, match="no bench workload named 'nope'.*tiny/synthetic POR 0.3"):
        split("nope", 1, quick=True)


def test_bench_cross_group_smallest(tmp_path):
    """Two groups behind a 64-token system prompt, both fitting one row merged: the merged step
    computes the prompt once (the bench itself checks that the two losses agree)."""
    data = _run("bench_cross_group", ["--groups", "2", "--system-len", "64", "--rollouts", "2",
                                      "--seq-len", "2048", "--hidden", "32", "--layers", "1",
                                      "--repeats", "1", "--attention", "xla",
                                      "--host-malloc", "default"], tmp_path)
    (row,) = data["rows"]
    computed = row["computed_tokens"]
    assert computed["within_groups"] - computed["across_groups"] == row["merge_saved_tokens"] > 0
    assert row["por_across"] > row["por_within"]
    assert all(row["mfu"][v] > 0 for v in ("within_groups", "across_groups"))


def test_bench_attention_smallest(tmp_path):
    data = _run("bench_attention", ["--quick", "--seq-lens", "256", "--por", "0.6", "--repeats",
                                    "1", "--sweep-s", "0", "--reference-max-s", "256"], tmp_path)
    (case,) = data["cases"]
    assert case["S"] == 256 and {"xla_ms", "cpu_ms", "reference_ms"} <= case.keys()
    _png(tmp_path, "bench_attention")


@pytest.mark.slow
def test_bench_window_smallest_with_model_steps(tmp_path):
    # One layer and gpt-oss train steps on one tree of 512 tokens: the window's blocks are a
    # subset of full attention's, fewer once paths outgrow it; the steps' blocks add the layers'.
    data = _run("bench_window", ["--seq-len", "512", "--window", "16", "--impl", "xla",
                                 "--repeats", "1", "--model-window", "16"], tmp_path)
    full, windowed = data["rows"]
    assert (full["window"], windowed["window"]) == ("full", 16)
    assert windowed["blocks"] < full["blocks"] and windowed["max_depth"] > 16
    steps = {r["model"]: r for r in data["model_steps"]}
    assert steps["full"]["blocks_over_full"] == 1.0
    # two of the four layers slide: half the full model's blocks plus two windowed layers'
    assert 0.5 < steps["W 16"]["blocks_over_full"] < 1.0
    assert all(r["step_s"] > 0 for r in steps.values())


def test_bench_attention_gpu_without_a_gpu(tmp_path):
    """On CPU the GPU bench reports block efficiency only and says timings need a GPU."""
    data = _run("bench_attention_gpu", ["--seq-lens", "512", "--por", "0.6"], tmp_path)
    (case,) = data["cases"]
    assert not data["timed"] and "tree_fwd_ms" not in case
    assert 0 < case["tree_block_efficiency"] <= 1 and 0 < case["causal_block_efficiency"] <= 1
    assert "timings need a GPU" in (tmp_path / "bench_attention_gpu.md").read_text()


@pytest.mark.slow  # compiles four GDN layer steps (about 40 s)
def test_bench_gdn_quick(tmp_path):
    """The GDN layer returns (output, cache); the bench differentiates the output."""
    data = _run("bench_gdn", ["--quick"], tmp_path)
    (row,) = data["results"]
    assert row["tree_tokens"] < row["flat_tokens"]
    assert row["tree_sequential_ms"] > 0 and row["tree_parallel_ms"] > 0
    # The headline speedup is the tree with the scan `gdn_scan: auto` runs here (CPU).
    assert row["auto_scan"] == "sequential" and row["speedup"] == row["sequential_tree_speedup"]
    low, high = row["speedup_interval"]
    assert low - 0.005 <= row["speedup"] <= high + 0.005
    assert row["verdict"] in ("faster", "parity", "slower")
    assert len(row["control_interval"]) == 2
    _png(tmp_path, "bench_gdn")


def test_bench_partition_quick(tmp_path):
    data = _run("bench_partition", ["--quick"], tmp_path)
    assert len(data["scaling"]["rows"]) == 2 and data["quality"]
    _png(tmp_path, "bench_partition")


@pytest.mark.slow
def test_bench_redundancy_free_quick(tmp_path):
    data = _run("bench_redundancy_free", ["--quick", "--host-malloc", "default"], tmp_path)
    (case,) = data["cases"]
    assert case["n_computed"]["rfree"] == case["n_tree"]
    assert case["utilization"]["rfree_mfu"] > 0 and case["matmul_flops_per_s"] > 0
    assert "| MFU baseline/" in (tmp_path / "bench_redundancy_free.md").read_text()
    _png(tmp_path, "bench_redundancy_free")


@pytest.mark.slow
def test_mgpu_interpret_random_trees(tmp_path):
    # The table's path (the kernels' numerics are tests/kernels/test_attention_mgpu.py's): one
    # run, float16 with a cached prefix, within float16's rounding of the f32 reference.
    proc = subprocess.run([sys.executable, "-m", "jtree.launch.bench.mgpu_interpret", "--quick",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((tmp_path / "mgpu_interpret.json").read_text())["rows"]
    assert [(r["dtype"], r["prefix"], r["races"]) for r in rows] == [("float16", 60, False)]
    assert max(rows[0][name] for name in ("out", "dq", "dk", "dv")) < 2e-3, rows


def test_make_sample_data_smallest(tmp_path):
    from jtree.launch.make_sample_data import main
    from jtree.trees.jsonl import read_sequence_groups

    out = tmp_path / "groups.jsonl"
    assert main(["--groups", "1", "--out", str(out)]) == 0
    assert len(read_sequence_groups(out)) == 1


@pytest.mark.parametrize("module", ("jtree.launch.train", "jtree.launch.bench"))
def test_entry_points_run_from_any_directory(module, tmp_path):
    """`python -m` finds the installed package outside the checkout (kernels/ and launch/ are
    mapped into jtree by the install, not found beside it)."""
    proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: ")
