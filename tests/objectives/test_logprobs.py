import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtree.layout.linearize import linearize
from jtree.objectives.logprobs import _chunked, logprobs_from_hidden, scored_logprobs
from jtree.trees.tree import TrajectoryTree
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
    assert batch.inputs.tokens[0, :5].tolist() == [5, 6, 7, 8, 9]
    assert batch.inputs.pred[0, :5].tolist() == [-1, 0, 1, 2, 1]
    lp = np.asarray(fn(params, batch.inputs))
    alone = linearize([TrajectoryTree.from_sequences([[5, 6, 9]])], 8)
    lp_alone = np.asarray(fn(params, alone.inputs))
    assert lp[0, 4] == pytest.approx(lp_alone[0, 2], abs=1e-6)
    wrong = dataclasses.replace(batch.inputs,
                                pred=np.array([[-1, 0, 1, 2, 3, -1, -1, -1]], np.int32))
    lp_wrong = np.asarray(fn(params, wrong))
    assert abs(lp_wrong[0, 4] - lp_alone[0, 2]) > 1e-3


def test_packing_and_padding_do_not_leak():
    graphdef, params = tiny_model(seed=4)
    fn = logprob_fn(graphdef)
    a = TrajectoryTree.from_sequences([[1, 2, 3, 4], [1, 2, 5]])
    b = TrajectoryTree.from_sequences([[7, 8, 9]])
    alone = np.asarray(fn(params, linearize([a], 16).inputs))[0, :5]
    packed_batch = linearize([b, a], 16)
    off = packed_batch.layout.offsets[1]
    packed = np.asarray(fn(params, packed_batch.inputs))[0, off : off + 5]
    np.testing.assert_allclose(packed, alone, atol=1e-6)


def _scored_case(seed=0):
    rng = np.random.default_rng(seed)
    rows, s, d, v = 2, 12, 8, 30
    h = jnp.asarray(rng.normal(size=(rows, s, d)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(d, v)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, v, (rows, s)), jnp.int32)
    pred = jnp.asarray(rng.integers(-1, s, (rows, s)), jnp.int32)
    index = np.full((rows, 7), -1, np.int32)
    index[0, :5] = [0, 2, 3, 7, 11]
    index[1, :3] = [1, 4, 9]
    return h, w, tokens, pred, jnp.asarray(index)


@pytest.mark.parametrize("chunk", [1, 4, 1024])
def test_scored_logprobs_equal_all_token_logprobs_at_the_scored_positions(chunk):
    h, w, tokens, pred, index = _scored_case()
    full, full_ent = logprobs_from_hidden(h, w, tokens, pred, with_entropy=True)
    got, ent = scored_logprobs(h, w, tokens, pred, index, chunk=chunk, with_entropy=True)
    at = jnp.maximum(index, 0)
    want = jnp.where(index >= 0, jnp.take_along_axis(full, at, axis=1), 0.0)
    want_ent = jnp.where(index >= 0, jnp.take_along_axis(full_ent, at, axis=1), 0.0)
    np.testing.assert_allclose(got, want, atol=2e-5)
    np.testing.assert_allclose(ent, want_ent, atol=2e-5)
    assert np.all(np.asarray(got)[np.asarray(index) < 0] == 0)

    # Gradients of a weighted sum agree with the all-token path (hidden and output embedding).
    weights = jnp.asarray(np.random.default_rng(1).uniform(size=tokens.shape), jnp.float32)

    def full_loss(h, w):
        return jnp.sum(weights * logprobs_from_hidden(h, w, tokens, pred)[0] *
                       (jnp.zeros(tokens.shape).at[jnp.arange(2)[:, None], at].max(
                           (index >= 0).astype(jnp.float32))))

    def scored_loss(h, w):
        wt = jnp.where(index >= 0, jnp.take_along_axis(weights, at, axis=1), 0.0)
        return jnp.sum(wt * scored_logprobs(h, w, tokens, pred, index, chunk=chunk)[0])

    for a, b in zip(jax.grad(full_loss, (0, 1))(h, w), jax.grad(scored_loss, (0, 1))(h, w)):
        np.testing.assert_allclose(a, b, atol=2e-5)


