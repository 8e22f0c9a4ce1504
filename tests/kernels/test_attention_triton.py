"""The Pallas Triton-backend kernels (`pallas_triton`), checked without a GPU:

- numerics in the Pallas interpreter (`interpret=True`) against the float32 dense reference on
  the same (rounded) input values, forward output and q/k/v gradients (prefix k/v too), on random
  forests of several rows: GQA 1/2/4, head_dim 64/128/256, S not a multiple of the block, prefix
  calls, soft-cap, MLA (v's head dim 128 under q/k's 192, which runs zero-padded to 256). Errors
  are relative to the largest reference magnitude of each array:
  <= 1e-5 in float32; in bf16 / f16 <= 4 units of the dtype's rounding (4 x 2^-8, 4 x 2^-11: the
  kernels round P and dS to the dtype before their matmuls and the results once more);
- EMPTY blocks are never loaded (NaN in a branch no query of the other branch sees);
- the kernels lower for CUDA from this CPU host (forward and forward + backward at S=8192):
  three Triton kernel calls, whose Triton IR has matmuls and no atomics (deterministic backward);
- what the kernels cannot honour raises ValueError naming the limit.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtree.kernels import TreeMask, tree_attention
from jtree.kernels.attention.triton import tree_attention_triton
from jtree.kernels.block_tables import EMPTY, FULL, PARTIAL, classify_blocks
from jtree.layout.linearize import linearize
from jtree.trees.tree import TrajectoryTree
from tests.attention_cases import qkv, tree_end
from tests.covering import latin

# Relative bound per dtype (see the module docstring).
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 4 * 2.0 ** -8, jnp.float16: 4 * 2.0 ** -11}


@functools.lru_cache(maxsize=None)
def _kernel_run(p: int, softcap: float | None, options: tuple):
    """(q, k, v, end, cot) on the whole layout -> out and grads through `pallas_triton`; with
    p > 0 the first p keys are a cached prefix (queries only for the rest)."""

    def run(q, k, v, end, cot):
        def attend(q_own, k_own, v_own, pk, pv):
            mask, prefix = TreeMask(end), {}
            if p:
                mask, prefix = TreeMask(end[:, p:], end[:, :p]), dict(prefix_k=pk, prefix_v=pv)
            return tree_attention(q_own, k_own, v_own, mask, impl="pallas_triton",
                                  softcap=softcap, interpret=True, **prefix, **dict(options))

        out, vjp = jax.vjp(attend, q[:, p:], k[:, p:], v[:, p:], k[:, :p], v[:, :p])
        dq, dk, dv, dpk, dpv = vjp(cot.astype(q.dtype))
        return out, dq, jnp.concatenate([dpk, dk], 1), jnp.concatenate([dpv, dv], 1)

    return jax.jit(run)


@functools.lru_cache(maxsize=None)
def _reference_run(p: int, softcap: float | None):
    """The same in float32 with the dense reference on the square layout."""

    def run(q, k, v, end, cot):
        cot = jnp.concatenate([jnp.zeros_like(cot[:, :p]), cot], 1)  # own queries only
        out, vjp = jax.vjp(lambda q, k, v: tree_attention(q, k, v, TreeMask(end), impl="reference",
                                                          softcap=softcap), q, k, v)
        dq, dk, dv = vjp(cot)
        return out[:, p:], dq[:, p:], dk, dv

    return jax.jit(run)


def relative_errors(end, q, k, v, *, p: int = 0, softcap=None, **options) -> list[float]:
    """max |kernel - reference| / max |reference| of out, dq, dk, dv (dk, dv over every key)."""
    cot = jnp.asarray(np.random.default_rng(1).normal(size=(*q[:, p:].shape[:3], v.shape[3])),
                      jnp.float32)
    end = jnp.asarray(end)
    got = _kernel_run(p, softcap, tuple(sorted(options.items())))(q, k, v, end, cot)
    want = _reference_run(p, softcap)(*(x.astype(jnp.float32) for x in (q, k, v)), end, cot)
    return [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)) / jnp.max(jnp.abs(b)))
            for a, b in zip(got, want)]


CASES = [  # hq, hkv, d, dtype, s, p, softcap
    (4, 2, 64, jnp.float32, 100, 0, 20.0),    # GQA 2, S padded 100 -> 128, soft-cap
    (4, 1, 64, jnp.bfloat16, 90, 37, None),   # GQA 4, prefix of 37 keys, bf16
]
# Head dims x dtypes x GQA ratios (hq, hkv) as a Latin square: every pair of the three in 9 cases.
SWEEP = [(hq, hkv, d, dtype, 200, 0, None) for d, dtype, (hq, hkv) in latin(
    (64, 128, 256), (jnp.float32, jnp.bfloat16, jnp.float16), ((2, 2), (4, 2), (4, 1)))] + [
    (4, 2, 128, jnp.float32, 150, 70, 30.0),  # prefix + soft-cap
    (4, 4, 256, jnp.float16, 120, 100, None),  # prefix longer than the own part
    (2, 1, 64, jnp.bfloat16, 130, 60, 20.0),
]


def _check(hq, hkv, d, dtype, s, p, softcap, dv=None, **options):
    end = tree_end(seed=s + p + d, s=p + s, max_trees=16, max_nodes=12, max_seg=40)
    assert end.shape[0] >= 2 and (np.diff(end, axis=1) < 0).any()  # several rows, branches
    q, k, v = qkv(hkv, end.shape[0], p + s, hq, hkv, d, dtype, dv=dv)
    errs = relative_errors(end, q, k, v, p=p, softcap=softcap, **options)
    assert max(errs) <= TOLERANCE[dtype], errs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("hq, hkv, d, dtype, s, p, softcap", CASES)
def test_interpret_matches_reference(hq, hkv, d, dtype, s, p, softcap):
    _check(hq, hkv, d, dtype, s, p, softcap)


@pytest.mark.timeout(300)
def test_interpret_mla_matches_reference():
    """DeepSeek-V3's head dims (q/k 192, v 128) with a prefix and GQA 2."""
    _check(2, 1, 192, jnp.float32, 60, 30, None, dv=128)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("hq, hkv, d, dtype, s, p, softcap", SWEEP)
