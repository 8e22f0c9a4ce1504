"""Model FLOP utilization: the model-FLOP convention, the datasheet table, the per-round MFU and a
run's utilization from its step records (logic and structure; no timing asserted)."""

import numpy as np
import pytest

from jtree.config.architectures import Qwen3Config
from jtree.layout.flop_model import FlopModel, Work
from jtree.training.utilization import (
    MatmulShape,
    Utilization,
    datasheet_peak,
    dominant_shape,
    mfu_from_rounds,
    model_flops,
    run_utilization,
)

CFG = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def test_model_flops_are_three_passes_of_the_forward():
    fm = FlopModel.for_config(CFG)
    d, q, kv, f = 64, 64, 32, 192
    per_token_fwd = 2 * CFG.num_hidden_layers * (d * q + 2 * d * kv + q * d + 3 * d * f)
    per_pair_fwd = CFG.num_hidden_layers * 4 * q
    per_scored_fwd = 2 * d * CFG.vocab_size
    work = Work(tokens=100, pairs=3000, scored=40)
    expected = 3 * (per_token_fwd * 100 + per_pair_fwd * 3000 + per_scored_fwd * 40)
    assert model_flops(fm, work) == pytest.approx(expected)
    assert model_flops(fm, work) < fm.flops(work)  # no recomputation counted


def test_datasheet_peaks_by_device_kind():
    assert datasheet_peak("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    assert datasheet_peak("NVIDIA H100 PCIe", "bfloat16") == 756e12
    assert datasheet_peak("NVIDIA H200", "float32") == 67e12
    assert datasheet_peak("TPU v5 lite", "bfloat16") == 197e12
    assert datasheet_peak("TPU v5p", "bfloat16") == 459e12
    assert datasheet_peak("TPU v6 lite", "bfloat16") == 918e12
    assert datasheet_peak("TPU v6 lite", "float32") is None
    assert datasheet_peak("cpu", "float32") is None


def test_mfu_is_the_median_of_same_round_ratios():
    shape = MatmulShape(100, 10, 50)  # 1e5 FLOPs
    steps = np.array([1.0, 2.0, 4.0])
    # the same load slows both sides of a round: MFU 0.5 in every round
    assert mfu_from_rounds(5e9, steps, shape, steps * 1e-5) == pytest.approx(0.5)
    # rounds of 0.5, 0.25, 0.125: the median
    assert mfu_from_rounds(5e9, steps, shape, np.full(3, 1e-5)) == pytest.approx(0.25)
    u = Utilization(4e9, 1.0, 8e9, shape, 16e9)
    assert (u.achieved, u.mfu, u.mfu_peak) == (4e9, 0.5, 0.25)
    assert "MFU 50.0%" in u.describe() and "25.0% of the datasheet peak" in u.describe()
    assert set(u.as_dict()) >= {"model_flops", "achieved_flops_per_s", "mfu", "mfu_peak"}


def test_dominant_shape_caps_the_tokens():
    assert dominant_shape(1000, CFG) == MatmulShape(1000, 64, 192)
    assert dominant_shape(10**6, CFG).m == 16384


def test_run_utilization_reads_the_steps_that_did_not_compile():
    record = {"compiles": 0, "device_s": 0.01, "n_computed_tokens": 256,
              "n_computed_pairs": 256 * 64, "n_scored_tokens": 100}
    history = [dict(record, compiles=3, device_s=100.0), record, record]
    u = run_utilization(CFG, history, n_devices=1)
    work = Work(256, 256 * 64, 100)
    assert u.model_flops == pytest.approx(model_flops(FlopModel.for_config(CFG), work))
    assert u.step_s == pytest.approx(0.01)  # the compiling step is left out
    assert u.matmul == MatmulShape(256, 64, 192) and u.matmul_flops_per_s > 0
    assert run_utilization(CFG, [{"compiles": 0, "device_s": 1.0}]) is None  # no work counts
