"""MLA head dims (DeepSeek-V3, Kimi-K2): v's head dim Dv differs from q's and k's Dk.

Ground truth: a dense formula written here (keys repeated per GQA group, the mask j <= i < end[j]
built from `end`, softmax over the masked scores, Dk**-0.5 as the default scale) and its jax
gradients; `reference`, `xla` and the C++ `cpu` kernel must match it on random branching forests,
with GQA, and through the prefix API (checked against `reference` on the square layout). The
registry says which implementations run Dv != Dk; the others raise naming themselves and both dims,
and `auto` never picks them.
"""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtree.kernels import TreeMask, tree_attention
from jtree.kernels.attention import calibration as attention_calibration
from tests.attention_cases import (
    assert_elementwise_close,
    max_errors,
    prefix_errors,
    qkv,
    tree_end,
)

dispatch = importlib.import_module("jtree.kernels.tree_attention")  # the module, not the function


def dense_attention(q, k, v, end):
    """softmax(q k^T / sqrt(Dk), masked) v with every kv head repeated for its query heads."""
    s, hq, dk = q.shape[1:]
    group = hq // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    visible = (j <= i) & (i < end[:, None, :])  # [rows, S, S]
    scores = jnp.einsum("rihd,rjhd->rhij", q, k) / np.sqrt(dk)
    probs = jax.nn.softmax(jnp.where(visible[:, None], scores, -jnp.inf), axis=-1)
    return jnp.einsum("rhij,rjhd->rihd", probs, v)


def _value_and_grads(f, q, k, v, cot):
    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(cot))


@pytest.mark.parametrize("impl, options", [
    ("reference", {}),
    ("xla", {"block_q": 16, "block_kv": 32, "group": 2}),
    ("cpu", {"block_q": 16, "block_kv": 32, "threads": 2}),
])
@pytest.mark.parametrize("hq, hkv, dk, dv, s", [
    (4, 2, 40, 24, 80),   # GQA 2, S padded to the blocks, widths off the C++ vector tiles
    (2, 1, 192, 128, 64),  # DeepSeek-V3's dims (128 nope + 64 rope, v 128), GQA 2
])
def test_matches_dense_formula(impl, options, hq, hkv, dk, dv, s):
    end = jnp.asarray(tree_end(seed=dk + s, s=s, max_seg=10))
    q, k, v = qkv(3, end.shape[0], s, hq, hkv, dk, dv=dv)
    cot = jnp.asarray(np.random.default_rng(1).normal(size=(*q.shape[:3], dv)), jnp.float32)
    got = jax.jit(lambda q, k, v, end, cot: _value_and_grads(
        lambda q, k, v: tree_attention(q, k, v, TreeMask(end), impl=impl, **options),
        q, k, v, cot))(q, k, v, end, cot)
    want = _value_and_grads(lambda q, k, v: dense_attention(q, k, v, end), q, k, v, cot)
    assert got[0].shape == (*q.shape[:3], dv)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        assert_elementwise_close(a, b, jnp.float32, f"{impl} MLA {name}")


def test_xla_matches_reference_traced_end_and_softcap():
    end = tree_end(seed=7, s=96, max_seg=12)
    q, k, v = qkv(5, end.shape[0], 96, 4, 1, 48, dv=32)
    max_errors(end, q, k, v, impl="xla", block_q=32, block_kv=16, softcap=15.0)


@pytest.mark.parametrize("impl, dk, dv", [("xla", 48, 32), ("xla", 192, 128), ("cpu", 48, 32)])
def test_prefix(impl, dk, dv):
    """Own queries over [prefix | own keys]: prefix_v carries Dv."""
    p, s = 40, 56
    end = jnp.asarray(tree_end(seed=dk, s=p + s, max_seg=12))
    q, k, v = qkv(2, end.shape[0], p + s, 4, 2, dk, dv=dv)
    prefix_errors(end, q, k, v, p, impl=impl, block_q=16, block_kv=16)


