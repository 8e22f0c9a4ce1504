"""The PyTorch reference: the transformers model of a checkpoint, run on one path at a time.

This is the per-path baseline the tree computation must reproduce: every path is its own
sequence, its loss is the per-path sum sum_t c[p,t] * (-log p_t), and gradients accumulate over
paths in PyTorch. torch and transformers are imported lazily (they are test/compare
dependencies, not runtime ones).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def load_torch_model(directory: str | Path) -> Any:
    """The checkpoint in transformers on CPU in float32 with eager attention, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@dataclasses.dataclass(frozen=True)
class PathOutputs:
    """One path through the reference model: logits [L, V], log p of each token given its prefix
    [L] (0 at position 0, which nothing scores), and the outputs [L, d] of the named modules."""

    logits: np.ndarray
    logprobs: np.ndarray
    module_outputs: dict[str, np.ndarray]


def run_path(
    model: Any,
    tokens: np.ndarray,
    *,
    coefficients: np.ndarray | None = None,
    module_names: Sequence[str] = (),
) -> PathOutputs:
    """Forward one sequence; with `coefficients` (per token, like `jtree.layout.coefficients.path_coefficients`)
    also backpropagate this path's loss -sum_t c_t log p_t, accumulating into `.grad`."""
    import torch

    captured: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def record(module, args, output):
            captured[name] = (output[0] if isinstance(output, tuple) else output).detach()

        return record

    handles = [model.get_submodule(n).register_forward_hook(hook(n)) for n in module_names]
    try:
        with torch.set_grad_enabled(coefficients is not None):
            ids = torch.as_tensor(np.asarray(tokens, np.int64))[None]
            logits = model(input_ids=ids, use_cache=False).logits[0].float()
            logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[0, 1:, None])[:, 0]
            if coefficients is not None:
                c = torch.as_tensor(np.asarray(coefficients, np.float32)[1:])
                (-(c * logp).sum()).backward()
    finally:
        for h in handles:
            h.remove()
    logprobs = np.concatenate([[0.0], logp.detach().numpy()]).astype(np.float32)
    return PathOutputs(
        logits.detach().numpy(), logprobs,
        {n: captured[n][0].numpy() for n in module_names},
    )


def backprop_router_aux_loss(model: Any, paths: Sequence[np.ndarray]) -> float:
    """The router load-balancing term of HF's loss, `router_aux_loss_coef * aux_loss`, for one
    forward of all `paths` as a batch (right-padded, padding masked out, as HF pools it);
    backpropagated into `.grad`. Returns its value."""
    import torch

    length = max(len(p) for p in paths)
    ids = torch.zeros((len(paths), length), dtype=torch.int64)
    mask = torch.zeros((len(paths), length), dtype=torch.int64)
    for i, p in enumerate(paths):
        ids[i, : len(p)] = torch.as_tensor(np.asarray(p, np.int64))
        mask[i, : len(p)] = 1
    out = model(input_ids=ids, attention_mask=mask, output_router_logits=True, use_cache=False)
    term = model.config.router_aux_loss_coef * out.aux_loss
    term.backward()
    return float(term.detach())


def zero_grads(model: Any) -> None:
    model.zero_grad(set_to_none=True)


def grads(model: Any) -> dict[str, np.ndarray]:
    """Accumulated gradients by HF parameter name (tied parameters appear once)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = (np.zeros(tuple(p.shape), np.float32) if p.grad is None
                     else p.grad.detach().float().numpy())
    return out
