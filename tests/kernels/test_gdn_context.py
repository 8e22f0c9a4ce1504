"""Gated DeltaNet and its path conv1d under context parallelism (`jtree.kernels.gdn.context`)
equal the single-device kernels on the same trees, forward and gradients, on rows spread with gaps
over 2, 4 and 8 forced host devices; and so does the Qwen3-Next GatedDeltaNet layer with
`RuntimeConfig.context_axis` (output, input and parameter gradients). Float32, both sides summing
in their own orders: each context-parallel result is held to the error model of
`tests.models_util.rounding_bound` against the single-device kernels in float64, and gap tokens
hold exact zeros. Real bugs stay far past it (measured once, each undone, on `two_back:4`): the
conv halo dropped puts the conv loss 0.56 off float64 (1.2e5 times its bound), the states
entering from other devices zeroed or their cotangent's sign flipped put the gradient of g 0.3
off (2.8e4 times), and the layer 0.18 to 0.36 off.

The meshes run in a subprocess (`tests/gdn_context_worker.py`): the device count is fixed when
jax starts. The default runs one case (a node whose parent is three devices back, on 4 devices);
the sweep over every case and device count is `slow`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jtree.layout.context_gdn_tables import context_chunk_tables, conv_halo_positions

WORKTREE = Path(__file__).resolve().parents[2]


def _run(cases: list[str], timeout: int) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "tests.gdn_context_worker", *cases],
                          cwd=WORKTREE, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _check(result: dict) -> None:
    kinds = ("layer_",) if result["case"].startswith("layer_") else ("gdn_", "conv_")
    diffs = {k: v for k, v in result.items() if k.startswith(kinds)}
    # Kernels: loss, output, 5 input gradients, conv loss and 2 gradients; the layer: loss,
    # output, input gradient and its 7 parameters' gradients. (`diffs`: the direct differences to
    # the single-device float32 kernels, reported.)
    assert len(diffs) == 10
    worst = result["rounding"]
    assert all(w["excess"] <= 1.0 for w in worst.values()), (
        result["case"], result["devices"], worst, diffs)
    assert result["leak"] == 0.0, result


def test_node_two_devices_back_equals_single_device():
    (result,) = _run(["two_back:4"], timeout=300)
    assert result["parent_distance"] >= 2 and result["crossing_devices"] == 3
    _check(result)


@pytest.mark.slow
def test_kda_equals_single_device():
    """KDA's log decay per key channel (g [R, L, Hv, dk]: diagonal chunk maps) through the same
    exchange of maps: a parent three devices back on 4, random trees on 2, the chain crossing
    every boundary of 8. Slow (about 35 s per case); the per-channel maps themselves are in the
    default suite through the parallel scan (tests/kernels/test_kda.py)."""
    results = _run(["kda_two_back:4", "kda_random1:2", "kda_chain:8"], timeout=900)
    assert results[0]["parent_distance"] >= 2 and results[0]["crossing_devices"] == 3
    assert results[2]["crossing_devices"] == 7
    for r in results:
        _check(r)


CASES = ("two_back", "flat", "random0", "random1", "random2", "layer_two_back", "layer_random0")


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 4, 8])
def test_every_case_equals_single_device(devices):
    # The chain (which crosses every device boundary) on each device count, and the other cases
    # split over the device counts in turn: each meets one or two of them (the per-case kernel
    # work does not depend on the count; the boundaries the tables handle do, and the chain and
    # the random trees cross them on every count).
    index = [2, 4, 8].index(devices)
    names = ["chain", *CASES[index::3]]
    results = _run([f"{n}:{devices}" for n in names], timeout=1200)
    assert [r["case"] for r in results] == names
    for r in results:
        _check(r)
    chain = results[0]
    assert chain["crossing_devices"] == devices - 1  # the chain crosses every boundary


def test_tables_keep_chunks_on_one_device_and_list_crossings():
    """A node cut by a slice boundary continues in a chunk of the next device that enters from
    the piece before it; the exported chunk and the conv halo list what the next device reads."""
    # Device slices of 4: node 0 = tokens 0..5 (cut at 4), node 1 (child of 0) = 6..7.
    node = np.array([[0, 0, 0, 0, 0, 0, 1, 1]])
    pred = np.array([[-1, 0, 1, 2, 3, 4, 5, 6]])
    t = context_chunk_tables(node, pred, context=2, chunk_size=3)
    ncl = t.chunk_src.shape[1] // 2
    assert ncl == 2
    # Device 0: chunks [0,1,2], [3]; device 1: [4,5], [6,7].
    assert t.chunk_tokens[0, :2].tolist() == [[0, 1, 2], [3, -1, -1]]
    assert t.chunk_tokens[0, 2:].tolist() == [[4, 5, -1], [6, 7, -1]]
    assert t.chunk_src[0].tolist() == [0, 1, 2, 3]  # chunk 2 (device 1) enters after chunk 1
    assert t.context_exports[0].tolist() == [1, 1]  # device 0 exports chunk 1; device 1 none
    assert t.token_slot[0].tolist() == [0, 1, 2, 3, 6, 7, 9, 10]
    halo = conv_halo_positions(pred, context=2, width=2)
    assert halo[0].tolist() == [2, 3, 3, 3]  # tokens 4, 5 read 2, 3 on device 0


def test_tables_name_the_capacity_and_the_split():
    node = np.zeros((1, 8), np.int64)
    pred = np.arange(8)[None] - 1
    with pytest.raises(ValueError, match="mesh.context=3 does not divide"):
        context_chunk_tables(node, pred, context=3, chunk_size=2)
    with pytest.raises(ValueError, match="gdn_chunks: 1 chunks per device"):
        context_chunk_tables(node, pred, context=2, chunk_size=2, n_chunks=1)
    with pytest.raises(ValueError, match="conv halo: capacity 1"):
        conv_halo_positions(pred, context=2, width=2, capacity=1)
