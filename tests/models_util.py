"""Tiny models and jitted helpers shared by model-level tests."""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx

from jtree.linearize import TreeBatch
from jtree.models import Qwen3, Qwen3Config
from jtree.train import Objective, make_logprob_fn, objective_loss


def tiny_config(**overrides) -> Qwen3Config:
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                tie_word_embeddings=False, attention_impl="reference", rope_theta=10_000.0)
    base.update(overrides)
    return Qwen3Config(**base)


def tiny_model(seed: int = 0, **overrides):
    """(graphdef, params) of a randomly initialized tiny Qwen3."""
    return nnx.split(Qwen3(tiny_config(**overrides), rngs=nnx.Rngs(seed)))


@functools.lru_cache(maxsize=None)
def logprob_fn(graphdef):
    return jax.jit(make_logprob_fn(graphdef))


@functools.lru_cache(maxsize=None)
def loss_and_grad_fn(graphdef, objective: Objective):
    def f(params, inputs):
        return objective_loss(nnx.merge(graphdef, params), inputs, objective)[0]

    return jax.jit(jax.value_and_grad(f))


def scatter_paths(batch: TreeBatch, per_path: list[np.ndarray], field: str) -> dict:
    """Inputs of a baseline batch with `field` set from one array per path (chains in order)."""
    out = dict(batch.arrays())
    arr = np.zeros(batch.shape, np.float32)
    for vals, r, off in zip(per_path, batch.layout.rows, batch.layout.offsets):
        arr[r, off : off + len(vals)] = vals
    out[field] = arr
    return out


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))
