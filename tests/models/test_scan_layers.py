"""Scanned decoder layers (`RuntimeConfig.scan_layers`, `jtree.parallel.layer_stack`): how layers are cut
into repeated blocks, and a scanned model equal to the unscanned one — loss, gradients, router
statistics and per-layer exports — for dense, MoE (router loss on), Qwen3-Next and Kimi-Linear
models, with and without rematerialization. The redundancy-free executor on a scanned model:
tests/partitioning/test_redundancy_free.py."""

import jax
import numpy as np
import pytest
from flax import nnx

from jtree.config.architectures import LayerKind
from jtree.config.objective import Objective
from jtree.layout.linearize import linearize
from jtree.objectives.objective import loss_from_hidden
from jtree.parallel.layer_stack import LayerGroup, convert_state, layer_groups, stacked_axes
from tests.models_util import (
    assert_grads_close,
    four_expert_config,
    perturbed,
    tiny_config,
    tiny_kimi_linear_config,
    tiny_lm,
)
from tests.strategies import seeded_forests

G, A = LayerKind("gated_deltanet", "moe_shared"), LayerKind("gated_attention", "moe_shared")
D, M = LayerKind("attention", "mlp"), LayerKind("attention", "moe")


@pytest.mark.parametrize("kinds, groups", [
    ([D] * 4, [(0, (D,), 4)]),
    ([G, G, G, A] * 12, [(0, (G, G, G, A), 12)]),
    ([G, G, G, A] * 2 + [G, G], [(0, (G, G, G, A), 2), (8, (G,), 2)]),
    ([G, A, G, A, G], [(0, (G, A), 2), (4, (G,), 1)]),
    ([D, M, M, M], [(0, (D,), 1), (1, (M,), 3)]),
    ([D, M, D, M, D], [(0, (D, M), 2), (4, (D,), 1)]),
    ([D], [(0, (D,), 1)]),
])
def test_layers_are_cut_into_repeated_blocks(kinds, groups):
    assert layer_groups(kinds) == tuple(LayerGroup(*g) for g in groups)


def test_stacked_axes_counts_the_layer_axis_of_stacked_names_only():
    assert stacked_axes("model/blocks/0/2/self_attn/q_proj/kernel") == 1
    assert stacked_axes("opt_state.0.mu.model.blocks.1.0.mlp.gate.weight") == 1
    assert stacked_axes("model/layers/3/self_attn/q_proj/kernel") == 0
    assert stacked_axes("model/embed_tokens/embedding") == 0


NEXT = ("linear_attention", "full_attention")
CASES = {  # config, remat: a one-layer block; a dense + MoE block (router loss on) repeated; a
    # GDN + gated attention block repeated, MoE with a shared expert everywhere
    "dense": (lambda: tiny_config(num_hidden_layers=3), "full"),
    "moe": (lambda: four_expert_config("moe", num_hidden_layers=4, mlp_only_layers=(),
                                       decoder_sparse_step=2), "none"),
    "next": (lambda: four_expert_config("next", num_hidden_layers=4, mlp_only_layers=(),
                                        layer_types=NEXT * 2), "dots"),
    # Kimi-Linear's irregular list (configs/kimi_linear_48b.yaml scans it): a dense KDA layer,
    # [KDA, MLA] x 2 with DeepSeekMoE, one more KDA layer
    "kimi_linear": (lambda: tiny_kimi_linear_config(
        num_hidden_layers=6, layer_types=("linear_attention",) + NEXT * 2 + ("linear_attention",),
        mlp_layer_types=("dense",) + ("sparse",) * 5), "full"),
}


def _loss_grads_and_output(graphdef, params, batch):
    """(SFT loss, its gradients, the model's output) in one compiled function."""
    def f(p):
        model = nnx.merge(graphdef, p)
        out = model(batch)
        return loss_from_hidden(model.output_embedding(), out.hidden, batch.pred, out.aux_loss,
                                batch, Objective(kind="sft"))[0], out

    return jax.jit(jax.value_and_grad(f, has_aux=True))(params)


@pytest.mark.parametrize("kind", ["dense", "moe", pytest.param("next", marks=pytest.mark.slow),
                                  pytest.param("kimi_linear", marks=pytest.mark.slow)])
def test_scanned_model_equals_unscanned(kind):
    make_config, remat = CASES[kind]
    cfg = make_config()
    groups = layer_groups(cfg.decoder().layers)
    assert any(g.scanned for g in groups) and max(len(g.block) for g in groups) == (
        1 if kind == "dense" else 2)
    graphdef, params = nnx.split(tiny_lm(cfg, 0, remat=remat))
    params = perturbed(params, 0.2)
    scanned_graphdef, fresh = nnx.split(tiny_lm(cfg, 0, remat=remat, scan_layers=True))
    stacked = convert_state(params, groups, scanned=True)
    # The same seed initializes the scanned model with the very weights of the unscanned one.
    for a, b in zip(jax.tree.leaves(fresh),
                    jax.tree.leaves(convert_state(nnx.split(tiny_lm(cfg, 0))[1], groups,
                                                  scanned=True))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    batch = linearize(seeded_forests(3, seed=0, max_nodes=8, max_seg=5), 64,
                      normalization="seq_mean_token_mean", n_rows=3, gdn_chunk_size=3,
                      gdn_chunks=64).inputs
    (loss, out), grads = _loss_grads_and_output(graphdef, params, batch)
    (loss_s, out_s), grads_s = _loss_grads_and_output(scanned_graphdef, stacked, batch)
    # The scan body is compiled apart from the rest of the program, so sums may round
    # differently: the loss within 1e-6; the gradients and the exported activations of the last
    # layers within the tree == baseline tests' bounds (`assert_grads_close`, 1e-5): Qwen3-Next's
    # embedding gradient, summed over every token and both layers, is 6.0e-6 apart at the tests'
    # code generation (`tests.run_util.CODEGEN_XLA_FLAGS`; within 1e-6 at level 1).
    assert float(loss_s) == pytest.approx(float(loss), rel=1e-6)
    grads_s = convert_state(grads_s, groups, scanned=False)
    assert jax.tree.structure(grads_s) == jax.tree.structure(grads)
    assert_grads_close(grads_s, grads)
    assert len(out_s.exports) == cfg.num_hidden_layers
    assert jax.tree.structure(out_s) == jax.tree.structure(out)
    for a, b in zip(jax.tree.leaves(out_s), jax.tree.leaves(out)):  # exports, router load
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
