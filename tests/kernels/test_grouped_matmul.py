"""The tiled grouped matmul (jtree.kernels.grouped_matmul) against a numpy per-row formula: every
sorted row times its group's weights, rows past the last group left out; values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtree.config.runtime import RuntimeConfig
from jtree.kernels.grouped_matmul import pick_grouped_matmul, tile_layout, tiled_matmul

ROWS, K, N, TILE = 23, 6, 5, 4
# group sizes with empty groups, a group of exactly one tile and 3 rows in no group
SIZES = np.array([5, 0, 4, 1, 0, 10], np.int32)


def _problem():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, K)).astype(np.float32)
    w = rng.normal(size=(len(SIZES), N, K)).astype(np.float32)
    ct = rng.normal(size=(ROWS, N)).astype(np.float32)
    group = np.repeat(np.arange(len(SIZES)), SIZES)  # the group of each of the first rows
    return x, w, ct, group


def _tiled(x, w):
    """y [ROWS, N] through the padded layout: each padded row's product put back at its row."""
    layout = tile_layout(jnp.asarray(SIZES), ROWS, TILE)
    held = layout.source < ROWS
    xp = jnp.where(held[:, None], x[jnp.minimum(layout.source, ROWS - 1)], 0)
    yp = tiled_matmul(xp, w, layout.expert, layout.used)
    return jnp.zeros((ROWS, N), x.dtype).at[layout.source].add(yp, mode="drop"), layout


def test_layout_puts_every_grouped_row_once_in_a_tile_of_its_group():
    _, _, _, group = _problem()
    layout = tile_layout(jnp.asarray(SIZES), ROWS, TILE)
    source, expert = np.asarray(layout.source), np.asarray(layout.expert)
    assert len(source) % TILE == 0 and len(expert) == len(source) // TILE
    held = source[source < ROWS]
    assert sorted(held) == list(range(len(group)))  # the 3 rows of no group are left out
    tile_of = np.flatnonzero(source < ROWS) // TILE
    np.testing.assert_array_equal(expert[tile_of], group[held])
    # 5 -> 2 tiles, 4 -> 1, 1 -> 1, 10 -> 3: 7 used tiles
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(layout.used)), np.arange(7))


def test_products_and_gradients_equal_the_per_row_formula():
    x, w, ct, group = _problem()
    rows = len(group)
    want = np.zeros((ROWS, N), np.float32)
    want[:rows] = np.einsum("rk,rnk->rn", x[:rows], w[group])
    want_dx = np.zeros_like(x)
    want_dx[:rows] = np.einsum("rn,rnk->rk", ct[:rows], w[group])
    want_dw = np.zeros_like(w)
    np.add.at(want_dw, group, np.einsum("rn,rk->rnk", ct[:rows], x[:rows]))

    def loss(x, w):
        return jnp.sum(_tiled(x, w)[0] * ct)

    got, _ = jax.jit(_tiled)(jnp.asarray(x), jnp.asarray(w))
    dx, dw = jax.jit(jax.grad(loss, (0, 1)))(jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-5)


def test_bfloat16_products_accumulate_in_float32():
    x, w, _, group = _problem()
    got, _ = _tiled(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16))
    rows = len(group)
    xb = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
    wb = np.asarray(jnp.asarray(w, jnp.bfloat16), np.float32)
    want = np.einsum("rk,rnk->rn", xb[:rows], wb[group])
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32)[:rows], want, rtol=1e-2, atol=1e-2)


def test_auto_is_tiled_on_gpus_only_and_bad_names_are_refused():
    assert pick_grouped_matmul("auto", "gpu") == "tiled"
    assert pick_grouped_matmul("auto", "cuda") == "tiled"
    assert pick_grouped_matmul("auto", "tpu") == "ragged_dot"
    assert pick_grouped_matmul("auto", "cpu") == "ragged_dot"
    assert pick_grouped_matmul("tiled", "cpu") == "tiled"
    with pytest.raises(ValueError, match="expert_matmul"):
        RuntimeConfig(expert_matmul="dense")
