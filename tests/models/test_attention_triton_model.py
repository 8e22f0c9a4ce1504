"""A tiny Qwen3 training step with `attention_impl="pallas_triton"` equals the `xla` step: loss and
every parameter gradient within 1e-5 relative (float32). No GPU here, so the Triton kernels run in
the Pallas interpreter: the test binds `interpret=True` into the registry entry the model's
attention resolves (the model passes no kernel options). head_dim 16 (the kernel's smallest),
GQA 2, S=128 in blocks of 64, two rows of several trees: empty, partial and full blocks."""

import importlib

import numpy as np
import pytest

from jtree.config.objective import Objective
from jtree.layout.linearize import linearize
from tests.models_util import assert_grads_close, loss_and_grad_fn, tiny_model, tiny_runtime
from tests.strategies import seeded_forests

dispatch = importlib.import_module("jtree.kernels.tree_attention")  # the module, not the function


@pytest.mark.timeout(300)
def test_triton_step_equals_xla_step(monkeypatch):
    entry, layers = dispatch._IMPLS["pallas_triton"], []

    def interpreted(*args, **kwargs):
        layers.append(kwargs)
        return entry.run(*args, interpret=True, **kwargs)

    monkeypatch.setitem(dispatch._IMPLS, "pallas_triton", entry._replace(run=interpreted))
    batch = linearize(seeded_forests(6, seed=3, max_nodes=8, max_seg=12), 128, n_rows=2).inputs
    end = np.asarray(batch.mask.end)
    assert (np.diff(end, axis=1) < 0).any()  # branches, not one causal sequence
    loss_grad = {}
    for impl in ("pallas_triton", "xla"):
        graphdef, params = tiny_model(seed=4, runtime=tiny_runtime(attention_impl=impl),
                                      head_dim=16)
        loss_grad[impl] = loss_and_grad_fn(graphdef, Objective(kind="sft"))(params, batch)
    assert len(layers) == 2  # both attention layers ran the Triton kernels
    (loss_t, grads_t), (loss_x, grads_x) = loss_grad["pallas_triton"], loss_grad["xla"]
    assert abs(float(loss_t) - float(loss_x)) <= 1e-5 * abs(float(loss_x))
    assert_grads_close(grads_t, grads_x)
