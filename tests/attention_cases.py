"""Random tree masks and inputs for the attention kernel tests, the comparison against the
dense `reference` implementation (forward output and q/k/v gradients; with a cached prefix,
`prefix_errors`), and the element-wise bound every kernel comparison applies next to its
max-scaled one (`assert_elementwise_close`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jtree.kernels import TreeMask, tree_attention
from jtree.layout.linearize import linearize
from tests.strategies import explicit_tree, random_forest

# Element-wise bound of a kernel's output (or gradient) against its reference, per element:
#     |got - want| <= RTOL * |want| + ATOL_EPS * eps * max |want|
# with eps the machine epsilon of the dtype the kernel computes in. A max-scaled check (max error
# <= tol x max |want|, or an absolute tol on O(1) values) lets an entry much smaller than the
# largest be wrong by far more than its own size times tol; this one bounds each entry by its own
# size. The absolute term is for legitimate rounding near zero: an attention output or gradient
# entry is a sum of O(max)-sized products that may cancel to ~0, and its rounding error is then a
# few eps of the terms, not of the result. Measured on the tests/kernels cases (not slow), float32:
# |got - want| up to 13 eps x max |want| (dk/dv of d=128 rows; most tensors 1-7), the worst
# element at 0.41 of this bound; bfloat16 (cpu vs xla, both bf16): 0.25 of its bound. float32
# RTOL 1e-5 is the triton test's max-scaled tolerance, now per element; 32 eps x max is 3.8e-6 x
# max, 5x below the old absolute 2e-5 on O(1)-max tensors.
ELEMENT_BOUNDS = {  # compute dtype: (RTOL, ATOL_EPS)
    jnp.dtype(jnp.float32): (1e-5, 32),
    jnp.dtype(jnp.bfloat16): (2.0 ** -6, 1),  # 2 ulps of bf16 per element, 1 eps of the max
}


def elementwise_excess(got, want, dtype) -> float:
    """The largest |got - want| / (RTOL * |want| + ATOL_EPS * eps * max |want|) over the
    elements (<= 1: within the element-wise bound), `dtype` the kernel's compute dtype."""
    rtol, atol_eps = ELEMENT_BOUNDS[jnp.dtype(dtype)]
    a, b = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    if a.size == 0:
        return 0.0
    atol = atol_eps * float(jnp.finfo(dtype).eps) * float(np.max(np.abs(b)))
    if atol == 0:  # an all-zero reference: only exact zeros pass
        return 0.0 if np.array_equal(a, b) else float("inf")
    return float(np.max(np.abs(a - b) / (rtol * np.abs(b) + atol)))


def assert_elementwise_close(got, want, dtype, what: str = "") -> None:
    """Every element of `got` within the element-wise bound (ELEMENT_BOUNDS) of `want`."""
    excess = elementwise_excess(got, want, dtype)
    rtol, atol_eps = ELEMENT_BOUNDS[jnp.dtype(dtype)]
    assert excess <= 1.0, (f"{what}: an element is {excess:.3g}x over |got - want| <= {rtol:.3g}"
                           f" |want| + {atol_eps} eps({jnp.dtype(dtype)}) max |want|")


def tree_end(seed: int, s: int, *, rows: int = 3, padding_rows: int = 1, max_trees: int = 12,
             max_nodes: int = 10, max_seg: int = 12) -> np.ndarray:
    """`end` [rows, s] of random multi-level forests packed several per row (DFS order); the last
    `padding_rows` rows hold only padding (end[j] = j + 1)."""
    return packed_forests(seed, s, rows=rows, padding_rows=padding_rows, max_trees=max_trees,
                          max_nodes=max_nodes, max_seg=max_seg).mask.end


def packed_forests(seed: int, s: int, *, rows: int, padding_rows: int, max_trees: int,
                   max_nodes: int, max_seg: int, make=None):
    """The linearized inputs of random forests (`make(rng)`: from_nodes kwargs of one tree,
    default `random_forest`) packed several per row of s tokens, the last `padding_rows` rows
    padding only."""
    make = make or (lambda rng: random_forest(rng, max_nodes=max_nodes, max_seg=max_seg))
    rng = np.random.default_rng(seed)
    trees = []
    for _ in range(max_trees):
        tree = explicit_tree(make(rng))
        if tree.n_tree_tokens <= s and linearize(trees + [tree], s).shape[0] <= rows - padding_rows:
            trees.append(tree)
    return linearize(trees, s, n_rows=rows).inputs


