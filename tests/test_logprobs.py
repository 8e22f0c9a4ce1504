import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtree.linearize import linearize
from jtree.logprobs import logprobs_from_hidden
from jtree.tree import TrajectoryTree
from tests.models_util import logprob_fn, tiny_model


@pytest.mark.parametrize("chunk", [1, 7, 64, 4096])
def test_matches_dense_log_softmax(chunk):
    rng = np.random.default_rng(0)
    rows, s, d, v = 2, 9, 16, 50
    h = jnp.asarray(rng.normal(size=(rows, s, d)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(d, v)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, v, (rows, s)), jnp.int32)
    pred = jnp.asarray(rng.integers(-1, s, (rows, s)), jnp.int32)
    logp, ent = logprobs_from_hidden(h, w, tokens, pred, chunk=chunk, with_entropy=True)
    full = jax.nn.log_softmax(jnp.einsum("rsd,dv->rsv", h, w), axis=-1)
    scoring = full[jnp.arange(rows)[:, None], jnp.maximum(pred, 0)]  # [rows, s, v] at pred rows
    want = jnp.where(pred >= 0, jnp.take_along_axis(scoring, tokens[..., None], -1)[..., 0], 0.0)
    want_ent = jnp.where(pred >= 0, -jnp.sum(jnp.exp(scoring) * scoring, -1), 0.0)
    np.testing.assert_allclose(logp, want, atol=2e-5)
    np.testing.assert_allclose(ent, want_ent, atol=2e-5)


def test_child_first_token_scored_from_parent_last_row():
    """Tree [5, 6] -> {[7, 8], [9]}: token 9 must be scored by the row of 6, not of 8.

    Compared against each path run alone as a plain sequence; scoring from the DFS neighbour (the
    previous row, token 8) would give a different value and fail.
    """
    graphdef, params = tiny_model(seed=3)
    fn = logprob_fn(graphdef)
    tree = TrajectoryTree.from_sequences([[5, 6, 7, 8], [5, 6, 9]])
    batch = linearize([tree], 8)
    assert batch.tokens[0, :5].tolist() == [5, 6, 7, 8, 9]
    assert batch.pred[0, :5].tolist() == [-1, 0, 1, 2, 1]
    lp = np.asarray(fn(params, batch.arrays()))
    alone = linearize([TrajectoryTree.from_sequences([[5, 6, 9]])], 8)
    lp_alone = np.asarray(fn(params, alone.arrays()))
    assert lp[0, 4] == pytest.approx(lp_alone[0, 2], abs=1e-6)
    wrong = dict(batch.arrays(), pred=np.array([[-1, 0, 1, 2, 3, -1, -1, -1]], np.int32))
    lp_wrong = np.asarray(fn(params, wrong))
    assert abs(lp_wrong[0, 4] - lp_alone[0, 2]) > 1e-3


def test_packing_and_padding_do_not_leak():
    graphdef, params = tiny_model(seed=4)
    fn = logprob_fn(graphdef)
    a = TrajectoryTree.from_sequences([[1, 2, 3, 4], [1, 2, 5]])
    b = TrajectoryTree.from_sequences([[7, 8, 9]])
    alone = np.asarray(fn(params, linearize([a], 16).arrays()))[0, :5]
    packed_batch = linearize([b, a], 16)
    off = packed_batch.layout.offsets[1]
    packed = np.asarray(fn(params, packed_batch.arrays()))[0, off : off + 5]
    np.testing.assert_allclose(packed, alone, atol=1e-6)
