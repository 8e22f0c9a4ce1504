"""The Pallas TPU kernel (`pallas_tpu`), which cannot run on hardware here:

- numerics in the Pallas interpreter (`interpret=True`) against the dense reference: forward and
  q/k/v gradients on random forests, GQA 1/2/4, head_dim 64 and 128, S padded to the block,
  differing block sizes, soft-cap, a tight block budget; MLA value head dims (Dv != Dk: 64/128,
  and DeepSeek-V3's 192/128 with Dk zero-padded to 256); float32 tolerance 2e-5;
- one small case in the TPU interpreter with race detection (simulated DMAs, two cores) at the
  default blocks, in float32 and in bfloat16 (the production dtype; tolerance BF16_TOL x the
  largest reference magnitude: P and the outputs are rounded to bf16 once each, against the
  float32 reference on the same bf16 values);
- lowering for TPU with `jax.export` at a realistic size. That runs the JAX-side Pallas lowering
  (block shapes, index maps, scalar prefetch, the kernel body into Mosaic MLIR), not the Mosaic
  compiler, so VMEM limits and Mosaic layout support are not checked by it.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jtree.kernels import TreeMask, tree_attention
from jtree.kernels.block_tables import required_blocks
from tests.attention_cases import (
    assert_elementwise_close,
    max_errors,
    qkv,
    recorded_tpu_races,
    tree_end,
)

F32_TOL = 2e-5
BF16_TOL = 1e-2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("hq, hkv, d, s, blocks, softcap, budget", [
    (4, 4, 64, 300, (128, 128), None, False),   # GQA 1, S padded 300 -> 384
    (4, 2, 64, 512, (128, 128), 20.0, True),    # GQA 2, soft-cap, grid shrunk to the budget
    (4, 1, 128, 200, (128, 128), None, False),  # GQA 4, head_dim 128
    (2, 1, 128, 500, (256, 128), None, False),  # q and kv blocks differ, S padded 500 -> 512
])
def test_interpret_matches_reference(hq, hkv, d, s, blocks, softcap, budget):
    end = tree_end(seed=s + d, s=s, max_trees=16, max_nodes=12, max_seg=40)
    q, k, v = qkv(0, end.shape[0], s, hq, hkv, d)
    options = dict(block_q=blocks[0], block_kv=blocks[1], interpret=True)
    if budget:
        options["max_kv_blocks"], options["max_q_blocks"] = required_blocks(end, *blocks)
        assert options["max_kv_blocks"] < s // blocks[1]  # the budget really shrinks the grid
    out_err, grad_errs = max_errors(end, q, k, v, impl="pallas_tpu", softcap=softcap, **options)
    assert out_err <= F32_TOL and max(grad_errs) <= F32_TOL, (out_err, grad_errs)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("hq, hkv, dk, dv, s, softcap", [
    (4, 2, 64, 128, 256, 20.0),    # Dv > Dk, both lane-tiled as they are; soft-cap
    (2, 1, 192, 128, 200, None),   # DeepSeek-V3: Dk 192 runs zero-padded to 256
])
def test_interpret_mla_matches_reference(hq, hkv, dk, dv, s, softcap):
    end = tree_end(seed=s + dk, s=s, max_trees=16, max_nodes=12, max_seg=40)
    q, k, v = qkv(0, end.shape[0], s, hq, hkv, dk, dv=dv)
    max_errors(end, q, k, v, impl="pallas_tpu", softcap=softcap, block_q=128, block_kv=128,
               interpret=True)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_no_races_in_tpu_interpreter(monkeypatch, dtype):
    """Forward, dq and dkv kernels under the TPU interpreter's race detector with two cores (the
    parallel grid axes split between them). The detector's state is private jax API: a fresh
    object per kernel launch, recorded here so all three launches are checked."""
    launches = recorded_tpu_races(monkeypatch)
    # One row: a root of 100 tokens with children of 60 and 96 tokens (FULL, PARTIAL, EMPTY blocks).
    end = np.array([[256] * 100 + [160] * 60 + [256] * 96], np.int32)
    q, k, v = (x.astype(dtype) for x in qkv(3, 1, 256, 2, 1, 64))
    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
    out, vjp = jax.vjp(lambda q, k, v: tree_attention(q, k, v, TreeMask(end), impl="pallas_tpu",
                                                      interpret=params), q, k, v)
    grads = vjp(jnp.ones_like(out))
    jax.block_until_ready(grads)
    assert len(launches) == 3 and not any(r.races_found for r in launches)
    ref, ref_vjp = jax.vjp(lambda q, k, v: tree_attention(q, k, v, TreeMask(end), impl="reference"),
                           *(x.astype(jnp.float32) for x in (q, k, v)))
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads),
                          (ref, *ref_vjp(jnp.ones_like(ref)))):
        assert a.dtype == dtype
        assert_elementwise_close(a, b, dtype, f"pallas_tpu race-free {name}")
        if dtype == jnp.float32:
            np.testing.assert_allclose(a, b, atol=F32_TOL)
        else:
            err = float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)))
            assert err <= BF16_TOL * float(jnp.max(jnp.abs(b))), err


def test_budget_too_small():
    end = tree_end(seed=1, s=512, rows=1, padding_rows=0, max_trees=1, max_nodes=4, max_seg=200)
    need_kv, _ = required_blocks(end, 128, 128)
    q, k, v = qkv(0, 1, 512, 2, 1, 64)
    with pytest.raises(ValueError, match="block budget too small"):
        tree_attention(q, k, v, TreeMask(end), impl="pallas_tpu", max_kv_blocks=need_kv - 1,
                       interpret=True)
    # Under jit the tables are traced and cannot raise: the output is NaN, never silently wrong.
    out = jax.jit(lambda q, k, v, e: tree_attention(q, k, v, TreeMask(e), impl="pallas_tpu",
                                                    interpret=True,
                                                    max_kv_blocks=need_kv - 1))(q, k, v, end)
    assert bool(jnp.isnan(out).all())


@pytest.mark.parametrize("kw, match", [
    (dict(d=96), "head_dim=96 must be 64 or a multiple of 128"),
    (dict(dv=96), "value head_dim=96 must be 64 or a multiple of 128"),
    (dict(dtype=jnp.float16), "must all be float32 or all bfloat16"),
    (dict(block_q=64), "block_q=64 must be a multiple of 128"),
])
def test_rejects_what_it_cannot_run(kw, match):
    q, k, v = qkv(0, 1, 256, 2, 1, kw.get("d", 64), dtype=kw.get("dtype", jnp.float32),
                  dv=kw.get("dv"))
    end = np.arange(1, 257, dtype=np.int32)[None]
    options = {"block_q": kw["block_q"]} if "block_q" in kw else {}
    with pytest.raises(ValueError, match=match):
        tree_attention(q, k, v, TreeMask(end), impl="pallas_tpu", **options)


@pytest.mark.parametrize("d, dv, dtype, hq, hkv", [
    (128, 128, jnp.bfloat16, 8, 2),
    (64, 64, jnp.float32, 4, 4),
    (192, 128, jnp.bfloat16, 4, 4),  # MLA (DeepSeek-V3's dims), Dk padded to 256
])
def test_exports_for_tpu(d, dv, dtype, hq, hkv):
    """Forward + backward lowers for the TPU platform at S=8192: three Mosaic kernels."""
    rows, s = 2, 8192

    def loss(q, k, v, end):
        out = tree_attention(q, k, v, TreeMask(end), impl="pallas_tpu", softcap=30.0)
        return out.astype(jnp.float32).sum()

    shapes = [jax.ShapeDtypeStruct((rows, s, hq, d), dtype),
              jax.ShapeDtypeStruct((rows, s, hkv, d), dtype),
              jax.ShapeDtypeStruct((rows, s, hkv, dv), dtype),
              jax.ShapeDtypeStruct((rows, s), jnp.int32)]
    exported = jax.export.export(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))),
                                 platforms=["tpu"])(*shapes)
    module = exported.mlir_module()
    assert module.count("tpu_custom_call") == 3
    for name in ("tree_attention_fwd", "tree_attention_dq", "tree_attention_dkv"):
        assert re.search(name, module), name
