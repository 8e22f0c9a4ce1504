"""Gated delta rule kernels: chunked == recurrent (== Hugging Face), state carry, tree routing by
the sequential and the parallel tree scan (== per-path recurrence, == each other), path conv1d,
and the O(chunks x state) residual memory of both scans."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from jtree.kernels.gdn.delta_rule import (
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    pick_scan,
    tree_gated_delta_rule,
)
from jtree.kernels.tree_conv import path_context, tree_causal_conv1d
from jtree.layout.linearize import linearize
from jtree.trees.tree import TrajectoryTree
from tests.attention_cases import assert_elementwise_close
from tests.gdn_cases import (
    DK,
    DV,
    HK,
    HV,
    MAX_PATHS,
    SCANS,
    TREE_ROWS,
    TREE_S,
    deep_chain,
    gather_paths,
    path_losses,
    tree_and_path_grads,
)
from tests.models_util import rel_l2
from tests.strategies import forests

recurrent = jax.jit(gated_delta_rule_recurrent)
chunked = jax.jit(gated_delta_rule_chunked, static_argnames="chunk_size")


def _inputs(rng, lead, hk=HK, hv=HV, dk=DK, dv=DV):
    f32 = np.float32
    return (rng.normal(size=lead + (hk, dk)).astype(f32), rng.normal(size=lead + (hk, dk)).astype(f32),
            rng.normal(size=lead + (hv, dv)).astype(f32),
            -rng.uniform(0.0, 1.5, size=lead + (hv,)).astype(f32),
            rng.uniform(size=lead + (hv,)).astype(f32))


def _state(rng, b, hv=HV, dk=DK, dv=DV):
    return rng.normal(size=(b, hv, dk, dv)).astype(np.float32)


@pytest.mark.parametrize("chunk", [1, 4, 16, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent(chunk, with_state):
    rng = np.random.default_rng(chunk)
    args = _inputs(rng, (2, 37))
    s0 = _state(rng, 2) if with_state else None
    o_r, f_r = recurrent(*args, s0)
    o_c, f_c = chunked(*args, s0, chunk_size=chunk)
    assert float(jnp.max(jnp.abs(o_r - o_c))) <= 1e-5
    assert float(jnp.max(jnp.abs(f_r - f_c))) <= 1e-5
    assert_elementwise_close(o_c, o_r, jnp.float32, "chunked out")
    assert_elementwise_close(f_c, f_r, jnp.float32, "chunked final state")


def test_recurrent_matches_hugging_face():
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    rng = np.random.default_rng(0)
    args = _inputs(rng, (2, 19))
    s0 = _state(rng, 2)
    o, f = recurrent(*args, s0)
    o_hf, f_hf = hf.torch_recurrent_gated_delta_rule(
        *(torch.tensor(a) for a in args), initial_state=torch.tensor(s0), output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    np.testing.assert_allclose(o, o_hf.numpy(), atol=1e-5)
    np.testing.assert_allclose(f, f_hf.numpy(), atol=1e-5)
    assert_elementwise_close(o, o_hf.numpy(), jnp.float32, "recurrent out vs HF")
    assert_elementwise_close(f, f_hf.numpy(), jnp.float32, "recurrent final state vs HF")


@pytest.mark.parametrize("split", [1, 13, 32])
def test_carrying_the_state_across_a_split_equals_one_pass(split):
    rng = np.random.default_rng(split)
    args = _inputs(rng, (2, 40))
    s0 = _state(rng, 2)
    o_full, f_full = chunked(*args, s0, chunk_size=8)
    o_a, f_a = chunked(*(a[:, :split] for a in args), s0, chunk_size=8)
    o_b, f_b = chunked(*(a[:, split:] for a in args), f_a, chunk_size=8)
    np.testing.assert_allclose(np.concatenate([o_a, o_b], axis=1), o_full, atol=1e-5)
    np.testing.assert_allclose(f_b, f_full, atol=1e-5)
    assert_elementwise_close(np.concatenate([o_a, o_b], axis=1), o_full, jnp.float32, "split out")
    assert_elementwise_close(f_b, f_full, jnp.float32, "split final state")


def test_gradients_match_between_forms():
    rng = np.random.default_rng(3)
    args = _inputs(rng, (2, 21))
    s0 = _state(rng, 2)
    r_out = rng.normal(size=(2, 21, HV, DV)).astype(np.float32)
    r_state = rng.normal(size=s0.shape).astype(np.float32)

    def loss(fn, *a):
        o, f = fn(*a)
        return jnp.sum(o * r_out) + jnp.sum(f * r_state)

    by_chunks = functools.partial(gated_delta_rule_chunked, chunk_size=8)
    g_r = jax.jit(jax.grad(lambda *a: loss(gated_delta_rule_recurrent, *a), argnums=range(6)))(
        *args, s0)
    g_c = jax.jit(jax.grad(lambda *a: loss(by_chunks, *a), argnums=range(6)))(*args, s0)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), g_c, g_r):
        assert rel_l2(a, b) <= 1e-5, name
        assert float(jnp.linalg.norm(b)) > 0, name


# ----------------------------------------------------------------------------- trees


@pytest.mark.parametrize("scan", SCANS)
@pytest.mark.parametrize("chunk", [1, 3])
@settings(max_examples=8)
@given(trees=forests(n_trees=(1, 4), max_nodes=10, max_seg=6))
def test_tree_outputs_and_gradients_equal_per_path(trees, chunk, scan):
    """Every path's outputs equal the recurrent reference on that path alone (starting from its
    row's initial state), and gradients of a weighted tree loss equal the per-path loss's, for
    chunk boundaries inside nodes, single-token nodes and several trees per row."""
    _assert_tree_equals_paths(trees, chunk, scan)


def _flat_forest() -> list[TrajectoryTree]:
    """Depth 1: single-node trees of at most one chunk (3 tokens), every chunk a root."""
    return [TrajectoryTree.from_nodes([-1], [[t] * (1 + t % 3)]) for t in range(1, 21)]


@pytest.mark.parametrize("scan", SCANS)
@pytest.mark.parametrize("shape", ["flat", "deep_chain"])
def test_flat_and_deep_trees_equal_per_path(shape, scan):
    """The extremes of the parallel scan's pointer jumping: no chunk has a parent (no round) and
    a chain of 17 chunks (five rounds)."""
    trees = _flat_forest() if shape == "flat" else deep_chain()
    _assert_tree_equals_paths(trees, 3, scan)


def _assert_tree_equals_paths(trees, chunk, scan):
    batch = linearize(trees, TREE_S, gdn_chunk_size=chunk, n_rows=TREE_ROWS,
                      gdn_chunks=TREE_S)
    rng = np.random.default_rng(chunk)
    r, s = batch.shape
    args = _inputs(rng, (r, s)) + (_state(rng, r),)
    tables, rows, idx, coeff, target, weight = path_losses(batch, rng, MAX_PATHS)
    real = idx >= 0
    tree_fn, path_fn = tree_and_path_grads(scan)
    (l_t, o_t), g_t = tree_fn(*args, tables, weight, target)
    (l_p, o_p), g_p = path_fn(*args, rows, idx, coeff, target)
    np.testing.assert_allclose(np.asarray(o_t)[rows[:, None], idx][real], np.asarray(o_p)[real],
                               atol=1e-5)
    assert_elementwise_close(np.asarray(o_t)[rows[:, None], idx][real], np.asarray(o_p)[real],
                             jnp.float32, f"{scan} tree out vs paths")
    assert float(l_t) == pytest.approx(float(l_p), rel=1e-5, abs=1e-5)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), g_t, g_p):
        assert rel_l2(a, b) <= 1e-5, name


@settings(max_examples=15)
@given(trees=forests(n_trees=(1, 4), max_nodes=10, max_seg=3))
def test_path_conv_reads_the_pred_chain(trees):
    """The conv on the tree equals a plain causal conv (zero left padding) on every path."""
    batch = linearize(trees, 48)
    rng = np.random.default_rng(0)
    kernel = 4
    x = rng.normal(size=batch.shape + (5,)).astype(np.float32)
    w = rng.normal(size=(5, kernel)).astype(np.float32)
    out = np.asarray(tree_causal_conv1d(x, w, path_context(batch.inputs.pred, kernel - 1)))
    for t, r, off in zip(batch.layout.trees, batch.layout.rows, batch.layout.offsets):
        for p in range(t.n_paths):
            idx = t.path_token_index(p) + off
            xp = np.concatenate([np.zeros((kernel - 1, 5), np.float32), x[r, idx]])
            want = sum(xp[m : m + len(idx)] * w[:, m] for m in range(kernel))
            np.testing.assert_allclose(out[r, idx], want, atol=1e-5)
            assert_elementwise_close(out[r, idx], want, jnp.float32, "path conv")


@functools.lru_cache(maxsize=None)
def _scan_grads(scan):
    """Jitted ((loss, (o, buffer)), grads) of a loss on the outputs and the state buffer, tables
    as arguments (one compilation per scan for all trees of the fixed shapes)."""

    def loss(q, k, v, g, beta, s0, tables, out_weight, state_weight):
        o, buffer = tree_gated_delta_rule(q, k, v, g, beta, initial_states=s0,
                                          chunk_tokens=tables[0], chunk_src=tables[1],
                                          token_slot=tables[2], scan=scan)
        return jnp.sum(o * out_weight) + jnp.sum(jnp.tanh(buffer) * state_weight), (o, buffer)

    return jax.jit(jax.value_and_grad(loss, argnums=range(6), has_aux=True))


@pytest.mark.parametrize("shape", ["random", "flat", "deep_chain"])
def test_parallel_scan_equals_sequential_with_initial_slots(shape):
    """Both scans give the same outputs, chunk-final states and gradients when the loss reads the
    state buffer too and the roots start from two initial slots (as a tree part below an earlier
    part's prefix does)."""
    rng = np.random.default_rng(7)
    trees = {"random": lambda: [TrajectoryTree.from_nodes(
                 [-1, 0, 1, 1, 0, -1, 5], [[1] * 4, [2] * 7, [3], [4] * 5, [5] * 2, [6] * 3, [7] * 8])],
             "flat": _flat_forest, "deep_chain": deep_chain}[shape]()
    batch = linearize(trees, TREE_S, gdn_chunk_size=3, n_rows=TREE_ROWS, gdn_chunks=TREE_S)
    gdn = batch.inputs.gdn
    r, s = batch.shape
    # Root chunks at odd chunk indices start from initial slot 1 instead of 0.
    src = np.asarray(gdn.chunk_src)
    src = np.where(src > 0, src + 1, np.arange(src.shape[1]) % 2).astype(np.int32)
    args = _inputs(rng, (r, s)) + (rng.normal(size=(r, 2, HV, DK, DV)).astype(np.float32),)
    out_weight = rng.normal(size=(r, s, HV, DV)).astype(np.float32)
    state_weight = rng.normal(size=(r, 2 + src.shape[1], HV, DK, DV)).astype(np.float32)
    tables = (gdn.chunk_tokens, src, gdn.token_slot)
    results = [_scan_grads(scan)(*args, tables, out_weight, state_weight) for scan in SCANS]
    ((_, (o_s, buf_s)), g_s), ((_, (o_p, buf_p)), g_p) = results
    assert float(jnp.max(jnp.abs(o_s - o_p))) <= 1e-5
    assert float(jnp.max(jnp.abs(buf_s - buf_p))) <= 1e-5
    assert_elementwise_close(o_p, o_s, jnp.float32, "parallel scan out")
    assert_elementwise_close(buf_p, buf_s, jnp.float32, "parallel scan states")
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_states"), g_p, g_s):
        assert rel_l2(a, b) <= 1e-5, name
        assert float(jnp.linalg.norm(b)) > 0, name
    assert float(jnp.linalg.norm(g_s[5][:, 1])) > 0  # the second initial slot is read


def test_parallel_scan_inside_shard_map():
    """Under `shard_map(check_vma=True)` (rows over a data axis, as in the sharded step) the
    rounds' loop carries and predicate vary over the axis like the rows; values and gradients
    equal the unsharded call. One device: the typing is what is checked."""
    trees = [TrajectoryTree.from_nodes([-1, 0, 0, 1], [[1] * 9, [2] * 5, [3] * 3, [4] * 4])]
    batch = linearize(trees, 24, gdn_chunk_size=4, gdn_chunks=8)
    gdn = batch.inputs.gdn
    tables = tuple(jnp.asarray(t) for t in (gdn.chunk_tokens, gdn.chunk_src, gdn.token_slot))
    args = _inputs(np.random.default_rng(0), batch.shape)
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = jax.sharding.PartitionSpec("data")

    def loss(q, k, v, g, beta, ct, cs, ts):
        o, buffer = tree_gated_delta_rule(q, k, v, g, beta, chunk_tokens=ct, chunk_src=cs,
                                          token_slot=ts, scan="parallel")
        return jnp.sum(o * o) + jnp.sum(buffer)

    def sharded(*a):
        local = lambda *x: jax.lax.psum(loss(*x), "data")  # noqa: E731
        return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 8, out_specs=jax.sharding.PartitionSpec(),
                             check_vma=True)(*a, *tables)

    got = jax.jit(jax.value_and_grad(sharded, argnums=range(5)))(*args)
    want = jax.jit(jax.value_and_grad(lambda *a: loss(*a, *tables), argnums=range(5)))(*args)
    assert float(got[0]) == pytest.approx(float(want[0]), rel=1e-6)
    for a, b in zip(got[1], want[1]):
        assert rel_l2(a, b) <= 1e-6


