"""`model.init_from`: training starts from a Hugging Face checkpoint directory, placed on the mesh,
and a config that disagrees with its config.json is refused naming the field."""

import jax
import numpy as np
import pytest
from flax import nnx

import jtree.hf
from jtree.config import load_config
from jtree.training.trainer import Trainer
from tests.models_util import tiny_config, tiny_lm
from tests.run_util import tiny_overrides


def test_training_state_starts_from_a_hugging_face_checkpoint(tmp_path):
    cfg = tiny_config()
    model = tiny_lm(cfg, 11)
    jtree.hf.save(model, cfg, tmp_path / "hf")
    overrides = tiny_overrides(tmp_path / "unused.jsonl", **{
        "model.init_from": str(tmp_path / "hf"), "model.tie_word_embeddings": False,
        "model.rope_theta": cfg.rope_theta, "model.num_hidden_layers": 2})
    trainer = Trainer.build(load_config("configs/tiny.yaml", overrides))
    state = trainer.initial_state()
    assert int(state.step) == 0
    for a, b in zip(jax.tree_util.tree_leaves(state.params),
                    jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree_util.tree_structure(state.opt_state) == jax.tree_util.tree_structure(
        jax.eval_shape(trainer.init_fn).opt_state)

    wrong = load_config("configs/tiny.yaml", overrides + ["model.rms_norm_eps=1e-5"])
    with pytest.raises(ValueError, match=r"model\.rms_norm_eps: the config has 1e-05, .*hf/config"
                                         r"\.json has 1e-06"):
        Trainer.build(wrong).initial_state()
