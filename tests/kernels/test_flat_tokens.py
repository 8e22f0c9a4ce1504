"""`scale_channels`, `normalized_last_axis` and `last_axis_dot`: computed with the leading axes
flattened, values and gradients unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtree.kernels.flat_tokens import last_axis_dot, normalized_last_axis, scale_channels


@pytest.mark.parametrize("x_shape, w_shape", [((1, 40, 6), (6,)), ((3, 8, 6), (6,)),
                                              ((1, 40, 2, 3), (3,)), ((2, 5, 2, 3), (2, 3))])
def test_equals_broadcast_product_with_gradients(x_shape, w_shape):
    """One row or several, a weight over the last axis or the last two: the same product and
    the same gradients (the weight's is the sum over every leading axis)."""
    rng = np.random.default_rng(0)
    x, w, ct = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in (x_shape, w_shape, x_shape))
    np.testing.assert_array_equal(scale_channels(x, w), x * w)
    got = jax.grad(lambda x, w: jnp.sum(scale_channels(x, w) * ct), argnums=(0, 1))(x, w)
    want = jax.grad(lambda x, w: jnp.sum(x * w * ct), argnums=(0, 1))(x, w)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_a_weight_that_does_not_match_the_channels_is_named():
    with pytest.raises(ValueError, match=r"weight \(4,\) must match x's trailing axes"):
        scale_channels(jnp.zeros((1, 3, 5)), jnp.zeros((4,)))


@pytest.mark.parametrize("shape", [(1, 40, 6), (3, 8, 6), (1, 40, 2, 5)])
@pytest.mark.parametrize("mean", [True, False])
def test_normalized_equals_the_broadcast_formula_with_gradients(shape, mean):
    """RMS (mean) and L2 (sum) normalization over the last axis, float32 out of bfloat16 in too."""
    rng = np.random.default_rng(1)
    x, ct = (jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(2))
    eps = 1e-6

    def want(x):
        x = x.astype(jnp.float32)
        m = jnp.mean(x * x, -1, keepdims=True) if mean else jnp.sum(x * x, -1, keepdims=True)
        return x / jnp.sqrt(m + eps)

    got = normalized_last_axis(x, eps, mean=mean)
    np.testing.assert_allclose(got, want(x), rtol=1e-6, atol=1e-6)
    assert normalized_last_axis(x.astype(jnp.bfloat16), eps, mean=mean).dtype == jnp.float32
    g_got = jax.grad(lambda x: jnp.sum(normalized_last_axis(x, eps, mean=mean) * ct))(x)
    g_want = jax.grad(lambda x: jnp.sum(want(x) * ct))(x)
    np.testing.assert_allclose(g_got, g_want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(1, 40, 6), (1, 40, 2, 5), (3, 8, 2, 5)])
def test_last_axis_dot_equals_the_sum_of_products_with_gradients(shape):
    rng = np.random.default_rng(2)
    a, b, ct = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in (shape, shape, shape[:-1]))
    np.testing.assert_allclose(last_axis_dot(a, b), jnp.sum(a * b, -1), rtol=1e-6, atol=1e-6)
    got = jax.grad(lambda a, b: jnp.sum(last_axis_dot(a, b) * ct), argnums=(0, 1))(a, b)
    want = jax.grad(lambda a, b: jnp.sum(jnp.sum(a * b, -1) * ct), argnums=(0, 1))(a, b)
    for x, y in zip(got, want):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="must have the same shape"):
        last_axis_dot(a, b[..., :1])
