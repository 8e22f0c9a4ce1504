"""A training checkpoint exported with `jtree export-hf` loads back (jtree.hf) with the trained
parameters."""

import jax
import numpy as np
import pytest
from flax import nnx

import jtree.hf
from jtree.cli import main as cli
from jtree.commands.export_hf import trained_model
from jtree.launch.train import main
from jtree.models import create_model
from tests.run_util import tiny_overrides


@pytest.mark.slow
def test_checkpoint_exports_to_a_hugging_face_directory(few_groups_file, tmp_path):
    overrides = tiny_overrides(few_groups_file,
                               **{"run.steps": 2, "model.tie_word_embeddings": False})
    assert main(["--config", "configs/tiny.yaml", *overrides,
                 f"checkpoint.dir={tmp_path}/ckpt"]) == 0
    assert cli(["export-hf", "--config", "configs/tiny.yaml", "--checkpoint",
                str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"), *overrides]) == 0
    _, loaded = jtree.hf.load(tmp_path / "hf")
    trained, config = trained_model("configs/tiny.yaml", overrides, str(tmp_path / "ckpt"))
    leaves = lambda m: jax.tree_util.tree_leaves(nnx.state(m, nnx.Param))  # noqa: E731
    for a, b in zip(leaves(loaded), leaves(trained), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    initial = leaves(create_model("qwen3", config))
    assert any(not np.array_equal(a, b) for a, b in zip(leaves(loaded), initial))
