"""Tree mode == per-path baseline through the real model with the block-sparse `xla` attention
(what `auto` runs on CPU) and the multi-threaded `cpu` kernel, and each == `reference` inside the
model. float32,
docs/design.md section 9 tolerances. S=128 with the default 64-token blocks, several trees per row, so
the tables hold empty, partial and full blocks."""

import numpy as np
import pytest
from hypothesis import given, settings

from jtree.config.objective import Objective
from jtree.layout.baseline import linearize_baseline, unlinearize_baseline
from jtree.layout.linearize import linearize, unlinearize
from tests.models_util import (
    assert_grads_close,
    logprob_fn,
    loss_and_grad_fn,
    tiny_model,
    tiny_runtime,
)
from tests.strategies import fitting_layout, forests

S, TREE_ROWS, BASE_ROWS = 128, 2, 24
GRAPHDEF, PARAMS = tiny_model(seed=2, runtime=tiny_runtime(attention_impl="xla"))
GRAPHDEFS = {"xla": GRAPHDEF,
             "cpu": tiny_model(seed=2, runtime=tiny_runtime(attention_impl="cpu"))[0]}
REF_GRAPHDEF, _ = tiny_model(seed=2)
FORESTS = forests(n_trees=(2, 5), max_nodes=8, max_seg=9)


@pytest.mark.parametrize("impl", sorted(GRAPHDEFS))
@settings(max_examples=4)
@given(trees=FORESTS)
def test_tree_equals_baseline_with_block_sparse_attention(impl, trees):
    tree = fitting_layout(linearize, trees, S, n_rows=TREE_ROWS)
    base = fitting_layout(linearize_baseline, trees, S, n_rows=BASE_ROWS)
    fn = logprob_fn(GRAPHDEFS[impl])
    lp_tree_arr = np.asarray(fn(PARAMS, tree.inputs))
    lp_tree = unlinearize(tree, lp_tree_arr)
    lp_base = unlinearize_baseline(base, np.asarray(fn(PARAMS, base.inputs)), trees)
    for a_paths, b_paths in zip(lp_tree, lp_base):
        for a, b in zip(a_paths, b_paths):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    np.testing.assert_allclose(lp_tree_arr, logprob_fn(REF_GRAPHDEF)(PARAMS, tree.inputs),
                               atol=1e-5, rtol=0)

    grad_fn = loss_and_grad_fn(GRAPHDEFS[impl], Objective(kind="sft"))
    loss_t, g_t = grad_fn(PARAMS, tree.inputs)
    loss_b, g_b = grad_fn(PARAMS, base.inputs)
    assert abs(float(loss_t) - float(loss_b)) <= 1e-6 * abs(float(loss_b))
    assert_grads_close(g_t, g_b)
