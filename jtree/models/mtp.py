"""Multi-token prediction (MTP) on trees: extra heads that predict tokens further ahead, trained on
the tree layout with the main model's mask (docs/design.md, "Multi-token prediction on trees").

Depth-1 MTP at sequence position i reads the main model's final hidden state h_i and the
embedding of token i+1, and predicts token i+2. Indexed by the token whose embedding it reads,
j = i+1, its input is fc([norm_e(emb(t_j)); norm_h(h[pred(j)])]) (Qwen3-Next's order: the
embedding first), where pred(j) is the token before j on its path, the row the main loss scores j
from. Its output at j then scores j's children, exactly as the main model's hidden state at j
does, so the MTP states run one decoder layer on the same DFS layout and tree mask. Depth d
chains depth d-1's output the same way (gathered at pred(j)). A token whose path has fewer than
d tokens above it (pos < d) has no depth-d input: its key is hidden from every other query
(end = j + 1, like padding), and nothing it outputs is scored.

RoPE in the MTP layer uses each token's own path position: attention scores depend only on
position differences, so this is the per-path convention (DeepSeek-V3, Megatron and vLLM rotate
the pair (h_i, t_{i+1}) at position i = pos(j) - 1) shifted by a constant, which changes no score.

Parameter names are Qwen3-Next's / Qwen3.5's `mtp.*` (`pre_fc_norm_embedding`,
`pre_fc_norm_hidden`, `fc`, `layers.N`, `norm`); the head and the embedding are the main
model's. Depth d runs `layers[d - 1]`; the fc and norms are shared by the depths, as in those
checkpoints (which carry `mtp_num_hidden_layers` layers, one on the Hub).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jtree.config.architectures import ATTENTION_MIXERS, DecoderSpec, LayerKind
from jtree.config.runtime import RuntimeConfig
from jtree.kernels import TreeMask
from jtree.models.layers import NORMS, call_layer, linear


def mtp_layer_kind(spec: DecoderSpec) -> LayerKind:
    """The kind of an MTP layer: that of the model's last attention layer (Qwen3-Next's MTP layer
    is a gated full-attention layer with its MoE block; Qwen3.5 dense's has a dense MLP). Only
    an attention mixer (`ATTENTION_MIXERS`) keeps the tree MTP loss the per-path one: a
    recurrent mixer would carry the hidden path starts' inputs into every descendant's state,
    and a layer without a mixer (Nemotron-H's MLP-only layers) mixes no tokens at all."""
    attention = [kind for kind in spec.layers
                 if kind.mixer in ATTENTION_MIXERS and kind.ffn != "none"]
    if not attention:
        raise ValueError("mtp: the model has no attention layer with a feed-forward to build MTP "
                         "layers from (objective.mtp_weight needs one)")
    return attention[-1]


class MultiTokenPredictor(nnx.Module):
    """The MTP modules of `len(layers)` depths (HF `mtp.`): shared input norms and fc, one decoder
    layer per depth (built by the caller, `jtree.models.decoder.CausalLM`), a shared output
    norm."""

    def __init__(self, cfg: Any, runtime: RuntimeConfig, spec: DecoderSpec,
                 layers: Sequence[nnx.Module], *, rngs: nnx.Rngs):
        norm_cls = NORMS[spec.norm]

        def norm() -> nnx.Module:
            return norm_cls(cfg.hidden_size, eps=cfg.rms_norm_eps,
                            param_dtype=runtime.weight_dtype)

        self.pre_fc_norm_embedding = norm()
        self.pre_fc_norm_hidden = norm()
        self.fc = linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False,
                         init_std=cfg.initializer_range, dtype=runtime.compute_dtype,
                         param_dtype=runtime.weight_dtype, rngs=rngs)
        self.layers = nnx.List(list(layers))
        self.norm = norm()
        self.runtime = runtime

    @property
    def depth(self) -> int:
        return len(self.layers)

    def __call__(self, hidden: jax.Array, embedded: jax.Array, pred: jax.Array, pos: jax.Array,
                 inputs: Any) -> tuple[jax.Array, ...]:
        """The output states [rows, S, hidden] of each depth (after `norm`, what the head reads),
        from the main model's final hidden states `hidden`, the token embeddings `embedded`,
        the batch's `pred` and `pos`, and the main model's `LayerInputs` (RoPE tables, mask).
        The state of depth d at token j scores j's children; it is meaningful where pos[j] >= d."""
        if self.runtime.context_axis is not None:
            raise ValueError("objective.mtp_weight: not available under context parallelism "
                             "(a token's pred may sit on another device); set mesh.context=1")
        e = self.pre_fc_norm_embedding(embedded)
        at = jnp.where(pred >= 0, pred, 0)[..., None]
        states, h = [], hidden
        for d, layer in enumerate(self.layers, start=1):
            x = jnp.concatenate([e, self.pre_fc_norm_hidden(
                jnp.take_along_axis(h, at, axis=-2))], axis=-1)
            x = self.fc(x)
            layer_inputs = inputs._replace(mask=without_short_paths(inputs.mask, pos, d))
            x, _, _ = call_layer(layer, x, layer_inputs, None, None, remat=self.runtime.remat)
            h = self.norm(x)
            states.append(h)
        return tuple(states)


def without_short_paths(mask: TreeMask, pos: Any, depth: int) -> TreeMask:
    """`mask` with every key of path position < `depth` seen by itself only (end = j + 1): the
    tokens that have no depth-`depth` MTP input (the first `depth` tokens of each path). Host
    (numpy) masks stay numpy, so kernels can still build their block tables on the host."""
    if mask.prefix_end is not None:
        raise ValueError("objective.mtp_weight: not available with run.mode=redundancy_free "
                         "(a part's first tokens read their pred from a cached prefix)")
    if isinstance(mask.end, np.ndarray) and isinstance(pos, np.ndarray):
        own = np.arange(mask.end.shape[-1], dtype=np.int32) + 1
        end = np.where(pos < depth, own, mask.end).astype(np.int32)
    else:
        own = jnp.arange(mask.end.shape[-1], dtype=jnp.int32) + 1
        end = jnp.where(jnp.asarray(pos) < depth, own, jnp.asarray(mask.end, jnp.int32))
    return dataclasses.replace(mask, end=end)
