"""KDA (Kimi Delta Attention): the gated delta rule with one log decay per key channel, g [..., Hv,
dk], through the GDN kernels. Oracles written here or outside the code under test: a float64 numpy
recurrence token by token, its finite differences, and Hugging Face's torch functions; on trees,
the numpy recurrence run on every path alone and the per-path recurrent kernel's gradients, for
both scans; strongly decaying channels next to slow ones."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtree.kernels.gdn.delta_rule import (
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    tree_gated_delta_rule,
)
from jtree.layout.linearize import linearize
from jtree.trees.tree import TrajectoryTree
from tests.gdn_cases import (
    DK,
    DV,
    HK,
    HV,
    SCANS,
    TREE_ROWS,
    TREE_S,
    deep_chain,
    path_losses,
    tree_and_path_grads,
)
from tests.models_util import rel_l2

recurrent = jax.jit(gated_delta_rule_recurrent)
chunked = jax.jit(gated_delta_rule_chunked, static_argnames="chunk_size")


def _kda_numpy(q, k, v, g, beta, s0):
    """The oracle, float64, token by token: per value head h (key head h // (Hv // Hk)),
    S_t = (I - b_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T, o_t = S_t^T q_t, with q, k
    L2-normalised (eps 1e-6) and q scaled by dk**-0.5. q, k [B, T, Hk, dk]; v [B, T, Hv, dv];
    g [B, T, Hv, dk]; beta [B, T, Hv]; s0 [B, Hv, dk, dv]. Returns (o, final state)."""
    q, k, v, g, beta, s = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, s0))
    rep = v.shape[2] // q.shape[2]
    q, k = (np.repeat(x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6), rep, axis=2)
            for x in (q, k))
    q = q / np.sqrt(q.shape[-1])
    o = np.zeros(v.shape)
    for t in range(v.shape[1]):
        s = s * np.exp(g[:, t])[..., None]
        kt = k[:, t]
        delta = beta[:, t, :, None] * (v[:, t] - np.einsum("bhkv,bhk->bhv", s, kt))
        s = s + kt[..., None] * delta[..., None, :]
        o[:, t] = np.einsum("bhkv,bhk->bhv", s, q[:, t])
    return o, s


def _inputs(rng, lead, hk=HK, slow_channels=0.0):
    """q, k, v, per-channel g, beta, initial state (float32). `slow_channels` (a fraction):
    the first channels decay at most 0.1 per token, the others 10 to 40 per token (chunk sums of
    hundreds), as a KDA gate does with channels of very different memory."""
    f32 = np.float32
    g = -rng.uniform(0.0, 1.5, size=lead + (HV, DK))
    if slow_channels:
        slow = int(DK * slow_channels)
        g[..., :slow] = -rng.uniform(0.0, 0.1, size=lead + (HV, slow))
        g[..., slow:] = -rng.uniform(10.0, 40.0, size=lead + (HV, DK - slow))
    return (rng.normal(size=lead + (hk, DK)).astype(f32), rng.normal(size=lead + (hk, DK)).astype(f32),
            rng.normal(size=lead + (HV, DV)).astype(f32), g.astype(f32),
            rng.uniform(size=lead + (HV,)).astype(f32),
            rng.normal(size=(lead[0], HV, DK, DV)).astype(f32))


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
def test_recurrent_and_chunked_equal_the_numpy_recurrence(chunk):
    """Chunk 5 pads its sub-blocks (2 + 2 + 1 of 2), 16 and 64 have four and eight sub-blocks:
    the off-diagonal factorisation and the diagonal form both count."""
    args = _inputs(np.random.default_rng(chunk), (2, 37))
    o_want, f_want = _kda_numpy(*args)
    for o, f in (recurrent(*args), chunked(*args, chunk_size=chunk)):
        np.testing.assert_allclose(o, o_want, atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(f, f_want, atol=2e-5, rtol=1e-5)


def test_recurrent_and_chunked_match_hugging_face():
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    args = _inputs(np.random.default_rng(1), (2, 45), hk=HV)  # KDA has as many key heads as value
    q, k, v, g, beta, s0 = (torch.tensor(a) for a in args)
    o_rec, f_rec = hf.recurrent_kimi_delta_attention(
        q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_chk, f_chk = hf.chunk_kimi_delta_attention(
        q, k, v, g, beta, chunk_size=16, initial_state=s0, output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    o, f = recurrent(*args)
    o_c, f_c = chunked(*args, chunk_size=16)
    for o_hf, f_hf in ((o_rec, f_rec), (o_chk, f_chk)):
        for got_o, got_f in ((o, f), (o_c, f_c)):
            np.testing.assert_allclose(got_o, o_hf.numpy(), atol=2e-5, rtol=1e-5)
            np.testing.assert_allclose(got_f, f_hf.numpy(), atol=2e-5, rtol=1e-5)


def _weighted_loss(o, f, r_out, r_state):
    return (o * r_out).sum() + (f * r_state).sum()


def test_gradients_equal_finite_differences_of_the_numpy_recurrence():
    """jax.grad of the chunked form (float64) along a random direction per input equals the
    central difference of the numpy oracle's loss; the recurrent form's gradients equal it."""
    rng = np.random.default_rng(2)
    args = [a.astype(np.float64) for a in _inputs(rng, (1, 23))]
    r_out = rng.normal(size=(1, 23, HV, DV))
    r_state = rng.normal(size=args[-1].shape)
    with jax.enable_x64(True):
        def loss(fn, *a):
            return _weighted_loss(*fn(*a), r_out, r_state)

        by_chunks = functools.partial(gated_delta_rule_chunked, chunk_size=8)
        g_c = jax.jit(jax.grad(functools.partial(loss, by_chunks), argnums=range(6)))(*args)
        g_r = jax.jit(jax.grad(functools.partial(loss, gated_delta_rule_recurrent),
                               argnums=range(6)))(*args)
    eps = 1e-6
    for i, name in enumerate(("q", "k", "v", "g", "beta", "initial_state")):
        d = rng.normal(size=args[i].shape)
        plus, minus = list(args), list(args)
        plus[i], minus[i] = args[i] + eps * d, args[i] - eps * d
        fd = (loss(_kda_numpy, *plus) - loss(_kda_numpy, *minus)) / (2 * eps)
        assert float(np.sum(np.asarray(g_c[i]) * d)) == pytest.approx(fd, rel=1e-6, abs=1e-8), name
        assert rel_l2(g_r[i], g_c[i]) <= 1e-10, name


def test_strong_decays_stay_finite_and_exact():
    """Channels decaying by 10-40 per token (chunk sums far below -200) next to slow ones: float32
    outputs and states equal the float64 oracle, and the gradients are finite and equal the
    recurrent form's (which multiplies the decays token by token)."""
    rng = np.random.default_rng(3)
    args = _inputs(rng, (2, 40), slow_channels=0.5)
    per_chunk = args[3].reshape(2, 2, 20, HV, DK).sum(axis=2)
    assert per_chunk[..., DK // 2:].max() < -200
    o_want, f_want = _kda_numpy(*args)
    o, f = chunked(*args, chunk_size=20)
    np.testing.assert_allclose(o, o_want, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(f, f_want, atol=2e-5, rtol=1e-5)
    r_out = rng.normal(size=o.shape).astype(np.float32)
    r_state = rng.normal(size=f.shape).astype(np.float32)

    def grads(fn):
        return jax.jit(jax.grad(lambda *a: _weighted_loss(*fn(*a), r_out, r_state),
                                argnums=range(6)))(*args)

    g_c = grads(functools.partial(gated_delta_rule_chunked, chunk_size=20))
    g_r = grads(gated_delta_rule_recurrent)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), g_c, g_r):
        assert bool(jnp.all(jnp.isfinite(a))), name
        assert rel_l2(a, b) <= 1e-5, name


def test_shapes_are_named():
    args = list(_inputs(np.random.default_rng(4), (1, 6)))
    with pytest.raises(ValueError, match=r"g must be \[B, T, Hv\]"):
        gated_delta_rule_chunked(*args[:3], args[3][..., :-1], *args[4:])
    with pytest.raises(ValueError, match="g: a decay per key channel"):
        tree_gated_delta_rule(*args[:4], None, chunk_tokens=np.zeros((1, 2, 3), np.int32),
                              chunk_src=np.zeros((1, 2), np.int32),
                              token_slot=np.zeros((1, 6), np.int32))


# ----------------------------------------------------------------------------- trees


def _random_forest() -> list[TrajectoryTree]:
    """Two trees in a row: siblings, three levels, paths ending at internal nodes (a node whose
    children follow it is also the end of the path through it)."""
    return [TrajectoryTree.from_nodes([-1, 0, 1, 1, 0, 4, -1, 6],
                                      [[1] * 4, [2] * 7, [3], [4] * 5, [5] * 2, [6] * 3, [7] * 8,
                                       [8] * 2]),
            TrajectoryTree.from_nodes([-1, 0, 0, 2, 2], [[1] * 2, [2] * 3, [3], [4] * 4, [5]])]


@pytest.mark.parametrize("scan", SCANS)
@pytest.mark.parametrize("shape", ["random", "deep_chain"])
def test_tree_equals_the_numpy_recurrence_per_path(shape, scan):
    """Each path's outputs equal the numpy oracle on that path alone (from its row's initial
    state); the gradients of a weighted tree loss equal those of the per-path recurrent kernel.
    Chunks of 4 tokens (two sub-blocks), boundaries inside nodes, a 17-chunk chain."""
    trees = _random_forest() if shape == "random" else deep_chain()
    batch = linearize(trees, TREE_S, gdn_chunk_size=4, n_rows=TREE_ROWS, gdn_chunks=TREE_S)
    rng = np.random.default_rng(5)
    args = _inputs(rng, batch.shape)
    tables, rows, idx, coeff, target, weight = path_losses(batch, rng)
    real = idx >= 0
    tree_fn, path_fn = tree_and_path_grads(scan)
    (_, o_t), g_t = tree_fn(*args, tables, weight, target)
    (_, o_p), g_p = path_fn(*args, rows, idx, coeff, target)

    per_path = [np.where(real.reshape(idx.shape + (1,) * (x.ndim - 2)),
                         x[rows[:, None], np.maximum(idx, 0)], 0) for x in args[:5]]
    o_want, _ = _kda_numpy(*per_path, args[5][rows])
    o_tree = np.asarray(o_t)[rows[:, None], idx][real]
    np.testing.assert_allclose(o_tree, o_want[real], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(o_p)[real], o_want[real], atol=2e-5, rtol=1e-5)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), g_t, g_p):
        assert rel_l2(a, b) <= 1e-5, name
        assert float(jnp.linalg.norm(b)) > 0, name
