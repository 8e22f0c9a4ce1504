"""Routed experts of engine traces: per token, per MoE layer, the k experts the rollout engine's
router chose (docs/rl.md, "Routing replay"), checked and held as int32 arrays [tokens, L, k].

The format: one entry per token, each a list of L lists (the model's MoE layers in order) of k
expert ids, what the adapters of `jtree.trees.engine_responses` decode from the engines' own
encodings. -1 on every id of a token means "no engine routing" (a token the engine reported no
row for, such as the last sampled one): the trainer routes it itself. The checks
that need the model (L, k and ids below `num_experts`) run where its config is known; the rest
run when a trace is read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jtree.trees.path_data import preview


@dataclasses.dataclass(frozen=True)
class Experts:
    """A model's routing, what routed experts are checked against: its MoE `layers`, `top_k`
    experts per token, `num_experts` per layer."""

    layers: int
    top_k: int
    num_experts: int


def routed_array(value: Any, n_tokens: int, what: str, unit: str = "output token"
                 ) -> np.ndarray:
    """`value` (one entry per token, each [L][k] expert ids) as an int32 array [n_tokens, L, k],
    checked on its own: the count (one entry per `unit`), one shape for every token, ids >= 0
    and distinct within a token's layer. Errors name `what` and the token."""
    if not isinstance(value, list) or len(value) != n_tokens:
        got = len(value) if isinstance(value, list) else preview(value)
        raise ValueError(f"{what}: expected a list of {n_tokens} entries (one per {unit}), "
                         f"got {got}")
    if not value:
        return np.zeros((0, 0, 0), np.int32)
    try:
        arr = np.asarray(value)
    except ValueError:  # ragged
        arr = np.asarray([], object)
    if arr.ndim != 3 or arr.dtype.kind not in "iu":
        raise ValueError(f"{what}: expected every token's entry as [layers][k] integer expert "
                         f"ids of one shape, got {preview(value)}")
    arr = arr.astype(np.int64)
    if arr.shape[2] == 0:
        raise ValueError(f"{what}: k = 0 experts per token")
    check_routing(arr, what)
    return arr.astype(np.int32)


def check_routing(routed: np.ndarray, what: str, *, num_experts: int | None = None,
                  layers: int | None = None, top_k: int | None = None) -> None:
    """Checks `routed` [tokens, L, k] (-1 rows: no engine routing): the shape against the model's
    `layers` MoE layers and `top_k` where given, ids in [0, num_experts) (below 0 only as a
    whole token's -1), no expert twice in one token's layer. The first bad token is named."""
    n, got_layers, got_k = routed.shape
    for name, got, want in (("layers", got_layers, layers), ("k", got_k, top_k)):
        if n and want is not None and got != want:
            raise ValueError(f"{what}: {got} {name} per token, the model has {want} "
                             f"({'MoE layers' if name == 'layers' else 'experts per token'})")
    none = np.all(routed == -1, axis=(1, 2))
    given = routed[~none]
    bad = given < 0
    if num_experts is not None:
        bad |= given >= num_experts
    if bad.any():
        t = int(np.flatnonzero(~none)[np.flatnonzero(bad.any(axis=(1, 2)))[0]])
        limit = f"[0, {num_experts})" if num_experts is not None else ">= 0"
        raise ValueError(f"{what}[{t}]: expert ids {routed[t].tolist()} not all {limit}")
    ordered = np.sort(routed, axis=-1)
    dup = np.any(ordered[..., 1:] == ordered[..., :-1], axis=(1, 2)) & ~none
    if dup.any():
        t = int(np.flatnonzero(dup)[0])
        raise ValueError(f"{what}[{t}]: an expert twice in one layer: {routed[t].tolist()}")
