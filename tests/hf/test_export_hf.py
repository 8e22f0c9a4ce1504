"""A training checkpoint exported with `jtree export-hf` loads back (jtree.hf) with the trained
parameters; the Qwen3.5 export (GDN and gated attention, grouped in_proj_qkv) and the gpt-oss
export (sliding windows with sinks, interleaved expert gate/up) also load in transformers with the
same log-probs."""

import jax
import numpy as np
import pytest
from flax import nnx

import jtree.hf
from jtree.cli import main as cli
from jtree.commands.export_hf import trained_model
from jtree.launch.train import main
from jtree.layout.linearize import linearize
from jtree.models import create_model
from jtree.trees.tree import TrajectoryTree
from tests.models_util import logprob_fn, tiny_runtime
from tests.run_util import tiny_overrides

ARCH_OVERRIDES = {
    "qwen3": {},
    "qwen3_5": {"model.architecture": "qwen3_5", "model.num_hidden_layers": 2,
                "model.full_attention_interval": 2, "model.partial_rotary_factor": 0.5},
    # a sliding-window (4) and a full layer, 4 experts with the clamped SwiGLU, on the xla kernel
    "gpt_oss": {"model.architecture": "gpt_oss", "model.num_hidden_layers": 2,
                "model.intermediate_size": 16, "model.num_experts": 4,
                "model.num_experts_per_tok": 2, "model.sliding_window": 4,
                "model.swiglu_limit": 1.0, "runtime.attention_impl": "xla"},
}


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(ARCH_OVERRIDES))
def test_checkpoint_exports_to_a_hugging_face_directory(arch, few_groups_file, tmp_path):
    overrides = tiny_overrides(few_groups_file, **{
        "run.steps": 2, "model.tie_word_embeddings": False, **ARCH_OVERRIDES[arch]})
    assert main(["--config", "configs/tiny.yaml", *overrides,
                 f"checkpoint.dir={tmp_path}/ckpt"]) == 0
    assert cli(["export-hf", "--config", "configs/tiny.yaml", "--checkpoint",
                str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"), *overrides]) == 0
    _, loaded = jtree.hf.load(tmp_path / "hf", tiny_runtime())
    trained, config, _ = trained_model("configs/tiny.yaml", overrides, str(tmp_path / "ckpt"))
    leaves = lambda m: jax.tree_util.tree_leaves(nnx.state(m, nnx.Param))  # noqa: E731
    for a, b in zip(leaves(loaded), leaves(trained), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    initial = leaves(create_model(arch, config))
    assert any(not np.array_equal(a, b) for a, b in zip(leaves(loaded), initial))
    if arch in ("qwen3_5", "gpt_oss"):
        torch = pytest.importorskip("torch")
        transformers = pytest.importorskip("transformers")
        ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
        seq = np.arange(1, 30) % config.vocab_size
        batch = linearize([TrajectoryTree.from_sequences([seq])], 32, gdn_chunk_size=8)
        graphdef, params = nnx.split(loaded, nnx.Param)
        ours = np.asarray(logprob_fn(graphdef)(params, batch.inputs))[0, 1:len(seq)]
        with torch.no_grad():
            logits = ref(input_ids=torch.as_tensor(seq[None])).logits[0, :-1]
        theirs = torch.log_softmax(logits, -1)[torch.arange(len(seq) - 1), seq[1:]].numpy()
        np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_export_names_its_step_refuses_a_missing_one_and_writes_readable_files(
        few_groups_file, tmp_path, capsys):
    overrides = tiny_overrides(few_groups_file, **{"run.steps": 2, "checkpoint.every": 1})
    assert main(["--config", "configs/tiny.yaml", *overrides,
                 f"checkpoint.dir={tmp_path}/ckpt"]) == 0
    export = ["export-hf", "--config", "configs/tiny.yaml", "--checkpoint",
              str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"), *overrides]
    capsys.readouterr()
    assert cli([*export, "--step", "999"]) == 2
    assert (f"--step 999: {tmp_path / 'ckpt'} holds no checkpoint of step 999 (its steps: 1, 2)"
            in capsys.readouterr().err)
    assert cli([*export, "--step", "1"]) == 0
    assert capsys.readouterr().out.strip().endswith(", step 1")
    assert (tmp_path / "hf" / "model.safetensors").stat().st_mode & 0o777 == 0o644
