"""The device batch schema (`jtree.layout.batch`): padding, stacking, and errors naming the field."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtree.kernels import TreeMask, tree_attention
from jtree.kernels.attention.reference import tree_mask
from jtree.layout.batch import DeviceBatch, concatenate_rows, padding, stack
from jtree.layout.linearize import linearize
from jtree.objectives.losses import ppo_loss, sft_loss
from jtree.parallel.sharding import CONTEXT, ROWS, batch_specs
from jtree.trees.tree import TrajectoryTree


def _batch(**kw) -> DeviceBatch:
    trees = [TrajectoryTree.from_sequences([[1, 2, 3, 4], [1, 2, 5]]),
             TrajectoryTree.from_sequences([[7, 8, 9]])]
    return linearize(trees, 8, **kw).inputs


@pytest.mark.parametrize("prefix_len", [None, 3])
def test_padding_attends_only_to_itself_and_carries_no_weight(prefix_len):
    pad = padding(2, 8, score_len=4, gdn_chunk_size=4, gdn_chunks=3, prefix_len=prefix_len)
    p = prefix_len or 0
    assert pad.mask.prefix_len == p
    pad.mask.check()  # a valid mask: every key sees itself, nothing past the row
    end, q_pos = pad.mask.padded(8, p + 8)
    visible = np.asarray(tree_mask(jnp.asarray(end), None if q_pos is None else q_pos))
    want = np.eye(p + 8, dtype=bool)[p:]  # query i (key position p + i) sees key p + i only
    np.testing.assert_array_equal(visible, np.broadcast_to(want, visible.shape))
    q, k, v = (jnp.asarray(np.random.default_rng(i).normal(size=(2, 8, 2, 4)), jnp.float32)
               for i in range(3))
    kw = {} if prefix_len is None else dict(prefix_k=jnp.zeros((2, p, 2, 4)),
                                              prefix_v=jnp.ones((2, p, 2, 4)))
    out = tree_attention(q, k, v, pad.mask, impl="reference", **kw)
    np.testing.assert_allclose(out, v, atol=1e-6)  # each token's output is its own value

    assert not pad.valid.any() and np.all(pad.pred == -1) and np.all(pad.node == -1)
    assert np.all(pad.score_index == -1)
    assert np.all(pad.gdn.chunk_tokens == -1) and np.all(pad.gdn.token_slot == -1)
    logp = jnp.asarray(np.random.default_rng(3).normal(size=(2, 8)), jnp.float32)
    coefficients = jax.tree_util.tree_map(jnp.asarray, pad.coefficients)
    assert float(sft_loss(logp, coefficients)) == 0.0
    assert float(ppo_loss(logp, coefficients)[0]) == 0.0


def test_padding_matches_the_layout_linearize_pads_with():
    """An empty row of a linearized batch holds exactly the padding values."""
    batch = linearize([TrajectoryTree.from_sequences([[1, 2, 3]])], 8, n_rows=2, score_len=4,
                      gdn_chunk_size=4, gdn_chunks=2).inputs
    pad = padding(1, 8, score_len=4, gdn_chunk_size=4, gdn_chunks=2)
    for got, want in zip(jax.tree_util.tree_leaves(batch), jax.tree_util.tree_leaves(pad)):
        np.testing.assert_array_equal(got[1:], want)


def test_stack_and_concatenate_rows():
    a, b = _batch(score_len=8), dataclasses.replace(_batch(score_len=8),
                                                   tokens=np.full((1, 8), 3, np.int32))
    step = stack([a, b])
    assert step.shape == (2, 1, 8) and step.score_index.shape == (2, 1, 8)
    np.testing.assert_array_equal(step.tokens[1], b.tokens)
    np.testing.assert_array_equal(step.mask.end[0], a.mask.end)
    rows = concatenate_rows([a, b])
    assert rows.shape == (2, 8) and rows.coefficients.weight.shape == (2, 8)
    fields = r"\['gdn.chunk_src', 'gdn.chunk_tokens', 'gdn.token_slot'\]"
    with pytest.raises(ValueError, match=r"stack: batch 1 differs from batch 0 in fields "
                       + fields):
        stack([a, _batch(score_len=8, gdn_chunk_size=4)])


def test_wrong_dtype_or_shape_names_the_field():
    batch = _batch()
    with pytest.raises(ValueError, match=r"DeviceBatch.pred: dtype int64, expected int32"):
        dataclasses.replace(batch, pred=batch.pred.astype(np.int64))
    with pytest.raises(ValueError, match=r"DeviceBatch.coefficients.weight: dtype float64"):
        batch.with_coefficients(weight=batch.coefficients.weight.astype(np.float64))
    with jax.enable_x64(True):  # a float64 run's step computes float64 coefficients
        batch.with_coefficients(weight=batch.coefficients.weight.astype(np.float64))
    with pytest.raises(ValueError, match=r"DeviceBatch.mask.end: shape \(1, 7\), expected "
                                         r"\[1, S\] with S=8"):
        dataclasses.replace(batch, mask=TreeMask(batch.mask.end[:, :7]))
    with pytest.raises(ValueError, match=r"DeviceBatch.score_index: shape \(2, 64\)"):
        dataclasses.replace(batch, score_index=np.full((2, 64), -1, np.int32))
    with pytest.raises(ValueError, match=r"DeviceBatch.prefix_pred: shape \(1, 2\), expected "
                                         r"\[1, P\] with P=3"):
        dataclasses.replace(batch, mask=TreeMask(batch.mask.end + 3,
                                                 np.arange(1, 4, dtype=np.int32)[None]),
                            prefix_pred=np.full((1, 2), -1, np.int32))
    with pytest.raises(ValueError, match=r"DeviceBatch.valid: required"):
        dataclasses.replace(batch, valid=None)


def test_a_pytree_with_a_spec_per_field():
    step = stack([_batch(gdn_chunk_size=4)])
    doubled = jax.jit(lambda x: dataclasses.replace(x, tokens=x.tokens * 2))(step)
    assert isinstance(doubled, DeviceBatch) and isinstance(doubled.mask, TreeMask)
    np.testing.assert_array_equal(doubled.tokens, step.tokens * 2)
    specs = batch_specs(step)
    assert specs.tokens == jax.sharding.PartitionSpec(None, ROWS, CONTEXT)  # tokens over context
    # GDN chunks over context too (device k's chunks are the k-th block: jtree.layout.context_gdn_tables),
    # the tokens within a chunk whole
    assert specs.gdn.chunk_tokens == jax.sharding.PartitionSpec(None, ROWS, CONTEXT, None)
    assert specs.row_norm is None and specs.prefix_pred is None  # absent fields stay absent