def test_scan_rule():
    """"auto" keeps the reference on CPU and runs the parallel scan on accelerators; an explicit
    scan is kept; a bad name is named."""
    assert [pick_scan("auto", p) for p in ("cpu", "gpu", "tpu")] == ["sequential", "parallel",
                                                                     "parallel"]
    assert {pick_scan(s, "cpu") for s in SCANS} == set(SCANS)
    with pytest.raises(ValueError, match="scan: 'tree'"):
        pick_scan("tree", "cpu")


def _residual_bytes(n_chunks: int, scan: str) -> tuple[int, int]:
    """Bytes the backward pass keeps (the leaves of jax.vjp's closure) and the largest leaf."""
    tree = TrajectoryTree.from_nodes([-1, 0, 0, 1], [[1] * 9, [2] * 5, [3] * 3, [4] * 4])
    batch = linearize([tree], 24, gdn_chunk_size=4, gdn_chunks=n_chunks)
    args = _inputs(np.random.default_rng(0), batch.shape)

    @jax.jit
    def f(*a):
        gdn = batch.inputs.gdn
        return tree_gated_delta_rule(*a, chunk_tokens=gdn.chunk_tokens, chunk_src=gdn.chunk_src,
                                     token_slot=gdn.token_slot, scan=scan)[0]

    _, vjp_fn = jax.vjp(f, *args)
    sizes = [x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(vjp_fn)]
    return sum(sizes), max(sizes)


