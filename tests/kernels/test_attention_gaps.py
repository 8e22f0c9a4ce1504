"""Query blocks without a real query (`TreeMask.real`): the gaps of a context-parallel row lie
inside the subtree intervals of the nodes they cut, so without the flag their queries see those
nodes' ancestors and every such block is work. With it the block tables keep only each gap
block's own key blocks, and the real queries' outputs and all gradients (for a zero cotangent on
the gap outputs, which nothing reads) equal the dense reference's; the gap outputs stay finite.

The rows are random multi-level forests laid out by `jtree.layout.linearize` with a `ContextSplit` whose
cuts fall inside nodes, and slices longer than their pieces (whole gap blocks)."""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jtree.kernels import TreeMask, tree_attention
from jtree.kernels.block_tables import EMPTY, classify_blocks
from jtree.layout.context_rows import ContextSplit
from jtree.layout.linearize import linearize
from jtree.layout.planner import plan_rows
from tests.attention_cases import assert_elementwise_close, qkv
from tests.strategies import explicit_tree, random_forest

BLOCK = 16


def gapped_row(seed: int, context: int = 4, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """(end, valid) [1, context * L] of three random forests split at random cuts over
    `context` slices, each slice at least two blocks longer than its piece."""
    rng = np.random.default_rng(seed)
    trees = [explicit_tree(random_forest(rng, max_nodes=9, max_seg=12)) for _ in range(3)]
    sizes = [t.n_tree_tokens for t in trees]
    n = sum(sizes)
    split = ContextSplit((0, *map(int, np.sort(rng.integers(1, n, context - 1))), n))
    slice_len = block * (-(-int(split.piece_tokens.max()) // block) + 2)
    plan = dataclasses.replace(plan_rows(sizes, context * slice_len, n_rows=1), splits=(split,))
    x = linearize(trees, context * slice_len, plan=plan).inputs
    return x.mask.end, x.valid


def test_gap_blocks_keep_only_their_own_key_blocks():
    end, valid = gapped_row(0)
    plain = classify_blocks(end, BLOCK, BLOCK)
    flagged = classify_blocks(end, BLOCK, BLOCK, q_real=valid)
    live = valid.reshape(1, -1, BLOCK).any(-1)[0]
    np.testing.assert_array_equal(flagged[0, live], plain[0, live])
    # Host `end` with traced flags (the model's valid under jit): the same classes, as jax arrays.
    traced = jax.jit(lambda real: classify_blocks(end, BLOCK, BLOCK, q_real=real))(valid)
    np.testing.assert_array_equal(np.asarray(traced), flagged)
    gaps = np.flatnonzero(~live)
    nonempty = flagged[0, gaps] != EMPTY
    np.testing.assert_array_equal(nonempty, np.eye(len(live), dtype=bool)[gaps])
    # The test means something: without the flag some gap block sees its cut nodes' ancestors.
    assert ((plain[0, gaps] != EMPTY).sum(-1) > 1).any()
    # Rectangular blocks (a gap q-block overlaps two kv-blocks) and a wrong shape.
    wide = classify_blocks(end, 2 * BLOCK, BLOCK, q_real=valid)
    for a in np.flatnonzero(~valid.reshape(1, -1, 2 * BLOCK).any(-1)[0]):
        assert np.flatnonzero(wide[0, a] != EMPTY).tolist() == [2 * a, 2 * a + 1]
    with pytest.raises(ValueError, match="q_real: shape"):
        classify_blocks(end, BLOCK, BLOCK, q_real=valid[:, :-1])


def _run(impl: str, q, k, v, mask: TreeMask, cot, **options):
    out, vjp = jax.vjp(lambda q, k, v: tree_attention(q, k, v, mask, impl=impl, **options),
                       q, k, v)
    return [out, *vjp(cot)]


def _check(got, want, valid, what: str) -> None:
    """Real queries' outputs and dq, and every dk, dv equal; gap outputs finite."""
    real = np.asarray(valid)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        a, b = np.asarray(a), np.asarray(b)
        assert np.isfinite(a).all(), f"{what} {name}"
        if name in ("out", "dq"):
            a, b = a[real], b[real]
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5, err_msg=f"{what} {name}")
        assert_elementwise_close(a, b, np.float32, f"{what} {name}")


@pytest.mark.parametrize("impl", [
    "reference", "xla", "cpu",
    pytest.param("pallas_tpu", marks=pytest.mark.slow),  # its interpreter
    pytest.param("pallas_triton", marks=pytest.mark.slow)])  # its interpreter
def test_real_queries_and_gradients_equal_the_reference(impl):
    tpu = impl == "pallas_tpu"
    block = 128 if tpu else BLOCK
    end, valid = gapped_row(1, block=block)
    q, k, v = qkv(0, 1, end.shape[1], 4, 2, 64 if tpu else 16)
    # The gap outputs are read by nothing: their cotangent is zero.
    cot = jnp.asarray(np.random.default_rng(1).normal(size=q.shape) * valid[..., None, None],
                      q.dtype)
    want = _run("reference", q, k, v, TreeMask(jnp.asarray(end)), cot)
    options = {"reference": {}, "pallas_tpu": {"interpret": True},
               "pallas_triton": {"interpret": True, "block_q": block, "block_kv": block}}.get(
        impl, {"block_q": block, "block_kv": block})
    ctx = pltpu.force_tpu_interpret_mode() if tpu else contextlib.nullcontext()
    with ctx:
        run = jax.jit(lambda q, k, v, end, real, cot: _run(
            impl, q, k, v, TreeMask(end, real=real), cot, **options))
        got = run(q, k, v, jnp.asarray(end), jnp.asarray(valid), cot)
    _check(got, want, valid, impl)


@pytest.mark.parametrize("impl", ["xla", "cpu"])
def test_context_windows_with_gaps(impl):
    """Each device's window of queries (traced offset, its local real flags) over the whole
    gapped row's keys; dk, dv summed over the windows (the gather's transpose)."""
    context = 4
    end, valid = gapped_row(2, context=context)
    s = end.shape[1]
    size = s // context
    q, k, v = qkv(3, 1, s, 4, 2, 16)
    cot = jnp.asarray(np.random.default_rng(1).normal(size=q.shape) * valid[..., None, None],
                      q.dtype)

    @jax.jit
    def window(q_local, k, v, end, real, offset, cot):
        mask = TreeMask(end, query_offset=offset, real=real)
        return _run(impl, q_local, k, v, mask, cot, block_q=BLOCK, block_kv=BLOCK)

    outs, dqs, dk, dv = [], [], 0.0, 0.0
    for w in range(context):
        at = slice(w * size, (w + 1) * size)
        out, dq, dkw, dvw = window(q[:, at], k, v, jnp.asarray(end), jnp.asarray(valid[:, at]),
                                   jnp.int32(w * size), cot[:, at])
        outs.append(out), dqs.append(dq)
        dk, dv = dk + dkw, dv + dvw
    want = _run("reference", q, k, v, TreeMask(jnp.asarray(end)), cot)
    _check([jnp.concatenate(outs, 1), jnp.concatenate(dqs, 1), dk, dv], want, valid, impl)


def test_real_must_match_the_queries():
    q, k, v = qkv(0, 1, 16, 2, 2, 8)
    end = np.arange(1, 17, dtype=np.int32)[None]
    with pytest.raises(ValueError, match="real: shape"):
        tree_attention(q, k, v, TreeMask(end, real=np.ones((1, 8), bool)), impl="xla")