def test_vocab_parallel_scored_logprobs_match_single_device():
    """Vocab split over a 'model' axis of 1 device still runs the psum/pmax code path."""
    h, w, tokens, pred, index = _scored_case(2)
    mesh = jax.make_mesh((1,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    P = jax.sharding.PartitionSpec

    def local(h, w, tokens, pred, index):
        return scored_logprobs(h, w, tokens, pred, index, chunk=5, vocab_axis="model")[0]

    got = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(None, "model"), P(), P(), P()),
                        out_specs=P(), check_vma=False)(h, w, tokens, pred, index)
    want = scored_logprobs(h, w, tokens, pred, index, chunk=5)[0]
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_score_index_lists_exactly_the_tokens_with_a_loss_coefficient():
    tree = TrajectoryTree.from_sequences([[5, 6, 7, 8], [5, 6, 9]],
                                         loss_masks=[[0, 0, 1, 1], [0, 1, 1]])
    batch = linearize([tree, TrajectoryTree.from_sequences([[3, 4]], loss_masks=[[0, 0]])], 8)
    for r in range(batch.shape[0]):
        listed = batch.inputs.score_index[r][batch.inputs.score_index[r] >= 0]
        assert listed.tolist() == np.flatnonzero(batch.inputs.coefficients.weight[r] != 0).tolist()
    assert batch.inputs.score_index.shape[1] == 8  # aligned to 64, capped at S
    with pytest.raises(ValueError, match="score_len=2: a row has 4 scored tokens"):
        linearize([tree], 8, score_len=2)
    wide = linearize([tree], 8, score_len=12)
    assert wide.inputs.score_index.shape == (1, 12) and (wide.inputs.score_index >= 0).sum() == 4


@pytest.mark.parametrize("n,chunk", [(1408, 1024), (832, 1024), (2049, 1024), (7, 4), (100, 7),
                                     (5, 64), (1, 1), (4097, 1024)])
def test_chunks_are_balanced_and_bounded(n, chunk):
    """The fewest chunks of at most `chunk` rows, all of one size, at most 8 padded rows each
    (1408 rows in chunks of 1024 used to compute 2048), rows kept in order."""
    x = jnp.arange(n, dtype=jnp.float32)[:, None] + 1
    out = _chunked(x, chunk)
    n_chunks, size = out.shape[:2]
    assert size <= chunk and n_chunks == -(-n // min(chunk, n))
    assert n_chunks * size - n <= 8 * n_chunks
    np.testing.assert_array_equal(out.reshape(-1, 1)[:n], x)
    assert not np.asarray(out.reshape(-1)[n:]).any()


@pytest.mark.parametrize("chunk", [4, 1024])
def test_logprobs_at_a_temperature_are_those_of_the_tempered_logits(chunk):
    """At temperature T every path (all tokens, scored tokens, the vocabulary split over a
    'model' axis) gives log_softmax(h @ w / T) of the scoring row and the entropy of that
    softmax, formed here from the logits."""
    t = 0.7
    h, w, tokens, pred, index = _scored_case(3)
    logp = jax.nn.log_softmax(jnp.einsum("rsd,dv->rsv", h, w) / t, axis=-1)
    src = jnp.maximum(pred, 0)
    row_logp = jnp.take_along_axis(logp, src[..., None], axis=1)
    want = jnp.where(pred >= 0, jnp.take_along_axis(row_logp, tokens[..., None], axis=2)[..., 0],
                     0.0)
    want_ent = jnp.where(pred >= 0, -jnp.sum(jnp.exp(row_logp) * row_logp, axis=-1), 0.0)
    got, ent = logprobs_from_hidden(h, w, tokens, pred, chunk=chunk, with_entropy=True,
                                    temperature=t)
    np.testing.assert_allclose(got, want, atol=2e-5)
    np.testing.assert_allclose(ent, want_ent, atol=2e-5)

    at = jnp.maximum(index, 0)
    want_scored = jnp.where(index >= 0, jnp.take_along_axis(want, at, axis=1), 0.0)
    scored, _ = scored_logprobs(h, w, tokens, pred, index, chunk=chunk, temperature=t)
    np.testing.assert_allclose(scored, want_scored, atol=2e-5)

    mesh = jax.make_mesh((1,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    P = jax.sharding.PartitionSpec

    def local(h, w, tokens, pred, index):
        return (logprobs_from_hidden(h, w, tokens, pred, chunk=chunk, vocab_axis="model",
                                     temperature=t)[0],
                scored_logprobs(h, w, tokens, pred, index, chunk=chunk, vocab_axis="model",
                                temperature=t)[0])

    split_all, split_scored = jax.shard_map(
        local, mesh=mesh, in_specs=(P(), P(None, "model"), P(), P(), P()), out_specs=P(),
        check_vma=False)(h, w, tokens, pred, index)
    np.testing.assert_allclose(split_all, want, atol=2e-5)
    np.testing.assert_allclose(split_scored, want_scored, atol=2e-5)
