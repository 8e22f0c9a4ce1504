"""An Orbax checkpoint written with the decoder layers scanned (stacked) restores into an
unscanned train state and back (`Checkpointer.restore(layer_groups=)`): parameters and AdamW
moments equal, placed where the target state asks. Across ('data', 'model') meshes:
tests/step/test_mesh.py."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jtree.parallel.layer_stack import convert_tree, layer_groups
from jtree.step.optimizer import TrainState
from jtree.training.checkpoint import Checkpointer, abstract_like
from tests.models_util import four_expert_config, perturbed, tiny_lm

NEXT_LAYERS = ("linear_attention",) * 3 + ("full_attention",)


@pytest.fixture(scope="module")
def states():
    """(layer groups, unscanned train state, the same state scanned) of a Qwen3-Next model with
    a 3 x GDN + 1 x attention block twice and a GDN tail, after one AdamW update."""
    cfg = four_expert_config("next", num_hidden_layers=9, mlp_only_layers=(),
                             layer_types=NEXT_LAYERS * 2 + ("linear_attention",))
    params = perturbed(nnx.split(tiny_lm(cfg, 0))[1], 0.2)
    opt = optax.adamw(1e-3)
    _, opt_state = opt.update(params, opt.init(params), params)
    state = TrainState(params, opt_state, np.int32(3))
    groups = layer_groups(cfg.decoder().layers)
    return groups, state, convert_tree(state, groups, scanned=True)


def _single_device(state):
    return jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), state)


def _assert_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("saved_scanned", [True, False])
def test_checkpoint_restores_in_the_other_layout(states, saved_scanned, tmp_path):
    groups, unscanned, scanned = states
    saved, wanted = (scanned, unscanned) if saved_scanned else (unscanned, scanned)
    assert jax.tree.structure(saved) != jax.tree.structure(wanted)
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(3, saved, {"next": 3}, {"seed": 0})
    ckpt.wait()
    restored = ckpt.restore(3, abstract_like(wanted, _single_device(wanted)), layer_groups=groups)
    _assert_equal(restored.state, wanted)
    with pytest.raises(ValueError, match="does not match the model"):  # only with the groups
        ckpt.restore(3, abstract_like(wanted, _single_device(wanted)))
    ckpt.close()
