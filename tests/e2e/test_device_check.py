"""`python -m jtree.launch.device_check` (the first script to run on a GPU/TPU) on this CPU host:
`--quick` runs every section end to end with the Pallas kernels in their interpreters and says
so; a kernel whose output is wrong is reported as a failed check and makes the exit code 1."""

import importlib
import json
import subprocess
import sys

import pytest

from jtree.launch import device_check, device_numerics, device_report

dispatch = importlib.import_module("jtree.kernels.tree_attention")  # the module, not the function


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_quick_check_runs_every_section_on_cpu(tmp_path):
    """Its own process, as on a device (the Mosaic GPU interpreter runs in a child of it)."""
    proc = subprocess.run([sys.executable, "-m", "jtree.launch.device_check", "--quick", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "device_check.json").read_text())
    assert data["platform"] == "cpu" and data["failures"] == []
    sections = data["sections"]
    assert set(sections) == set(device_check.SECTIONS)
    assert not [name for name, s in sections.items() if "error" in s]
    rows = sections["numerics"]["rows"]
    execution = {r["impl"]: r["execution"] for r in rows if "impl" in r}
    assert execution == {"xla": "native", "cpu": "native", "pallas_triton": "interpreted",
                         "pallas_tpu": "interpreted", "pallas_mosaic_gpu": "interpreted"}
    # One case per kernel with --quick; the Mosaic GPU interpreter is skipped (minutes per case).
    assert len(rows) == 9 and all(r["passed"] for r in rows if "skipped" not in r)
    (skipped,) = [r for r in rows if r["passed"] is None]
    assert skipped["impl"] == "pallas_mosaic_gpu" and "skipped" in skipped
    assert {r["check"] for r in rows} >= {"gdn sequential scan", "gdn parallel scan",
                                          "qwen3 step vs CPU backend",
                                          "qwen3_next step vs CPU backend"}
    memory = sections["memory"]
    assert memory["predicted_bytes"] > 0 and "step_error" not in memory  # the step ran
    assert memory["peak_bytes_in_use"] is None and "no peak on cpu" in memory["peak_note"]
    speed = sections["speed"]
    assert speed["train_step"]["auto_mode"] in ("tree", "baseline")
    assert speed["train_step"]["tree"]["mfu"] == "unknown"  # no datasheet peak for a CPU
    assert speed["gdn"]["sequential_ms"] > 0 and speed["gdn"]["parallel_ms"] > 0
    (attention,) = speed["attention"]
    assert attention["failed"] == {} and attention["tokamax"] == "not installed"
    assert attention["tree_step_ms"] > 0 and attention["dense_xla_step_ms"] > 0
    md = (tmp_path / "device_check.md").read_text()
    assert ("interpreted (not native): numerics: attention pallas_tpu float32 prefix+softcap, "
            "numerics: attention pallas_triton float32 prefix+softcap") in md
    assert "all numerics passed" in md


def test_a_wrong_kernel_output_fails_the_check(tmp_path, monkeypatch):
    """The `xla` kernel's output 1% too large (its gradients follow it): every xla row fails,
    each names its error, and the exit code is 1."""
    entry = dispatch._IMPLS["xla"]
    wrong = lambda *args, **kwargs: 1.01 * entry.run(*args, **kwargs)  # noqa: E731
    monkeypatch.setitem(dispatch._IMPLS, "xla", entry._replace(run=wrong))
    code = device_check.main(["--quick", "--sections", "numerics", "--impls", "xla", "--out",
                              str(tmp_path)])
    assert code == 1
    data = json.loads((tmp_path / "device_check.json").read_text())
    rows = data["sections"]["numerics"]["rows"]
    assert rows and not any(r["passed"] for r in rows)
    assert all(0.005 < r["worst"] < 0.05 for r in rows)  # the 1% error is what was measured
    assert data["failures"] == [r["check"] for r in rows]
    md = (tmp_path / "device_check.md").read_text()
    assert "FAILED: attention xla float32 prefix+softcap" in md


def test_the_mla_row_checks_the_value_head_dim(monkeypatch):
    """The MLA row (q/k head dim 192, v 128, a cached prefix) that `mosaic_gpu_blackwell` gets
    on a Blackwell GPU, run here on `xla` alone: it passes, and a kernel that reads only v's
    first 64 columns fails it."""
    assert device_numerics.attention_cases("mosaic_gpu_blackwell")[0] == device_numerics.MLA
    assert device_numerics.MLA not in device_numerics.attention_cases("pallas_triton")
    monkeypatch.setattr(device_numerics, "MLA_IMPLS", ("xla",))
    monkeypatch.setattr(device_numerics, "CASES", ())
    (row,) = device_numerics.attention_numerics("cpu", "cpu", ["xla"], quick=True)
    assert row["check"] == "attention xla float32 mla+prefix" and row["passed"], row
    entry = dispatch._IMPLS["xla"]
    def half_v(q, k, v, *args, **kwargs):
        return entry.run(q, k, v.at[..., 64:].set(0), *args, **kwargs)

    monkeypatch.setitem(dispatch._IMPLS, "xla", entry._replace(run=half_v))
    (row,) = device_numerics.attention_numerics("cpu", "cpu", ["xla"], quick=True)
    assert not row["passed"] and row["errors"]["out"]["max_scaled"] > 0.1, row


def test_errors_scale_by_the_largest_reference_value():
    got, want = [[1.0, 2.02, 0.0]], [[1.0, 2.0, 0.001]]
    errs = device_numerics.errors(got, want)["out"]
    assert errs["max_scaled"] == pytest.approx(0.01)
    assert errs["max_elementwise_rel"] == pytest.approx(0.01)  # 0.001 is below 1% of the max


def test_peak_flops_by_device_kind():
    assert device_report.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert device_report.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert device_report.peak_flops("TPU v5 lite") == 197e12
    assert device_report.peak_flops("cpu") is None


def test_each_device_checks_the_kernels_it_runs_natively():
    hopper = device_numerics.impl_dtypes("gpu", "NVIDIA H100 80GB HBM3")
    assert hopper == {"xla": device_numerics.DTYPES, "pallas_triton": device_numerics.DTYPES,
                      "triton_lang": device_numerics.DTYPES,
                      "pallas_mosaic_gpu": ("bfloat16", "float16")}
    # auto's kernel there (triton_lang), and Pallas' Triton kernel for what it still serves
    assert set(device_numerics.impl_dtypes("gpu", "NVIDIA A100-SXM4-80GB")) == {
        "xla", "pallas_triton", "triton_lang"}
    assert device_report.execution("triton_lang", "gpu") == "native"
    blackwell = device_numerics.impl_dtypes("gpu", "NVIDIA B200")
    assert blackwell == {"xla": device_numerics.DTYPES, "pallas_triton": device_numerics.DTYPES,
                         "triton_lang": device_numerics.DTYPES,
                         "mosaic_gpu_blackwell": ("bfloat16", "float16")}
    assert device_report.execution("mosaic_gpu_blackwell", "gpu") == "native"
    # and at MLA's head dims (q/k 192, v 128) there, before the other cases
    assert device_numerics.attention_cases("mosaic_gpu_blackwell")[0].dims == (192, 128)
    assert device_numerics.impl_dtypes("tpu", "TPU v5 lite") == {
        "xla": ("float32", "bfloat16"), "pallas_tpu": ("float32", "bfloat16")}
    assert device_report.execution("pallas_triton", "gpu") == "native"
    assert device_report.execution("pallas_triton", "cpu") == "interpreted"
    assert device_report.execution("xla", "tpu") == "native"
