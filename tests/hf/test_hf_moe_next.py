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

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
              router_aux_loss_coef=0.01, output_router_logits=True, tie_word_embeddings=False)
GDN = dict(linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=6,
           linear_num_key_heads=2, linear_num_value_heads=4, shared_expert_intermediate_size=24)
THETA, PARTIAL = 10_000.0, 0.5


def _hf_model(kind: str):
    rope = {"rope_type": "default", "rope_theta": THETA}
    if kind == "moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **COMMON, mlp_only_layers=[1], rope_parameters=rope))
    else:
        model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
            **COMMON, **GDN, mlp_only_layers=[1],
            rope_parameters=dict(rope, partial_rotary_factor=PARTIAL)))
    torch.manual_seed(0)
    with torch.no_grad():  # random everything, so zero-initialized norms cannot hide a mismatch
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if name.endswith("linear_attn.norm.weight") else 0))
    return model.eval()


def _jtree_model(kind: str):
    kw = dict(COMMON, mlp_only_layers=(1,), rope_theta=THETA)
    if kind == "moe":
        return tiny_lm(Qwen3MoeConfig(**kw), 0)
    return tiny_lm(Qwen3NextConfig(**kw, **GDN, partial_rotary_factor=PARTIAL), 0)


@pytest.mark.parametrize("kind", ["moe", "next"])
def test_logits_and_aux_loss_match_hugging_face(kind):
    hf = _hf_model(kind)
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
    assert float(out.aux_loss) == pytest.approx(COMMON["router_aux_loss_coef"] * float(ref.aux_loss),
                                                rel=1e-5)
