import jax.numpy as jnp
import numpy as np
import pytest

from jtree.kernels import TreeMask, tree_attention
from tests.attention_cases import assert_elementwise_close


def _inputs(rows=1, s=8, hq=4, hkv=2, d=8):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(rows, s, hq, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(rows, s, hkv, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(rows, s, hkv, d)), jnp.float32)
    return q, k, v


def test_reference_matches_per_path_softmax_with_gqa_and_softcap():
    q, k, v = _inputs()
    # Tree: [0,1] root, children [2,3] and [4]; then padding 5..7.
    end = jnp.asarray([[5, 5, 4, 4, 5, 6, 7, 8]], jnp.int32)
    out = np.asarray(tree_attention(q, k, v, TreeMask(end), impl="reference", softcap=5.0,
                                    scale=0.3))
    for i, keys in {3: [0, 1, 2, 3], 4: [0, 1, 4], 6: [6]}.items():
        for h in range(4):
            s = 0.3 * np.asarray(k[0, keys, h // 2]) @ np.asarray(q[0, i, h])
            s = 5.0 * np.tanh(s / 5.0)
            p = np.exp(s - s.max())
            want = (p / p.sum()) @ np.asarray(v[0, keys, h // 2])
            np.testing.assert_allclose(out[0, i, h], want, atol=1e-5)
            assert_elementwise_close(out[0, i, h], want, jnp.float32, f"reference {i} {h}")


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(hkv=3, hq=4), "kv heads \\(3\\) must divide q heads \\(4\\)"),
    ],
)
def test_rejects_bad_shapes(kw, match):
    q, k, v = _inputs(**kw)
    with pytest.raises(ValueError, match=match):
        tree_attention(q, k, v, TreeMask(jnp.ones(q.shape[:2], jnp.int32)))


def test_rejects_unknown_impl_and_bad_end():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="attention impl 'flash' is not one of"):
        tree_attention(q, k, v, TreeMask(jnp.ones((1, 8), jnp.int32)), impl="flash")
    with pytest.raises(ValueError, match="end: shape"):
        tree_attention(q, k, v, TreeMask(jnp.ones((1, 7), jnp.int32)))
