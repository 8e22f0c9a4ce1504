"""`TreeMask`: the kernels' padded layout (key ends, query positions) and the host check."""

import jax.numpy as jnp
import numpy as np
import pytest

from jtree.kernels import TreeMask


def test_padded_square_and_prefix_layouts():
    end = np.array([[3, 2, 3]], np.int32)  # root 0, children 1 and 2
    got, q_pos = TreeMask(end).padded(5, 5)
    assert q_pos is None and got.tolist() == [[3, 2, 3, 4, 5]]  # padding keys see themselves
    with pytest.raises(ValueError, match="without a prefix is square"):
        TreeMask(end).padded(4, 5)

    mask = TreeMask(end + 2, np.array([[5, 2]], np.int32))  # P = 2: one chain key, one padding
    assert mask.prefix_len == 2 and mask.key_end().tolist() == [[5, 2, 5, 4, 5]]
    got, q_pos = mask.padded(4, 8)
    assert got.tolist() == [[5, 2, 5, 4, 5, 6, 7, 8]]
    assert q_pos.tolist() == [[2, 3, 4, 7]]  # own queries at P + i; padding on the last key
    traced, traced_q = TreeMask(jnp.asarray(end + 2), jnp.asarray([[5, 2]])).padded(4, 8)
    np.testing.assert_array_equal(traced, got)
    np.testing.assert_array_equal(traced_q, q_pos)
    with pytest.raises(ValueError, match="shorter than the mask's"):
        mask.padded(2, 8)


def test_check_names_the_key():
    TreeMask(jnp.asarray([[1, 1]])).check()  # traced masks cannot be checked and pass
    with pytest.raises(ValueError, match="row 0, token 1 has end=1"):
        TreeMask(np.array([[3, 1, 3]], np.int32)).check()
    with pytest.raises(ValueError, match="row 0, prefix key 0 has end=0"):
        TreeMask(np.array([[3]], np.int32), np.array([[0, 3]], np.int32)).check()
