"""What a part of a tree reads from the tokens above it, and what it hands on (redundancy-free
partitioning, `jtree.partitioning.redundancy_free`).

A part's own tokens hang below a chain of tokens (its *prefix*) that earlier parts computed. Every
model of the family can be called as `model(inputs, prefix=...)` with one cache entry per decoder
layer, and always returns the same entries for its own tokens as `ModelOutput.exports`, from which
the next parts' prefixes are gathered:

- full-attention layers: `AttentionCache` — the keys (after q/k norm and RoPE) and values;
- Gated DeltaNet layers: `GdnCache` — the pre-conv activations (the conv's left context) and the
  recurrent state: for a prefix, the state after its last token (what the part's subtrees start
  from) and the activations of its last K - 1 tokens; as exports, every own token's activations
  and the states after the tokens listed in the batch's `gdn.export_slots` (Mamba2 layers alike:
  their pre-conv [x, B, C] and state);
- layers without a token mixer (Nemotron-H's MLP layers): None.

The layout of the prefix comes with the batch (`jtree.partitioning.redundancy_free.layout`): `mask.prefix_end` [R, P]
and `prefix_pred` [R, P] in the part's combined coordinates (prefix token j at j, own token i at
P + i), and `mask.end`, `pred` of the own tokens in the same coordinates.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Union

import jax

from jtree.kernels import TreeMask
from jtree.layout.batch import DeviceBatch


class AttentionCache(NamedTuple):
    """Keys and values [R, n, Hkv, D] of n tokens of one attention layer."""

    k: jax.Array
    v: jax.Array


class GdnCache(NamedTuple):
    """Pre-conv activations [R, n, conv_dim] and recurrent state(s) of one Gated DeltaNet layer:
    [R, Hv, dk, dv] in a prefix, [R, E, Hv, dk, dv] in exports."""

    conv: jax.Array
    state: jax.Array


LayerCache = Union[AttentionCache, GdnCache]


def prefix_inputs(inputs: DeviceBatch, prefix: tuple[LayerCache, ...] | None
                  ) -> tuple[TreeMask, jax.Array | None]:
    """The mask and prefix chain (`prefix_pred` [R, P]) a forward reads. A call with `prefix`
    needs the batch's prefix layout; a call without one reads the own tokens' mask only (the
    prefix layout of a batch describes the caches that come with it). The mask's real queries
    are the batch's `valid` tokens, so the kernels skip the query blocks of padding and gaps
    (`jtree.kernels.TreeMask.real`)."""
    if prefix is None:
        return TreeMask(inputs.mask.end, real=inputs.valid), None
    missing = [f for f, x in (("mask.prefix_end", inputs.mask.prefix_end),
                              ("prefix_pred", inputs.prefix_pred)) if x is None]
    if missing:
        raise ValueError(f"inputs: {missing} missing; a call with a prefix needs the prefix layout "
                         "of jtree.partitioning.redundancy_free")
    return dataclasses.replace(inputs.mask, real=inputs.valid), inputs.prefix_pred
