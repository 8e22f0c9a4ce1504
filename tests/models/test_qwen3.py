import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jtree.kernels import TreeMask
from jtree.layout.batch import padding
from jtree.layout.linearize import linearize
from jtree.trees.tree import TrajectoryTree
from tests.models_util import logprob_fn, tiny_config, tiny_lm


def test_parameter_names_follow_hugging_face():
    model = tiny_lm(tiny_config(), 0)
    names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model))}
    assert "model.embed_tokens.embedding" in names
    assert "model.layers.1.self_attn.q_norm.weight" in names
    assert "model.layers.0.mlp.gate_proj.kernel" in names
    assert "lm_head.kernel" in names and "model.norm.weight" in names


def test_tied_embeddings_share_the_output_matrix():
    model = tiny_lm(tiny_config(tie_word_embeddings=True), 0)
    assert model.lm_head is None
    np.testing.assert_array_equal(model.output_embedding(), model.model.embed_tokens.embedding[...].T)


def test_bf16_compute_runs_close_to_fp32():
    batch = linearize([TrajectoryTree.from_sequences([[1, 2, 3, 4], [1, 2, 5, 6, 7]])], 16)
    out = {}
    for dtype in ("float32", "bfloat16"):
        graphdef, params = nnx.split(tiny_lm(tiny_config(), 0, dtype=dtype))
        out[dtype] = np.asarray(logprob_fn(graphdef)(params, batch.inputs))
    assert out["bfloat16"].dtype == np.float32
    np.testing.assert_allclose(out["bfloat16"], out["float32"], atol=0.1)


def test_rope_uses_batch_positions():
    """Same tokens at shifted row offsets but equal `pos` give identical hidden states."""
    model = tiny_lm(tiny_config(), 0)
    tokens = jnp.asarray([[3, 4, 5, 0, 0], [0, 0, 3, 4, 5]], jnp.int32)
    pos = jnp.asarray([[0, 1, 2, 0, 0], [0, 0, 0, 1, 2]], jnp.int32)
    end = jnp.asarray([[3, 3, 3, 4, 5], [1, 2, 5, 5, 5]], jnp.int32)
    inputs = dataclasses.replace(padding(2, 5, score_len=None), tokens=tokens, pos=pos,
                                 mask=TreeMask(end))
    h = model(inputs).hidden
    np.testing.assert_allclose(h[0, :3], h[1, 2:], atol=1e-5)
    assert jax.tree_util.tree_leaves(h)[0].shape == (2, 5, 32)