@pytest.mark.parametrize("scan", SCANS)
def test_backward_residuals_grow_with_chunks_not_chunks_times_buffer(scan):
    """The scan's buffer holds NC + 1 states; keeping it per step (sequential) or the composed
    maps of every round (parallel) would cost NC * (NC + 1) or NC * rounds states. The residuals
    must instead be affine in NC, with at most a few states per chunk."""
    state_bytes = HV * DK * DV * 4
    (r8, _), (r16, _), (r32, m32) = (_residual_bytes(n, scan) for n in (8, 16, 32))
    assert r32 - r16 == 2 * (r16 - r8)  # exactly affine in the number of chunks
    per_chunk = (r16 - r8) / 8
    chunk_tokens = 4
    # One entering state per chunk plus O(C) per-token terms (C x C intra-chunk matrices).
    assert per_chunk <= 2 * state_bytes + 16 * HV * chunk_tokens * (chunk_tokens + DK + DV) * 4
    assert m32 < 32 * 33 * state_bytes / 8


# ------------------------------------------------- without the delta rule (Mamba2's SSD, beta=None)


def _ssd_recurrent(q, k, v, g, s0):
    """Mamba2's recurrence token by token, written here as the oracle: per head h (group
    h // (H // G)), S_t = exp(g_t) S_{t-1} + k_t v_t^T, o_t = S_t^T q_t. q, k [P, T, G, n]."""
    rep = v.shape[2] // q.shape[2]
    q, k = jnp.repeat(q, rep, axis=2), jnp.repeat(k, rep, axis=2)

    def step(s, xs):
        q_t, k_t, v_t, g_t = xs
        s = s * jnp.exp(g_t)[..., None, None] + k_t[..., :, None] * v_t[..., None, :]
        return s, jnp.einsum("phkv,phk->phv", s, q_t, precision="highest")

    _, o = jax.lax.scan(step, s0, tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g)))
    return jnp.moveaxis(o, 0, 1)


