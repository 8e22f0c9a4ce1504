"""Attention with a cached prefix (redundancy-free parts): own queries over [prefix keys | own keys].

Ground truth: the dense reference on the whole square layout of P + S tokens, restricted to the
queries after the prefix. Outputs and the gradients of q, own k/v and prefix k/v must match for
`xla` (several block shapes, GQA, padded lengths, traced and host `end`) and for `pallas_tpu` in
the Pallas interpreter; an implementation without prefix support raises.
"""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtree.kernels import TreeMask, tree_attention
from tests.attention_cases import assert_elementwise_close, prefix_errors, qkv, tree_end

F32_TOL = 2e-5
dispatch = importlib.import_module("jtree.kernels.tree_attention")  # the module, not the function


@pytest.mark.parametrize("hq, hkv, d, s, p, blocks, softcap", [
    (4, 2, 32, 100, 37, (32, 32), None),     # P and S not multiples of the blocks
    (4, 4, 32, 120, 64, (16, 32), 20.0),     # differing blocks, soft-cap
    (8, 2, 64, 72, 100, (None, None), None),  # prefix longer than the own part, default blocks
])
def test_xla_matches_reference(hq, hkv, d, s, p, blocks, softcap):
    end = tree_end(seed=s + p, s=p + s, max_seg=20)
    q, k, v = qkv(0, end.shape[0], p + s, hq, hkv, d)
    errs = prefix_errors(jnp.asarray(end), q, k, v, p, impl="xla", softcap=softcap,
                         block_q=blocks[0], block_kv=blocks[1])
    assert max(errs) <= F32_TOL, errs


def test_host_end_and_reference():
    """Host (numpy) `end`: the block tables of the rectangular layout are built by numpy."""
    end = tree_end(seed=4, s=100, rows=2)
    q, k, v = qkv(2, end.shape[0], 100, 2, 1, 16)
    p = 50
    for impl, options in (("xla", {"block_q": 16}), ("reference", {})):
        out = tree_attention(q[:, p:], k[:, p:], v[:, p:], TreeMask(end[:, p:], end[:, :p]),
                             impl=impl, prefix_k=k[:, :p], prefix_v=v[:, :p], **options)
        want = tree_attention(q, k, v, TreeMask(end), impl="reference")[:, p:]
        np.testing.assert_allclose(out, want, atol=F32_TOL)
        assert_elementwise_close(out, want, jnp.float32, f"{impl} host-end prefix out")


@pytest.mark.timeout(300)
def test_pallas_tpu_interpret_matches_reference():
    p, s = 150, 256
    end = tree_end(seed=9, s=p + s, rows=2, max_trees=8, max_nodes=10, max_seg=60)
    q, k, v = qkv(1, end.shape[0], p + s, 4, 2, 64)
    errs = prefix_errors(jnp.asarray(end), q, k, v, p, impl="pallas_tpu", interpret=True)
    assert max(errs) <= F32_TOL, errs


def test_exports_for_tpu_with_prefix():
    """The rectangular kernels lower for TPU (JAX-side Mosaic lowering) at a realistic size."""
    rows, p, s, hq, hkv, d = 1, 3000, 4096, 8, 2, 128

    def loss(q, k, v, pk, pv, end, pend):
        out = tree_attention(q, k, v, TreeMask(end, pend), impl="pallas_tpu", prefix_k=pk,
                             prefix_v=pv)
        return out.astype(jnp.float32).sum()

    bf = jnp.bfloat16
    shapes = [jax.ShapeDtypeStruct((rows, s, hq, d), bf),
              jax.ShapeDtypeStruct((rows, s, hkv, d), bf),
              jax.ShapeDtypeStruct((rows, s, hkv, d), bf),
              jax.ShapeDtypeStruct((rows, p, hkv, d), bf),
              jax.ShapeDtypeStruct((rows, p, hkv, d), bf),
              jax.ShapeDtypeStruct((rows, s), jnp.int32),
              jax.ShapeDtypeStruct((rows, p), jnp.int32)]
    exported = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))),
                                 platforms=["tpu"])(*shapes)
    assert exported.mlir_module().count("tpu_custom_call") == 3


def test_impl_without_prefix_support_raises(monkeypatch):
    impls = dict(dispatch._IMPLS)
    impls["no_prefix"] = dispatch._Impl(impls["reference"].run, None)
    monkeypatch.setattr(dispatch, "_IMPLS", impls)
    q, k, v = qkv(0, 1, 24, 2, 1, 8)
    end = np.full((1, 24), 24, np.int32)
    tree_attention(q, k, v, TreeMask(end), impl="no_prefix")  # fine without a prefix
    with pytest.raises(ValueError, match="'no_prefix': prefix not supported"):
        tree_attention(q[:, 8:], k[:, 8:], v[:, 8:], TreeMask(end[:, 8:], end[:, :8]),
                       impl="no_prefix", prefix_k=k[:, :8], prefix_v=v[:, :8])


def test_bad_prefix_inputs():
    q, k, v = qkv(0, 1, 24, 2, 1, 8)
    end = np.full((1, 24), 24, np.int32)
    with pytest.raises(ValueError, match="give all of prefix_k, prefix_v and mask.prefix_end"):
        tree_attention(q[:, 8:], k[:, 8:], v[:, 8:], TreeMask(end[:, 8:]), prefix_k=k[:, :8])
    with pytest.raises(ValueError, match="prefix_end: shape"):
        tree_attention(q[:, 8:], k[:, 8:], v[:, 8:], TreeMask(end[:, 8:], end[:, :7]),
                       prefix_k=k[:, :8], prefix_v=v[:, :8])
    bad = end.copy()
    bad[0, 3] = 2
    with pytest.raises(ValueError, match="row 0, prefix key 3 has end=2"):
        tree_attention(q[:, 8:], k[:, 8:], v[:, 8:], TreeMask(bad[:, 8:], bad[:, :8]),
                       prefix_k=k[:, :8], prefix_v=v[:, :8])
