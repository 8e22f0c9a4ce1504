"""jtree on trees vs transformers on paths, on the same checkpoint: where do they differ?

The tree side runs the linearized trees once (forward, and the gradient of the tree loss
sum_t W_t * (-log p_t)); the PyTorch side runs every path as its own sequence and backpropagates the
per-path loss sum_p sum_t c[p,t] * (-log p_t). Equal math gives equal logits on every path
position, equal log-probs, and equal gradients. Differences are reported per decoder layer type
(outputs of the layers, gradients of their parameters) and overall (logits, log-probs, gradients).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from jtree.hf import torch_reference
from jtree.hf.architectures import architecture_of_config
from jtree.hf.checkpoint import to_hf_tensors
from jtree.linearize import TreeBatch, linearize, unlinearize
from jtree.logprobs import logprobs_from_hidden
from jtree.loss import Normalization, batch_normalizer, path_coefficients
from jtree.train import Objective, objective_loss
from jtree.tree import TrajectoryTree

LAYER = re.compile(r"model\.layers\.(\d+)")
NON_LAYER_GROUP = "embeddings+head"


@dataclasses.dataclass(frozen=True)
class Tolerances:
    """DESIGN.md section 9: logits vs Hugging Face within 1e-4 (float32); log-probs and relative
    per-tensor gradients are held to the same 1e-4 against PyTorch (`jtree compare-torch`'s
    defaults)."""

    logits: float = 1e-4
    logprobs: float = 1e-4
    grads: float = 1e-4


@dataclasses.dataclass
class GroupReport:
    """Differences for the decoder layers of one type (or the non-layer parameters)."""

    layers: int = 0
    tensors: int = 0
    max_abs_hidden: float = 0.0  # max |layer output difference| over layers of the group
    max_rel_grad: float = 0.0  # max over tensors of ||g_jtree - g_torch|| / ||g_torch||
    worst_tensor: str = ""


@dataclasses.dataclass
class Comparison:
    groups: dict[str, GroupReport]
    paths: int
    tokens: int
    max_abs_logits: float
    max_abs_logprobs: float
    max_rel_grad: float
    worst_tensor: str
    tree_loss: float
    path_loss: float

    def failures(self, tol: Tolerances) -> list[str]:
        out = []
        for what, value, limit in (("max |logit diff|", self.max_abs_logits, tol.logits),
                                   ("max |log-prob diff|", self.max_abs_logprobs, tol.logprobs),
                                   ("max relative grad diff", self.max_rel_grad, tol.grads)):
            if not value <= limit:  # also catches NaN
                out.append(f"{what} {value:.3e} > {limit:.0e}")
        return out

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _jtree_side(model: nnx.Module, batch: TreeBatch, normalization: Normalization):
    """Tree-mode hidden states, decoder-layer outputs, log-probs and tree-loss gradients."""
    graphdef, params = nnx.split(model, nnx.Param)
    forward, loss_grad = _jitted(graphdef, normalization)
    inputs = batch.arrays()
    hidden, layers, logp = forward(params, inputs)
    loss, grads = loss_grad(params, inputs)
    return np.asarray(hidden), {k: np.asarray(v) for k, v in layers.items()}, np.asarray(logp), \
        float(loss), grads


@functools.lru_cache(maxsize=4)
def _jitted(graphdef: nnx.GraphDef, normalization: Normalization):
    def forward(params, inputs):
        model = nnx.merge(graphdef, params)
        capture = nnx.capture(model, nnx.Intermediate, method_outputs=nnx.Intermediate)
        out, intermediates = capture(inputs)
        # Keep only decoder-layer outputs; jit drops every other captured value.
        layers = {}
        for path, var in nnx.to_flat_state(intermediates):
            name = ".".join(str(p) for p in path[:-1])
            if path[-1] == "__call__" and LAYER.fullmatch(name):
                value = var.get_value()
                layers[name] = value[0] if isinstance(value, tuple) else value
        logp, _ = logprobs_from_hidden(out.hidden, model.output_embedding(), inputs["tokens"],
                                       inputs["pred"])
        return out.hidden, layers, logp

    objective = Objective(kind="sft", normalization=normalization)

    def loss(params, inputs):
        return objective_loss(nnx.merge(graphdef, params), inputs, objective)[0]

    return jax.jit(forward), jax.jit(jax.value_and_grad(loss))


def _group_of(name: str, layer_types: Sequence[str]) -> str:
    m = LAYER.match(name)
    return layer_types[int(m.group(1))] if m else NON_LAYER_GROUP


def compare(
    model: nnx.Module,
    config: Any,
    torch_model: Any,
    trees: Sequence[TrajectoryTree],
    *,
    normalization: Normalization = "seq_mean_token_mean",
) -> Comparison:
    """Run `trees` through the jtree `model` and every path through `torch_model` (same weights)."""
    arch = architecture_of_config(config)
    layer_types = list(arch.layer_types(config))
    seq_len = -(-max(t.n_tree_tokens for t in trees) // 16) * 16
    batch = linearize(trees, seq_len, normalization=normalization)
    hidden, layer_out, logp_tree, tree_loss, grads = _jtree_side(model, batch, normalization)
    w_out = np.asarray(model.output_embedding(), np.float32)
    logp_paths = unlinearize(batch, logp_tree)
    normalizer = batch_normalizer(trees, normalization)
    groups = {t: GroupReport() for t in dict.fromkeys(layer_types)}
    groups[NON_LAYER_GROUP] = GroupReport()
    for t in layer_types:
        groups[t].layers += 1
    max_logits = max_logp = 0.0
    path_loss, n_paths, n_tokens = 0.0, 0, 0
    torch_reference.zero_grads(torch_model)
    layout = batch.layout
    for tree, row, off, tree_logp in zip(trees, layout.rows, layout.offsets, logp_paths):
        coeffs = path_coefficients(tree, normalization, normalizer)
        for p in range(tree.n_paths):
            ref = torch_reference.run_path(torch_model, tree.path_tokens(p),
                                           coefficients=coeffs[p], module_names=list(layer_out))
            at = off + tree.path_token_index(p)
            logits = hidden[row, at].astype(np.float32) @ w_out
            max_logits = max(max_logits, float(np.abs(logits - ref.logits).max()))
            max_logp = max(max_logp, float(np.abs(tree_logp[p] - ref.logprobs).max()))
            for name, value in layer_out.items():
                g = groups[_group_of(name, layer_types)]
                diff = float(np.abs(value[row, at] - ref.module_outputs[name]).max())
                g.max_abs_hidden = max(g.max_abs_hidden, diff)
            path_loss += float(-(coeffs[p] * ref.logprobs).sum())
            n_paths += 1
            n_tokens += len(at)
    jtree_grads = to_hf_tensors(grads, config)
    torch_grads = torch_reference.grads(torch_model)
    if set(jtree_grads) != set(torch_grads):
        odd = sorted(set(jtree_grads) ^ set(torch_grads))[0]
        side = "jtree" if odd in jtree_grads else "transformers"
        raise ValueError(f"parameter {odd!r} exists only on the {side} side")
    worst, worst_rel = "", 0.0
    for name, g_torch in torch_grads.items():
        rel = _relative_difference(jtree_grads[name], g_torch)
        group = groups[_group_of(name, layer_types)]
        group.tensors += 1
        if not rel <= group.max_rel_grad:
            group.max_rel_grad, group.worst_tensor = rel, name
        if not rel <= worst_rel:
            worst_rel, worst = rel, name
    return Comparison(groups, n_paths, n_tokens, max_logits, max_logp, worst_rel, worst,
                      tree_loss, path_loss)


def _relative_difference(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    diff, scale = np.linalg.norm(a - b), np.linalg.norm(b)
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return float(diff / scale)
