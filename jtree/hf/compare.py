"""jtree on trees vs transformers on paths, on the same checkpoint: where do they differ?

The tree side runs the linearized trees once (forward, and the gradient of the tree loss
sum_t W_t * (-log p_t)); the PyTorch side runs every path as its own sequence and backpropagates the
per-path loss sum_p sum_t c[p,t] * (-log p_t). Equal math gives equal logits on every path
position, equal log-probs, and equal gradients. Differences are reported per block type of the
decoder layers (token mixers "full_attention" / "linear_attention" with their input norm,
feed-forwards "moe" / "mlp" with theirs: block outputs and parameter gradients) and overall
(logits, log-probs, gradients).

MoE models with `output_router_logits` add the router load-balancing loss. HF defines it per
forward pass, pooled over the batch's tokens; jtree's tree loss weights each tree token by the
number of paths through it, so it equals HF's loss on one batch holding every path (padded and
masked). The PyTorch side adds exactly that term: one extra forward/backward of all paths batched.
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

from jtree.config.objective import Normalization, Objective
from jtree.config.run import DEFAULT_CHUNK_SIZE
from jtree.hf import torch_reference
from jtree.hf.load_save import to_hf_tensors
from jtree.layout.coefficients import batch_normalizer, path_coefficients
from jtree.layout.linearize import TreeBatch, linearize, unlinearize
from jtree.objectives.logprobs import logprobs_from_hidden
from jtree.objectives.objective import objective_loss
from jtree.trees.tree import TrajectoryTree

LAYER_PART = re.compile(r"model\.layers\.(\d+)\.(\w+)")
# The blocks whose outputs are compared (HF and jtree module names alike).
BLOCK = re.compile(r"model\.layers\.\d+\.(self_attn|linear_attn|mlp)")
FFN_PARTS = ("mlp", "post_attention_layernorm")
NON_LAYER_GROUP = "embeddings+head"
# Report groups of the layer kinds (`jtree.config.architectures.LayerKind`), in HF's words.
MIXER_GROUP = {"attention": "full_attention", "sliding_attention": "sliding_attention",
               "gated_attention": "full_attention",
               "gated_deltanet": "linear_attention"}
FFN_GROUP = {"mlp": "mlp", "moe": "moe", "moe_shared": "moe"}


@dataclasses.dataclass(frozen=True)
class Tolerances:
    """docs/design.md section 9: logits vs Hugging Face within 1e-4 (float32); log-probs and relative
    per-tensor gradients are held to the same 1e-4 against PyTorch (`jtree compare-torch`'s
    defaults)."""

    logits: float = 1e-4
    logprobs: float = 1e-4
    grads: float = 1e-4


@dataclasses.dataclass
class GroupReport:
    """Differences for the blocks of one type (or the non-layer parameters)."""

    layers: int = 0  # decoder layers holding a block of this type
    tensors: int = 0
    max_abs_output: float = 0.0  # max |block output difference| over the group's blocks
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
    tree_aux_loss: float  # router_aux_loss_coef * load-balancing loss (0 when off)
    path_aux_loss: float

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
    """Tree-mode hidden states, block outputs, log-probs, aux loss, tree loss and its gradients,
    from one compiled forward and backward."""
    graphdef, params = nnx.split(model, nnx.Param)
    (loss, (hidden, blocks, logp, aux)), grads = _loss_and_grad(graphdef, normalization)(
        params, batch.inputs)
    return (np.asarray(hidden), {k: np.asarray(v) for k, v in blocks.items()}, np.asarray(logp),
            float(aux), float(loss), grads)


def _first_output(value: Any) -> Any:
    """The array a module returned on its first call (captures hold one entry per call; MoE
    blocks and layers return (output, router stats))."""
    while isinstance(value, tuple):
        value = value[0]
    return value


class _Recording:
    """The model as `objective_loss` calls it, keeping its output and its blocks' outputs."""

    def __init__(self, model: nnx.Module):
        self.model, self.out, self.blocks = model, None, {}

    def __call__(self, inputs):
        capture = nnx.capture(self.model, nnx.Intermediate, method_outputs=nnx.Intermediate)
        self.out, intermediates = capture(inputs)
        for path, var in nnx.to_flat_state(intermediates):
            name = ".".join(str(p) for p in path[:-1])
            if path[-1] == "__call__" and BLOCK.fullmatch(name):
                self.blocks[name] = _first_output(var.get_value())
        return self.out

    @property
    def runtime(self):
        return self.model.runtime

    def output_embedding(self):
        return self.model.output_embedding()


@functools.lru_cache(maxsize=4)
def _loss_and_grad(graphdef: nnx.GraphDef, normalization: Normalization):
    objective = Objective(kind="sft", normalization=normalization)

    def loss(params, inputs):
        model = _Recording(nnx.merge(graphdef, params))
        value, metrics = objective_loss(model, inputs, objective)
        logp, _ = logprobs_from_hidden(model.out.hidden, model.output_embedding(),
                                       inputs.tokens, inputs.pred)
        return value, (model.out.hidden, model.blocks, logp, metrics["aux_loss"])

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


