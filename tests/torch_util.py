"""transformers models the jtree side is compared with: tiny random Qwen3 checkpoints written by
transformers itself, tiny random Qwen3-MoE / Qwen3-Next models, the tiny gpt-oss config, and
their logits. Import after `pytest.importorskip("torch")` and
`pytest.importorskip("transformers")`: this module needs both."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers

VOCAB = 96  # vocabulary of the tiny checkpoints unless a test asks for another
TOL = 1e-4  # float32 jtree vs transformers on CPU: logits, log-probs, relative gradient L2


def write_qwen3_checkpoint(path: Path, *, tie: bool, bias: bool, seed: int = 0,
                           vocab_size: int = VOCAB, **save_kwargs) -> Path:
    """A tiny random transformers Qwen3 (dense) with O(1) logits and non-trivial norm weights,
    saved by `save_pretrained(path, **save_kwargs)`."""
    cfg = transformers.Qwen3Config(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=tie,
        attention_bias=bias, rope_theta=10000.0, rms_norm_eps=1e-6,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.15)
    model.save_pretrained(path, **save_kwargs)
    return path


def torch_logits(model: torch.nn.Module, tokens) -> np.ndarray:
    """[len(tokens), V] logits of one sequence run alone through the transformers model."""
    with torch.no_grad():
        ids = torch.as_tensor(np.asarray(tokens, np.int64))[None]
        return model(input_ids=ids).logits[0].numpy()


# The Qwen3-MoE / Qwen3-Next tests' tiny shapes (tests/hf/test_hf_moe_next.py, test_lora_peft.py).
SPARSE_COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                     router_aux_loss_coef=0.01, output_router_logits=True,
                     tie_word_embeddings=False)
SPARSE_GDN = dict(linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=6,
                  linear_num_key_heads=2, linear_num_value_heads=4,
                  shared_expert_intermediate_size=24)
SPARSE_THETA, SPARSE_PARTIAL = 10_000.0, 0.5


def random_sparse_model(kind: str):
    """A tiny transformers Qwen3-MoE (`kind` "moe") or Qwen3-Next ("next") with every parameter
    random (std 0.3; the GDN norm around 1), so zero-initialized norms cannot hide a mismatch."""
    rope = {"rope_type": "default", "rope_theta": SPARSE_THETA}
    if kind == "moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **SPARSE_COMMON, mlp_only_layers=[1], rope_parameters=rope))
    else:
        model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
            **SPARSE_COMMON, **SPARSE_GDN, mlp_only_layers=[1],
            rope_parameters=dict(rope, partial_rotary_factor=SPARSE_PARTIAL)))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            centre = 1.0 if name.endswith("linear_attn.norm.weight") else 0.0
            p.copy_(torch.randn_like(p) * 0.3 + centre)
    return model.eval()


GPT_OSS_YARN = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "beta_fast": 32.0,
                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}


def gpt_oss_config(**overrides):
    """The tiny transformers `GptOssConfig` of the gpt-oss tests: [sliding, full, sliding] layers
    with a window of 4, 4 experts (top 2) with SwiGLU limit 1.0, YaRN (`GPT_OSS_YARN`), the router
    loss on."""
    return transformers.GptOssConfig(**dict(dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=4, swiglu_limit=1.0, rms_norm_eps=1e-5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=256, rope_parameters=GPT_OSS_YARN, tie_word_embeddings=False,
        output_router_logits=True, router_aux_loss_coef=0.01), **overrides))
