"""`tree_attention` dispatch: what `auto` picks, validation of a host `end`, padding of S."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtree.kernels import TreeMask, tree_attention
from jtree.kernels.tree_attention import resolve_impl
from tests.attention_cases import qkv


@pytest.mark.parametrize("backend, dtype, head_dim, impl", [
    ("cpu", jnp.bfloat16, 128, "xla"),
    ("tpu", jnp.float32, 128, "pallas_tpu"),
    ("gpu", jnp.bfloat16, 128, "pallas_mosaic_gpu"),
    ("gpu", jnp.float16, 64, "pallas_mosaic_gpu"),
    ("gpu", jnp.float32, 128, "xla"),  # wgmma has no fp32 operands
    ("gpu", jnp.bfloat16, 256, "xla"),  # the Mosaic backward does not fit shared memory
])
def test_auto_picks_per_backend(backend, dtype, head_dim, impl):
    assert resolve_impl("auto", backend, dtype=dtype, head_dim=head_dim) == impl


@pytest.mark.parametrize("end, match", [
    ([[3, 1, 3]], "row 0, token 1 has end=1; need 1 < end <= S=3"),
    ([[4, 3, 3]], "row 0, token 0 has end=4; need 0 < end <= S=3"),
    ([[1.0, 2.0, 3.0]], "dtype float64 is not an integer type"),
])
def test_rejects_bad_host_end(end, match):
    q, k, v = qkv(0, 1, 3, 2, 1, 8)
    with pytest.raises(ValueError, match=match):
        tree_attention(q, k, v, TreeMask(np.asarray(end)), impl="xla")


def test_padding_tokens_are_invisible():
    """Padding S up to the block: a 3-token input with blocks of 8 equals the reference."""
    q, k, v = qkv(1, 1, 3, 2, 2, 8)
    end = np.array([[3, 2, 3]], np.int32)  # root 0, children 1 and 2
    got = jax.jit(lambda q, k, v: tree_attention(q, k, v, TreeMask(end), impl="xla", block_q=8,
                                                 block_kv=8))(q, k, v)
    want = tree_attention(q, k, v, TreeMask(jnp.asarray(end)), impl="reference")
    assert got.shape == q.shape
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_model_config_rejects_unknown_impl():
    from jtree.models import Qwen3Config

    with pytest.raises(ValueError, match="attention_impl: 'flash' is not one of"):
        Qwen3Config(attention_impl="flash")