def _group_of(name: str, layer_types: Sequence[str], ffn_types: Sequence[str]) -> str:
    m = LAYER_PART.match(name)
    if m is None:
        return NON_LAYER_GROUP
    layer = int(m.group(1))
    return ffn_types[layer] if m.group(2) in FFN_PARTS else layer_types[layer]


def compare(
    model: nnx.Module,
    config: Any,
    torch_model: Any,
    trees: Sequence[TrajectoryTree],
    *,
    normalization: Normalization = "seq_mean_token_mean",
    gdn_chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Comparison:
    """Run `trees` through the jtree `model` and every path through `torch_model` (same weights).

    `gdn_chunk_size` is the chunk length of the gated delta rule on trees (linear-attention
    layers only)."""
    spec = config.decoder()
    unnamed = ({k.mixer for k in spec.layers} - set(MIXER_GROUP)
               | {k.ffn for k in spec.layers} - set(FFN_GROUP))
    if unnamed:
        raise ValueError(f"compare-torch: layer kind {min(unnamed)!r} is not supported yet (its "
                         "blocks are not named as transformers names them)")
    layer_types = [MIXER_GROUP[kind.mixer] for kind in spec.layers]
    ffn_types = [FFN_GROUP[kind.ffn] for kind in spec.layers]
    seq_len = -(-max(t.n_tree_tokens for t in trees) // 16) * 16
    chunks = gdn_chunk_size if spec.needs_gdn_tables else None
    batch = linearize(trees, seq_len, normalization=normalization, gdn_chunk_size=chunks)
    hidden, block_out, logp_tree, tree_aux, tree_loss, grads = _jtree_side(model, batch,
                                                                          normalization)
    w_out = np.asarray(model.output_embedding(), np.float32)
    logp_paths = unlinearize(batch, logp_tree)
    normalizer = batch_normalizer(trees, normalization)
    groups = {t: GroupReport() for t in dict.fromkeys(layer_types + ffn_types)}
    groups[NON_LAYER_GROUP] = GroupReport()
    for t in layer_types + ffn_types:
        groups[t].layers += 1
    max_logits = max_logp = 0.0
    path_loss, n_paths, n_tokens = 0.0, 0, 0
    torch_reference.zero_grads(torch_model)
    layout = batch.layout
    for tree, row, off, tree_logp in zip(trees, layout.rows, layout.offsets, logp_paths):
        coeffs = path_coefficients(tree, normalization, normalizer)
        for p in range(tree.n_paths):
            ref = torch_reference.run_path(torch_model, tree.path_tokens(p),
                                           coefficients=coeffs[p], module_names=list(block_out))
            at = off + tree.path_token_index(p)
            logits = hidden[row, at].astype(np.float32) @ w_out
            max_logits = max(max_logits, float(np.abs(logits - ref.logits).max()))
            max_logp = max(max_logp, float(np.abs(tree_logp[p] - ref.logprobs).max()))
            for name, value in block_out.items():
                g = groups[_group_of(name, layer_types, ffn_types)]
                diff = float(np.abs(value[row, at] - ref.module_outputs[name]).max())
                g.max_abs_output = max(g.max_abs_output, diff)
            path_loss += float(-(coeffs[p] * ref.logprobs).sum())
            n_paths += 1
            n_tokens += len(at)
    path_aux = 0.0
    if "moe" in ffn_types and config.output_router_logits:
        path_aux = torch_reference.backprop_router_aux_loss(
            torch_model, [t.path_tokens(p) for t in trees for p in range(t.n_paths)])
        path_loss += path_aux
    torch_grads = torch_reference.grads(torch_model)
    # Experts in the layout transformers holds them (fused in transformers 5).
    jtree_grads = to_hf_tensors(grads, config, names=frozenset(torch_grads))
    if set(jtree_grads) != set(torch_grads):
        odd = sorted(set(jtree_grads) ^ set(torch_grads))[0]
        side = "jtree" if odd in jtree_grads else "transformers"
        raise ValueError(f"parameter {odd!r} exists only on the {side} side")
    worst, worst_rel = "", 0.0
    for name, g_torch in torch_grads.items():
        rel = _relative_difference(jtree_grads[name], g_torch)
        group = groups[_group_of(name, layer_types, ffn_types)]
        group.tensors += 1
        if not rel <= group.max_rel_grad:
            group.max_rel_grad, group.worst_tensor = rel, name
        if not rel <= worst_rel:
            worst_rel, worst = rel, name
    return Comparison(groups, n_paths, n_tokens, max_logits, max_logp, worst_rel, worst,
                      tree_loss, path_loss, tree_aux, path_aux)


def _relative_difference(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    diff, scale = np.linalg.norm(a - b), np.linalg.norm(b)
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return float(diff / scale)
