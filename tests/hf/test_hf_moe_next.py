"""Qwen3-MoE and Qwen3-Next against Hugging Face transformers with the same weights (float32):
logits on a plain sequence within 1e-4 and the router aux loss, which catches math mismatches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtree.config.architectures import Qwen3MoeConfig, Qwen3NextConfig
from jtree.layout.linearize import linearize
from jtree.trees.tree import TrajectoryTree
from tests.hf_util import copy_hf_weights
from tests.models_util import tiny_lm

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.torch_util import (  # noqa: E402
    SPARSE_COMMON, SPARSE_GDN, SPARSE_PARTIAL, SPARSE_THETA, random_sparse_model,
)


def _jtree_model(kind: str):
    kw = dict(SPARSE_COMMON, mlp_only_layers=(1,), rope_theta=SPARSE_THETA)
    if kind == "moe":
        return tiny_lm(Qwen3MoeConfig(**kw), 0)
    return tiny_lm(Qwen3NextConfig(**kw, **SPARSE_GDN, partial_rotary_factor=SPARSE_PARTIAL), 0)


@pytest.mark.parametrize("kind", ["moe", "next"])
def test_logits_and_aux_loss_match_hugging_face(kind):
    hf = random_sparse_model(kind)
    ours = _jtree_model(kind)
    copy_hf_weights(ours, {k: v.numpy() for k, v in hf.state_dict().items()})
    seq = np.random.default_rng(0).integers(0, 64, size=23)
    # Chunks of 8: the recurrence crosses chunk boundaries inside the sequence.
    batch = linearize([TrajectoryTree.from_sequences([seq])], 32, gdn_chunk_size=8)
    out = ours(jax.tree_util.tree_map(jnp.asarray, batch.inputs))
    logits = np.asarray(out.hidden[0, : len(seq)] @ ours.output_embedding())
    with torch.no_grad():
        ref = hf(torch.tensor(seq[None]), output_router_logits=True)
    np.testing.assert_allclose(logits, ref.logits[0].numpy(), atol=1e-4, rtol=0)
    coef = SPARSE_COMMON["router_aux_loss_coef"]
    assert float(out.aux_loss) == pytest.approx(coef * float(ref.aux_loss), rel=1e-5)
