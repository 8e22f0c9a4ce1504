"""LoRA export: the merged model W + (alpha / r) A B that `jtree export-hf --merge-lora` writes
loads in transformers and gives the logits of jtree's merged model (the model LoRA training
runs), and the command writes the checkpoint's merged parameters."""

import jax
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jtree.hf  # noqa: E402
from jtree.cli import main as cli  # noqa: E402
from jtree.commands.export_hf import trained_model  # noqa: E402
from jtree.config.model import LoraConfig
from jtree.launch.train import main  # noqa: E402
from jtree.layout.linearize import linearize  # noqa: E402
from jtree.models.lora import attach, model_params, with_trainable
from jtree.trees.tree import TrajectoryTree  # noqa: E402
from tests.models_util import tiny_runtime  # noqa: E402
from tests.run_util import tiny_overrides  # noqa: E402
from tests.torch_util import TOL, VOCAB, torch_logits, write_qwen3_checkpoint  # noqa: E402


def test_merged_export_gives_jtree_merged_logits_in_transformers(tmp_path):
    config, model = jtree.hf.load(write_qwen3_checkpoint(tmp_path / "base", tie=False,
                                                         bias=True), tiny_runtime())
    graphdef, params = nnx.split(model)
    lora = attach(params, LoraConfig(rank=4, alpha=8.0, targets=("proj", "lm_head")),
                  jax.random.key(0))
    keys = iter(jax.random.split(jax.random.key(1), 64))
    lora = with_trainable(lora, jax.tree_util.tree_map(  # B = 0 would merge to the base
        lambda x: 0.1 * jax.random.normal(next(keys), x.shape), lora.adapters))
    merged = nnx.merge(graphdef, model_params(lora))
    jtree.hf.save(merged, config, tmp_path / "merged")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", dtype=torch.float32, attn_implementation="eager").eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "base", dtype=torch.float32, attn_implementation="eager").eval()
    seq = np.random.default_rng(0).integers(0, VOCAB, 24)
    batch = linearize([TrajectoryTree.from_sequences([seq])], 32)
    hidden = np.asarray(merged(batch.inputs).hidden)[0, :len(seq)]
    ours = hidden @ np.asarray(merged.output_embedding())
    expected = torch_logits(ref, seq)
    assert np.abs(expected - torch_logits(base, seq)).max() > 0.1  # the adapters matter
    np.testing.assert_allclose(ours, expected, atol=TOL, rtol=0)


@pytest.mark.slow
def test_export_hf_merge_lora_writes_the_trained_merged_model(few_groups_file, tmp_path,
                                                              capsys):
    overrides = tiny_overrides(few_groups_file, **{
        "run.steps": 3, "model.tie_word_embeddings": False,
        "model.lora": "{rank: 2, alpha: 4, targets: [q_proj, down_proj], base_dtype: bfloat16}"})
    assert main(["--config", "configs/tiny.yaml", *overrides,
                 f"checkpoint.dir={tmp_path}/ckpt"]) == 0
    args = ["export-hf", "--config", "configs/tiny.yaml", "--checkpoint", str(tmp_path / "ckpt"),
            "--out", str(tmp_path / "hf")]
    assert cli([*args, *overrides]) != 0
    assert "pass --merge-lora" in capsys.readouterr().err
    assert cli([*args, "--merge-lora", *overrides]) == 0
    _, loaded = jtree.hf.load(tmp_path / "hf")
    trained, _, _ = trained_model("configs/tiny.yaml", overrides, str(tmp_path / "ckpt"),
                               merge_lora=True)
    leaves = lambda m: jax.tree_util.tree_leaves(nnx.state(m, nnx.Param))  # noqa: E731
    for a, b in zip(leaves(loaded), leaves(trained), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
