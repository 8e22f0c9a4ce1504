"""GDN chunk tables: replaying the routing on token lists must give every token its path."""

import numpy as np
import pytest
from hypothesis import given, settings

from jtree.layout.gdn_tables import default_chunk_count
from jtree.layout.linearize import linearize
from jtree.trees.tree import TrajectoryTree
from tests.strategies import forests


def _replay_paths(batch):
    """Simulate the chunk scan with 'states' that are the token lists read so far."""
    gdn = batch.inputs.gdn
    tokens, src, slot = gdn.chunk_tokens, gdn.chunk_src, gdn.token_slot
    rows, nc, c = tokens.shape
    seen = {}
    for r in range(rows):
        buf = [[] for _ in range(nc + 1)]
        for k in range(nc):
            assert 0 <= src[r, k] <= k  # the entering state is always ready
            state = list(buf[src[r, k]])
            for j in range(c):
                t = int(tokens[r, k, j])
                if t < 0:
                    assert np.all(tokens[r, k, j:] < 0)  # empty slots only at a chunk's end
                    break
                state.append(t)
                seen[(r, t)] = list(state)
                assert slot[r, t] == k * c + j
            buf[k + 1] = state
    return seen


@pytest.mark.parametrize("chunk", [1, 2, 3, 64])
@settings(max_examples=15)
@given(trees=forests(n_trees=(1, 5), max_nodes=9, max_seg=7))  # a tree fits a row: 9 * 7 <= 64
def test_routing_gives_every_token_its_path(trees, chunk):
    batch = linearize(trees, 64, gdn_chunk_size=chunk)
    seen = _replay_paths(batch)
    assert len(seen) == int(batch.inputs.valid.sum())
    assert np.all(batch.inputs.gdn.token_slot[~batch.inputs.valid] == -1)
    for t, r, off in zip(batch.layout.trees, batch.layout.rows, batch.layout.offsets):
        for p in range(t.n_paths):
            idx = (t.path_token_index(p) + off).tolist()
            assert seen[(int(r), idx[-1])] == idx
            counts = batch.inputs.path_count[r, idx]
            assert np.all(counts >= 1)
    # path_count: how often each tree token appears in the flat per-path data.
    total_flat = sum(int(t.path_lengths.sum()) for t in trees)
    assert int(batch.inputs.path_count.sum()) == total_flat


def test_chunk_capacity_is_bucketed_and_checked():
    tree = TrajectoryTree.from_nodes([-1, 0, 0, 1], [[1] * 5, [2] * 3, [3], [4] * 4])
    batch = linearize([tree], 16, gdn_chunk_size=2)
    # Node chunks: 3 + 2 + 1 + 2 = 8 -> capacity 8 (= ceil(16 / 2), in steps of 8 // 4 = 2).
    assert batch.inputs.gdn.chunk_tokens.shape == (1, 8, 2)
    assert default_chunk_count(16, 2, 9) == 10
    assert default_chunk_count(4096, 64, 70) == 80
    with pytest.raises(ValueError, match="gdn_chunks=4: row 0 needs 8 chunks"):
        linearize([tree], 16, gdn_chunk_size=2, gdn_chunks=4)
    with pytest.raises(ValueError, match="gdn_chunk_size"):
        linearize([tree], 16, gdn_chunk_size=0)
    with pytest.raises(ValueError, match="gdn_chunks: given without"):
        linearize([tree], 16, gdn_chunks=8)
    plain = linearize([tree], 16)  # dense models need no chunk tables
    assert plain.inputs.gdn is None