def recorded_tpu_races(monkeypatch) -> list:
    """The TPU interpreter's race-detector states of every kernel launch from now on (private
    jax API: a fresh object per launch, recorded so that all launches can be checked)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter

    launches = []

    class Recording(tpu_interpreter.RaceDetectionState):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            launches.append(self)

    monkeypatch.setattr(tpu_interpreter, "RaceDetectionState", Recording)
    return launches


def qkv(seed: int, rows: int, s: int, hq: int, hkv: int, d: int, dtype=jnp.float32,
        dv: int | None = None):
    """Random q, k [.., d] and v [.., dv] (default d; MLA when they differ)."""
    rng = np.random.default_rng(seed)
    shapes = [(rows, s, hq, d), (rows, s, hkv, d), (rows, s, hkv, dv or d)]
    return [jnp.asarray(rng.normal(size=sh), dtype) for sh in shapes]


@functools.lru_cache(maxsize=None)
def _value_and_vjp(impl: str, softcap: float | None, options: tuple):
    """(q, k, v, end, cotangent) -> (out, dq, dk, dv), plain and jitted; cached so that every
    call with the same shapes reuses one compilation."""

    def run(q, k, v, end, cot):
        out, vjp = jax.vjp(lambda q, k, v: tree_attention(q, k, v, TreeMask(end), impl=impl,
                                                          softcap=softcap,
                                                          **dict(options)), q, k, v)
        return (out, *vjp(cot))

    return run, jax.jit(run)


def max_errors(end: np.ndarray, q, k, v, *, impl: str, jit_end: bool = True,
               softcap: float | None = None, **options) -> tuple[float, list[float]]:
    """Max abs difference of the output and of dq, dk, dv (for a random output cotangent)
    between `impl` and `reference`. With `jit_end`, `end` is a traced argument (as in the model);
    otherwise the host array is a constant of the jitted function (block tables built by numpy)."""
    cot = jnp.asarray(np.random.default_rng(1).normal(size=(*q.shape[:3], v.shape[3])), q.dtype)
    run, run_jit = _value_and_vjp(impl, softcap, tuple(sorted(options.items())))
    if jit_end:
        got = run_jit(q, k, v, jnp.asarray(end), cot)
    else:
        got = jax.jit(lambda q, k, v, cot: run(q, k, v, end, cot))(q, k, v, cot)
    want = _value_and_vjp("reference", softcap, ())[1](q, k, v, jnp.asarray(end), cot)
    diffs = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
             for a, b in zip(got, want)]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert_elementwise_close(a, b, q.dtype, f"{impl} {name}")
    return diffs[0], diffs[1:]


@functools.lru_cache(maxsize=None)
def _prefix_run(impl: str, p: int, softcap: float | None, options: tuple):
    """(q, k, v, end, cot) on the whole layout -> out and grads of the own-query part, computed
    with the prefix API (keys [:p] cached, queries only for [p:])."""

    def run(q, k, v, end, cot):
        def f(q_own, k_own, v_own, pk, pv):
            return tree_attention(q_own, k_own, v_own, TreeMask(end[:, p:], end[:, :p]), impl=impl,
                                  softcap=softcap, prefix_k=pk, prefix_v=pv, **dict(options))

        out, vjp = jax.vjp(f, q[:, p:], k[:, p:], v[:, p:], k[:, :p], v[:, :p])
        dq, dk, dv, dpk, dpv = vjp(cot[:, p:])
        return out, dq, jnp.concatenate([dpk, dk], 1), jnp.concatenate([dpv, dv], 1)

    return jax.jit(run)


@functools.lru_cache(maxsize=None)
def _square_run(p: int, softcap: float | None):
    def run(q, k, v, end, cot):
        cot = cot.at[:, :p].set(0.0)  # only the own queries' outputs count
        out, vjp = jax.vjp(lambda q, k, v: tree_attention(q, k, v, TreeMask(end), impl="reference",
                                                          softcap=softcap), q, k, v)
        dq, dk, dv = vjp(cot)
        return out[:, p:], dq[:, p:], dk, dv

    return jax.jit(run)


def prefix_errors(end, q, k, v, p: int, *, impl: str, softcap=None, **options) -> list[float]:
    """Max abs difference of the output and of dq, dk, dv (for a random output cotangent) between
    `impl` through the prefix API (the first `p` keys a cached prefix, queries only after it) and
    `reference` on the whole square layout of the same tokens, restricted to the queries after
    the prefix; every element within the element-wise bound."""
    cot = jnp.asarray(np.random.default_rng(1).normal(size=(*q.shape[:3], v.shape[3])), q.dtype)
    got = _prefix_run(impl, p, softcap, tuple(sorted(options.items())))(q, k, v, end, cot)
    want = _square_run(p, softcap)(q, k, v, end, cot)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert_elementwise_close(a, b, q.dtype, f"{impl} prefix {name}")
    return [float(jnp.max(jnp.abs(a - b))) for a, b in zip(got, want)]