def test_interpret_sweep(hq, hkv, d, dtype, s, p, softcap):
    _check(hq, hkv, d, dtype, s, p, softcap)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_explicit_blocks_that_differ():
    _check(4, 2, 64, jnp.float32, 250, 0, None, block_q=32, block_kv=128)


@pytest.mark.timeout(300)
def test_empty_blocks_are_never_loaded():
    """A shared 32-token prefix, a 32-token branch A and a 64-token branch B (blocks of 32). A's
    q, k, v are NaN: any load of one of A's blocks for B would make B's results NaN (0 * NaN),
    so B's outputs and gradients are finite and exact only if every kernel skips A for B."""
    tree = TrajectoryTree.from_nodes(parents=[-1, 0, 0, 2], segments=[[3] * 32, [4] * 32,
                                                                       [5] * 24, [6] * 40])
    end = linearize([tree], 128).inputs.mask.end
    classes = classify_blocks(end, 32, 32)[0]
    assert list(classes[2]) == [FULL, EMPTY, PARTIAL, EMPTY]  # B's first q-block skips A
    assert list(classes[:, 1]) == [EMPTY, PARTIAL, EMPTY, EMPTY]  # A's keys: only A's queries
    branch_a, branch_b = slice(32, 64), slice(64, 128)
    q, k, v = qkv(0, 1, 128, 2, 1, 16)
    poison = lambda x: x.at[:, branch_a].set(jnp.nan)

    @jax.jit
    def run(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: tree_attention(
            q, k, v, TreeMask(end), impl="pallas_triton", softcap=10.0, interpret=True,
            block_q=32, block_kv=32), q, k, v)
        return [x[:, branch_b] for x in (out, *vjp(jnp.ones_like(out)))]

    got = run(poison(q), poison(k), poison(v))
    want = run(q, k, v)
    for g, w in zip(got, want):
        assert bool(jnp.isfinite(g).all())
        np.testing.assert_array_equal(g, w)


