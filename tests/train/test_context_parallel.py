"""The host side of context parallelism (`jtree.context_parallel`) and what it refuses by name.

The equivalence of the context-parallel step with the single-device one runs on 8 forced host
devices in `tests/train/test_mesh.py` (mode `cp` of `tests/mesh_worker.py`)."""

import dataclasses

import numpy as np
import pytest
from flax import nnx

from jtree.batch import GdnTables
from jtree.context_parallel import (
    context_batch, context_mask, halo_capacity, halo_positions, score_layout,
)
from jtree.kernels import TreeMask
from jtree.linearize import linearize
from jtree.models.decoder import CausalLM
from tests.models_util import tiny_next_config, tiny_runtime
from tests.strategies import seeded_forests

# Two devices of 4 tokens: tokens 4 and 5 are scored by positions 3 and 0 of device 0, token 7
# by position 6 of its own device.
PRED = np.array([[-1, 0, 1, 2, 3, 0, -1, 6]], np.int32)


def test_the_halo_holds_the_positions_other_devices_are_scored_by():
    assert halo_capacity(PRED, 2) == 2
    assert halo_capacity(PRED, 1) == 1  # nothing crosses: at least one slot
    # device 0 exports 0 and 3; device 1 nothing (its slots repeat the last real position)
    np.testing.assert_array_equal(halo_positions(PRED, 2, 3), [[0, 3, 3, 3, 3, 3]])
    # with 4 devices of 2: token 2 reads 1 (device 0), 4 reads 3, 5 reads 0
    np.testing.assert_array_equal(halo_positions(PRED, 4, 2), [[0, 1, 3, 3, 3, 3, 3, 3]])
    with pytest.raises(ValueError, match=r"halo capacity 1: row 0, device 0 of mesh.context=2 "
                                         r"exports 2"):
        halo_positions(PRED, 2, 1)


def test_scored_positions_are_laid_out_per_device():
    index = np.array([[1, 3, 2, 7, -1]], np.int32)
    np.testing.assert_array_equal(score_layout(index, 8, 2, width=3), [[1, 2, 3, 7, -1, -1]])
    np.testing.assert_array_equal(score_layout(index, 8, 4, width=2),
                                  [[1, -1, 2, 3, -1, -1, 7, -1]])
    # by default on the score-width ladder, at most a device's tokens
    np.testing.assert_array_equal(score_layout(index, 8, 2), [[1, 2, 3, -1, 7, -1, -1, -1]])
    with pytest.raises(ValueError, match=r"score width 2: a device of mesh.context=2 scores 3"):
        score_layout(index, 8, 2, width=2)


def test_context_batch_names_what_it_cannot_split():
    batch = linearize(seeded_forests(3, max_nodes=5), 24, score_len=24).inputs
    laid = context_batch(batch, 4)
    assert halo_capacity(batch.pred, 4) <= 8 and laid.halo.shape == (batch.shape[0], 4 * 8)
    kept = np.sort(laid.score_index[laid.score_index >= 0])
    np.testing.assert_array_equal(kept, np.sort(batch.score_index[batch.score_index >= 0]))
    with pytest.raises(ValueError, match=r"mesh.context=5 does not divide the row length S=24"):
        context_batch(batch, 5)
    gdn = GdnTables(np.zeros((batch.shape[0], 1, 4), np.int32),
                    np.zeros((batch.shape[0], 1), np.int32), np.zeros(batch.shape, np.int32))
    with pytest.raises(ValueError, match=r"mesh.context=2: the batch has 'gdn'"):
        context_batch(dataclasses.replace(batch, gdn=gdn), 2)


def test_what_does_not_run_under_context_parallelism_is_refused_by_name():
    with pytest.raises(ValueError, match=r"^mesh.context > 1 with gated deltanet layers"):
        nnx.eval_shape(lambda: CausalLM(tiny_next_config(), tiny_runtime(context_axis="context"),
                                        rngs=nnx.Rngs(0)))
    prefixed = TreeMask(np.arange(1, 5, dtype=np.int32)[None], np.ones((1, 2), np.int32))
    with pytest.raises(ValueError, match=r"^mesh.context > 1 with a redundancy-free part"):
        context_mask(prefixed, "context")