@functools.cache
def _ssdtree_and_path_grads(scan):
    def tree_loss(q, k, v, g, s0, tables, weight, target):
        o, _ = tree_gated_delta_rule(q, k, v, g, None, chunk_tokens=tables[0],
                                     chunk_src=tables[1], token_slot=tables[2], initial_state=s0,
                                     scan=scan)
        return jnp.sum(weight[..., None, None] * o * target), o

    def path_loss(q, k, v, g, s0, rows, idx, coeff, target):
        o = _ssd_recurrent(*(gather_paths(x, rows, idx) for x in (q, k, v, g)), s0[rows])
        return jnp.sum(coeff[..., None, None] * o * gather_paths(target, rows, idx)), o

    def grads(fn):
        return jax.jit(jax.value_and_grad(fn, argnums=range(5), has_aux=True))

    return grads(tree_loss), grads(path_loss)


@pytest.mark.parametrize("scan", SCANS)
@pytest.mark.parametrize("shape", ["random", "deep_chain"])
def test_ssd_on_trees_equals_per_path_recurrence(shape, scan):
    """The recurrence without the delta rule (Mamba2's SSD; q, k unnormalised, 2 groups for 4
    heads) by both scans: every path's outputs and the gradients of a weighted tree loss equal the
    token-by-token recurrence on each path alone (from its row's initial state)."""
    trees = {"random": lambda: [
        TrajectoryTree.from_nodes([-1, 0, 1, 1, 0, -1, 5], [[1] * 4, [2] * 7, [3], [4] * 5,
                                                             [5] * 2, [6] * 3, [7] * 8]),
        TrajectoryTree.from_nodes([-1, 0, 0, 2, 2], [[1] * 2, [2] * 3, [3], [4] * 4, [5]])],
        "deep_chain": deep_chain}[shape]()
    batch = linearize(trees, TREE_S, gdn_chunk_size=3, n_rows=TREE_ROWS, gdn_chunks=TREE_S)
    rng = np.random.default_rng(11)
    r, s = batch.shape
    q, k, v, g, _ = _inputs(rng, (r, s))
    args = (q, k, v, g, _state(rng, r))
    tables, rows, idx, coeff, target, weight = path_losses(batch, rng)
    real = idx >= 0
    tree_fn, path_fn = _ssdtree_and_path_grads(scan)
    (l_t, o_t), g_t = tree_fn(*args, tables, weight, target)
    (l_p, o_p), g_p = path_fn(*args, rows, idx, coeff, target)
    assert_elementwise_close(np.asarray(o_t)[rows[:, None], idx][real], np.asarray(o_p)[real],
                             jnp.float32, f"{scan} ssd tree out vs paths")
    # The state is not normalised here, so the loss is a sum of large terms of both signs:
    # compared relative to the sum of their magnitudes.
    mass = np.abs(coeff[..., None, None] * np.asarray(o_p)
                  * np.asarray(gather_paths(target, rows, idx))).sum()
    assert abs(float(l_t) - float(l_p)) <= 1e-6 * mass
    for name, a, b in zip(("q", "k", "v", "g", "initial_state"), g_t, g_p):
        assert rel_l2(a, b) <= 1e-5, name
        assert float(jnp.linalg.norm(b)) > 0, name