@pytest.fixture
def triton_modules(monkeypatch):
    """The Triton IR (text) of every kernel the Pallas Triton lowering emits while it is active:
    the custom call carries it as bytecode, so it is read off the (private) lowering function."""
    from jax._src.pallas.triton import lowering

    modules = []
    lower = lowering.lower_jaxpr_to_triton_module

    def recording(*args, **kwargs):
        result = lower(*args, **kwargs)
        modules.append(str(result.module.operation))
        return result

    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", recording)
    return modules


@pytest.mark.parametrize("dtype, hq, hkv, softcap, d, dv", [
    (jnp.bfloat16, 8, 2, 30.0, 128, 128),
    (jnp.float32, 4, 4, None, 128, 128),
    (jnp.bfloat16, 4, 4, None, 192, 128),  # MLA (DeepSeek-V3's dims), q/k padded to 256
])
def test_lowers_for_cuda_at_8k(triton_modules, dtype, hq, hkv, softcap, d, dv):
    """Forward: one Triton kernel call; forward + backward: three (forward, dQ, dK/dV). The
    backward's Triton IR has no atomic operations: each gradient tile is written once."""
    rows, s = 1, 8192
    shapes = [jax.ShapeDtypeStruct((rows, s, h, dim), dtype)
              for h, dim in ((hq, d), (hkv, d), (hkv, dv))]
    shapes.append(jax.ShapeDtypeStruct((rows, s), jnp.int32))
    attend = lambda q, k, v, e: tree_attention(q, k, v, TreeMask(e), impl="pallas_triton",
                                               softcap=softcap)
    loss = lambda q, k, v, e: jnp.sum(attend(q, k, v, e).astype(jnp.float32) ** 2)

    def lowered(f):
        return jax.jit(f).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()

    assert lowered(attend).count("custom_call @__gpu$xla.gpu.triton") == 1
    assert lowered(jax.grad(loss, argnums=(0, 1, 2))).count(
        "custom_call @__gpu$xla.gpu.triton") == 3
    fwd, *backward = triton_modules[1:]  # [0]: the forward lowered alone
    # Matmuls per kernel (2, 3, 4), each twice: the unmasked (FULL) and the masked (PARTIAL) form.
    assert [m.count("tt.dot") for m in (fwd, *backward)] == [4, 6, 8]
    assert not any("atomic" in m for m in triton_modules)


@pytest.mark.parametrize("kw, match", [
    (dict(d=96), "head_dim=96 must be a power of two from 16 to 256"),
    (dict(dv=80), "value head_dim=80 must be a power of two from 16 to 256"),
    (dict(d=320), "head_dim=320 must be a power of two from 16 to 256"),  # pads to 512
    (dict(d=512), "head_dim=512 must be a power of two from 16 to 256"),
    (dict(d=8), "head_dim=8 must be a power of two from 16 to 256"),
    (dict(dtype=jnp.int32), "must all be float32, bfloat16 or float16"),
    (dict(mixed=True), "must all be float32, bfloat16 or float16; got bfloat16, float32"),
    (dict(block_q=48), "block_q=48 must be a power of two >= 16"),
    (dict(block_kv=8), "block_kv=8 must be a power of two >= 16"),
])
def test_rejects_what_it_cannot_run(kw, match):
    q, k, v = qkv(0, 1, 128, 2, 1, kw.get("d", 64), dtype=kw.get("dtype", jnp.float32),
                  dv=kw.get("dv"))
    if kw.get("mixed"):
        q = q.astype(jnp.bfloat16)
    end = np.arange(1, 129, dtype=np.int32)[None]
    blocks = {name: kw[name] for name in ("block_q", "block_kv") if name in kw}
    with pytest.raises(ValueError, match=match):
        tree_attention(q, k, v, TreeMask(end), impl="pallas_triton", **blocks)


def test_unpadded_length_raises_when_called_directly():
    q, k, v = qkv(0, 1, 100, 2, 1, 64)
    end = np.arange(1, 101, dtype=np.int32)[None]
    with pytest.raises(ValueError, match="Sq=100 must be a multiple of block_q=64"):
        tree_attention_triton(q, k, v, end, scale=0.125)
