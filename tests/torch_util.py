"""transformers models the jtree side is compared with: tiny random Qwen3 checkpoints written by
transformers itself, and their logits. Import after `pytest.importorskip("torch")` and
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
