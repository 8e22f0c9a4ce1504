"""Validation of what a tree is built from: token sequences and the per-path data beside them
(loss masks, advantages, rewards, old log-probs, weights), each error naming the sequence or path
and the field."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

ArrayLike = Any

# How far above 0 an old log-probability may be: rollout engines compute them in reduced
# precision, which can round a near-certain token's log-probability slightly above 0; anything
# larger is not a log-probability (and would silently distort the PPO ratio).
LOGPROB_TOLERANCE = 1e-3


def numbers(values: ArrayLike, what: str, dtype: Any = None) -> np.ndarray:
    """`values` as an array; a string, object or ragged list names the field it came from."""
    try:
        return np.asarray(values, dtype=dtype)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: expected numbers, got {preview(values)}") from None


def preview(values: Any) -> str:
    text = repr(values)
    return text if len(text) <= 60 else text[:57] + "..."


def as_token_array(seq: ArrayLike, what: str, vocab_size: int | None) -> np.ndarray:
    arr = numbers(seq, f"{what}: tokens")
    if arr.ndim != 1:
        raise ValueError(f"{what}: tokens must be a 1-D sequence, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{what}: tokens is empty (every sequence/node needs at least one token)")
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what}: tokens must be integers, got dtype {arr.dtype}")
    if arr.min() < 0:
        bad = int(np.flatnonzero(arr < 0)[0])
        raise ValueError(f"{what}: tokens[{bad}] = {int(arr[bad])} is negative")
    if vocab_size is not None and arr.max() >= vocab_size:
        bad = int(np.flatnonzero(arr >= vocab_size)[0])
        raise ValueError(
            f"{what}: tokens[{bad}] = {int(arr[bad])} is outside the vocabulary (size {vocab_size})"
        )
    if arr.max() > np.iinfo(np.int32).max:
        raise ValueError(f"{what}: tokens do not fit in int32")
    return arr.astype(np.int32)


def per_token(values: ArrayLike, length: int, what: str, *, allow_scalar: bool) -> np.ndarray:
    arr = numbers(values, what, np.float64)
    if arr.ndim == 0 and allow_scalar:
        arr = np.full(length, float(arr))
    if arr.ndim != 1 or arr.shape[0] != length:
        raise ValueError(
            f"{what}: expected {'a scalar or ' if allow_scalar else ''}{length} values "
            f"(one per token), got shape {arr.shape}"
        )
    if not np.all(np.isfinite(arr)):
        bad = int(np.flatnonzero(~np.isfinite(arr))[0])
        raise ValueError(f"{what}[{bad}] = {arr[bad]} is not finite")
    return arr.astype(np.float32)


def check_log_probabilities(values: np.ndarray, what: str, start: int = 0) -> None:
    """Refuse a value from `start` on that lies above 0 by more than `LOGPROB_TOLERANCE`,
    naming `what[j]`: it is not a log-probability and would distort the PPO ratio."""
    above = np.flatnonzero(values[start:] > LOGPROB_TOLERANCE)
    if above.size:
        j = int(above[0]) + start
        raise ValueError(f"{what}[{j}] = {values[j]:g} is above 0 (a log-probability is <= 0)")


@dataclasses.dataclass(frozen=True, eq=False)
class PathData:
    """Per-path training data, validated, one entry per path."""

    loss_masks: tuple[np.ndarray, ...]
    advantages: tuple[np.ndarray, ...] | None
    old_logprobs: tuple[np.ndarray, ...] | None
    weights: np.ndarray
    rewards: tuple[np.ndarray, ...] | None = None  # per path: its per-turn rewards, float64 [T]
    # per path: the engine's routed experts [tokens, L, k] int32, -1 rows: none (routing replay)
    routed_experts: tuple[np.ndarray, ...] | None = None


def path_reward(value: ArrayLike, what: str) -> np.ndarray:
    """A path's rewards per turn, float64 [T]: a number is one turn's, a non-empty list gives
    one per turn (`TrajectoryTree.rewards` adds them up; docs/rl.md)."""
    if np.asarray(value).dtype == bool:  # JSON true/false is not a reward
        raise ValueError(f"{what}: expected numbers, got {preview(value)}")
    arr = numbers(value, what, np.float64)
    if arr.ndim > 1 or arr.size == 0:
        raise ValueError(f"{what}: expected a number or a non-empty list of per-turn numbers, got "
                         f"{preview(value)}")
    if not np.all(np.isfinite(arr)):
        bad = int(np.flatnonzero(~np.isfinite(np.atleast_1d(arr)))[0])
        at = "" if arr.ndim == 0 else f"[{bad}]"
        raise ValueError(f"{what}{at} = {np.atleast_1d(arr)[bad]} is not finite")
    return np.atleast_1d(arr)


def validate_path_data(
    lengths: Sequence[int],
    loss_masks: Sequence[ArrayLike] | None,
    advantages: Sequence[ArrayLike] | None,
    old_logprobs: Sequence[ArrayLike] | None,
    weights: ArrayLike | None,
    label: str,
    rewards: Sequence[ArrayLike] | None = None,
) -> PathData:
    k = len(lengths)

    def check_count(items: Sequence[Any] | None, field: str) -> None:
        if items is not None and len(items) != k:
            raise ValueError(f"{field}: got {len(items)} entries for {k} {label}s")

    check_count(loss_masks, "loss_masks")
    check_count(advantages, "advantages")
    check_count(old_logprobs, "old_logprobs")
    check_count(rewards, "rewards")
    if loss_masks is None:
        masks = tuple(np.ones(n, np.float32) for n in lengths)
    else:
        masks = tuple(
            per_token(m, n, f"{label} {i}: loss_mask", allow_scalar=False)
            for i, (m, n) in enumerate(zip(loss_masks, lengths))
        )
        for i, m in enumerate(masks):
            if np.any((m != 0) & (m != 1)):
                raise ValueError(f"{label} {i}: loss_mask must contain only 0 and 1")
    adv = None
    if advantages is not None:
        adv = tuple(
            per_token(a, n, f"{label} {i}: advantage", allow_scalar=True)
            for i, (a, n) in enumerate(zip(advantages, lengths))
        )
    old = None
    if old_logprobs is not None:
        old = tuple(
            per_token(o, n, f"{label} {i}: old_logprobs", allow_scalar=False)
            for i, (o, n) in enumerate(zip(old_logprobs, lengths))
        )
        for i, o in enumerate(old):  # position 0 predicts nothing: its value is never used
            check_log_probabilities(o, f"{label} {i}: old_logprobs", start=1)
    if weights is None:
        w = np.ones(k, np.float32)
    else:
        if isinstance(weights, (list, tuple)):  # name the path whose weight is not a number
            weights = [numbers(x, f"{label} {i}: weight", np.float64)
                       for i, x in enumerate(weights)]
        w = numbers(weights, "weights", np.float64)
        if w.shape != (k,):
            raise ValueError(f"weights: expected {k} values (one per {label}), got shape {w.shape}")
        bad = np.flatnonzero(~np.isfinite(w) | (w < 0))
        if bad.size:
            raise ValueError(f"{label} {int(bad[0])}: weight = {w[bad[0]]} must be finite and >= 0")
        w = w.astype(np.float32)
    rew = None
    if rewards is not None:
        rew = tuple(path_reward(r, f"{label} {i}: reward") for i, r in enumerate(rewards))
    return PathData(masks, adv, old, w, rew)


def path_routing(routed: Sequence[ArrayLike] | None, lengths: Sequence[int], label: str
                 ) -> tuple[np.ndarray, ...] | None:
    """Per-path routed experts (routing replay, docs/rl.md) checked against the paths:
    one int32 array [len(path), L, k] per path, one [L, k] for all of them (the ids themselves
    are checked where they are read: `jtree.trees.routed_experts`)."""
    if routed is None:
        return None
    if len(routed) != len(lengths):
        raise ValueError(f"routed_experts: got {len(routed)} entries for {len(lengths)} {label}s")
    out = tuple(np.asarray(r, np.int32) for r in routed)
    shapes = set()
    for i, (r, n) in enumerate(zip(out, lengths)):
        if r.ndim != 3 or len(r) != n:
            raise ValueError(f"{label} {i}: routed_experts: shape {r.shape}, expected "
                             f"[{n}, layers, k]")
        shapes.add(r.shape[1:])
    if len(shapes) > 1:
        raise ValueError(f"routed_experts: {label}s route [layers, k] of shapes {sorted(shapes)}")
    return out