def test_impl_without_value_head_dim_raises(monkeypatch):
    impls = dict(dispatch._IMPLS)
    impls["square_only"] = impls["reference"]._replace(value_head_dim=False)
    monkeypatch.setattr(dispatch, "_IMPLS", impls)
    q, k, v = qkv(0, 1, 24, 2, 1, 16, dv=8)
    end = np.full((1, 24), 24, np.int32)
    with pytest.raises(ValueError, match=r"'square_only': value head dim 8 != query/key head dim "
                                         r"16 \(MLA\) not supported"):
        tree_attention(q, k, v, TreeMask(end), impl="square_only")
    with pytest.raises(ValueError, match="'square_only': value head dim 8"):
        tree_attention(q[:, 8:], k[:, 8:], v[:, 8:], TreeMask(end[:, 8:], end[:, :8]),
                       impl="square_only", prefix_k=k[:, :8], prefix_v=v[:, :8])
    tree_attention(q, k, k, TreeMask(end), impl="square_only")  # Dv == Dk runs


def test_auto_picks_only_implementations_that_run_mla(monkeypatch):
    """On CPU `auto` offers only kernels whose registry entry runs Dv != Dk (a kernel without it
    leaves the candidates); on a Hopper GPU an MLA call goes to the Triton kernel, since the
    Mosaic kernel does not run it."""
    mla_cpu = dispatch.cpu_candidates(None, mla=True)
    assert mla_cpu and all(dispatch._IMPLS[n].value_head_dim for n in mla_cpu)
    hopper = "NVIDIA H100 80GB HBM3"
    assert dispatch.gpu_impl(hopper, jnp.bfloat16, 128) == "pallas_mosaic_gpu"
    assert dispatch.gpu_impl(hopper, jnp.bfloat16, 128, 64) == "pallas_triton"
    assert dispatch.resolve_impl("auto", "gpu", dtype=jnp.bfloat16, head_dim=192,
                                 value_head_dim=128, device_kind=hopper) == "pallas_triton"
    impls = dict(dispatch._IMPLS)
    impls["cpu"] = impls["cpu"]._replace(value_head_dim=False)
    monkeypatch.setattr(dispatch, "_IMPLS", impls)
    assert dispatch.cpu_candidates(None, mla=True) == ("xla",)
    assert dispatch.resolve_impl("auto", "cpu", dtype=jnp.float32, head_dim=192,
                                 value_head_dim=128, shape=(8, 1024, 4, 4)) == "xla"


def test_mosaic_gpu_refuses_mla_by_name():
    """wgmma's Mosaic kernel is built for one head dim (64 or 128) of q, k and v alike."""
    q, k, v = qkv(0, 1, 128, 2, 1, 128, dtype=jnp.bfloat16, dv=64)
    end = np.arange(1, 129, dtype=np.int32)[None]
    with pytest.raises(ValueError, match=r"'pallas_mosaic_gpu': value head dim 64 != query/key "
                                         r"head dim 128 \(MLA\) not supported; use one of "
                                         r"'reference', 'xla', 'cpu', 'pallas_tpu', "
                                         r"'pallas_triton'"):
        tree_attention(q, k, v, TreeMask(end), impl="pallas_mosaic_gpu")


def test_bad_shapes():
    q, k, v = qkv(0, 1, 24, 2, 1, 16, dv=8)
    end = np.full((1, 24), 24, np.int32)
    with pytest.raises(ValueError, match="shape mismatch"):
        tree_attention(q, k, jnp.concatenate([v, v], axis=2), TreeMask(end))  # v heads differ
    with pytest.raises(ValueError, match=r"prefix_k, prefix_v must be"):
        tree_attention(q[:, 8:], k[:, 8:], v[:, 8:], TreeMask(end[:, 8:], end[:, :8]),
                       impl="xla", prefix_k=k[:, :8], prefix_v=k[:, :8])  # prefix_v has Dk


def test_calibration_class_carries_the_value_head_dim():
    """An MLA call is measured on its own class, with v of Dv."""
    mla = attention_calibration.ShapeClass.of("cpu", jnp.float32, 1, 64, 2, 1, 48, 32)
    assert mla != attention_calibration.ShapeClass.of("cpu", jnp.float32, 1, 64, 2, 1, 48)
    assert "head_dim 48 (v 32)" in mla.describe()
    shapes = []

    def run(name, q, k, v, end):
        shapes.append((q.shape[3], k.shape[3], v.shape[3]))
        return tree_attention(q, k, v, TreeMask(end), impl=name)

    attention_calibration.measure(mla, ("reference",), run, repeats=1)
    assert set(shapes) == {(48, 48, 32)}
