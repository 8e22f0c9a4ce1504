"""jtree's LoRA against an independent implementation, Hugging Face peft, and its adapters in
peft's format.

The oracle is built here from the raw A [in, r] and B [r, out] arrays of a jtree `LoraParams`:
peft's own LoRA layers on the transformers model (lora_A.weight = A^T, lora_B.weight = B^T, peft
scaling lora_alpha / r), and a numpy W + (alpha / r) (A B)^T per HF tensor. Neither shares code
with `jtree.models.lora` or `jtree.hf.peft_adapters`, so a wrong scale, transpose or module name
in jtree shows up as a mismatch: (a) peft vs jtree's LoRA forward, (b) peft vs transformers on
jtree's merged export (what `export-hf --merge-lora` writes), (c) numpy vs the merged tensors,
and the peft-format export loaded by `PeftModel.from_pretrained` vs the merged model.
Architectures: Qwen3 (attention and MLP projections, the LM head; per layer and scanned),
Qwen3-Next, whose LoRA targets add the Gated DeltaNet projections and the shared expert's gate
(Qwen3-MoE's targets are Qwen3's), and gpt-oss (attention with biases, sinks and sliding windows,
and the LM head; its experts are fused tensors, which peft's LoRA layers do not wrap)."""

import json

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import jtree.hf  # noqa: E402
from jtree.cli import main as cli  # noqa: E402
from jtree.commands.export_hf import restored_params  # noqa: E402
from jtree.config import load_config
from jtree.config.model import LoraConfig
from jtree.hf.peft_adapters import peft_adapter_tensors, save_peft_adapters  # noqa: E402
from jtree.hf.torch_reference import load_torch_model  # noqa: E402
from jtree.launch.train import main  # noqa: E402
from jtree.layout.linearize import linearize  # noqa: E402
from jtree.models import CausalLM, create_model
from jtree.models.lora import attach, model_params, with_trainable
from jtree.trees.tree import TrajectoryTree  # noqa: E402
from tests.hf_path_checks import write_random_checkpoint  # noqa: E402
from tests.models_util import tiny_config, tiny_runtime  # noqa: E402
from tests.run_util import tiny_overrides  # noqa: E402
from tests.torch_util import (  # noqa: E402
    gpt_oss_config, random_sparse_model, write_qwen3_checkpoint,
)

RANK, ALPHA = 4, 6.0  # scale 1.5: alpha / r, alpha, r / alpha and 1 all differ
# Qwen3: every Linear. Qwen3-Next: the Linears its LoRA adds over Qwen3's, with attention and the
# LM head; not its MLP projections, which peft cannot place on this architecture (with
# transformers 5, peft maps targets named gate_proj, up_proj or down_proj of Qwen3-MoE and -Next
# onto the fused experts; docs/lora.md).
TARGETS = {"qwen3": ("proj", "lm_head"),
           "next": ("self_attn", "linear_attn", "shared_expert_gate", "lm_head"),
           "gpt_oss": ("self_attn", "lm_head")}
# float32 log-probs (about -5), jtree or merged weights vs peft's W x + s B (A x): 1e-5; on the
# Qwen3-Next model (weights of std 0.3, through the Gated DeltaNet recurrence) rounding moves them
# by up to 1e-4, the tolerance of its logits in tests/hf/test_hf_moe_next.py.
ATOL = {"qwen3": 1e-5, "next": 1e-4, "gpt_oss": 1e-5}
RTOL = 1e-5


def log_probs(logits: np.ndarray) -> np.ndarray:
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def torch_log_probs(model, seq: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return log_probs(model(input_ids=torch.as_tensor(seq[None])).logits[0].numpy())


def raw_adapters(lora) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """HF module name -> (A [in, r], B [r, out]) per layer, read off the adapters' tree by hand.
    Scanned adapters (`model/blocks/0/0/...`, the tiny Qwen3's one group of identical layers)
    are split along their leading layer axis."""
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for path, x in jax.tree_util.tree_flatten_with_path(lora.adapters)[0]:
        *stem, which = (str(p.key) for p in path)
        stems = [(stem, np.asarray(x))]
        if stem[:2] == ["model", "blocks"]:
            assert stem[2:4] == ["0", "0"], stem
            stems = [(["model", "layers", str(i), *stem[4:]], layer)
                     for i, layer in enumerate(np.asarray(x))]
        for parts, value in stems:
            pairs.setdefault(".".join(parts), {})[which] = value
    return {name: (ab["lora_a"], ab["lora_b"]) for name, ab in pairs.items()}


def peft_oracle(base_dir, adapters: dict[str, tuple[np.ndarray, np.ndarray]]):
    """peft's LoRA on the transformers model, its weights set from the raw arrays."""
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=sorted(adapters),
                             lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    model = peft.get_peft_model(load_torch_model(base_dir), config).eval()
    with torch.no_grad():
        for name, (a, b) in adapters.items():
            layer = model.base_model.model.get_submodule(name)
            assert isinstance(layer, peft.tuners.lora.Linear), name
            layer.lora_A["default"].weight.copy_(torch.tensor(a.T))
            layer.lora_B["default"].weight.copy_(torch.tensor(b.T))
    return model


def lora_layers(model) -> set[str]:
    """The modules of a peft model that carry a LoRA adapter."""
    return {name for name, module in model.base_model.model.named_modules()
            if isinstance(module, peft.tuners.lora.Linear)}


def jtree_log_probs(model, seq: np.ndarray) -> np.ndarray:
    batch = linearize([TrajectoryTree.from_sequences([seq])], 32, gdn_chunk_size=8)
    hidden = np.asarray(model(jax.tree_util.tree_map(jax.numpy.asarray, batch.inputs)).hidden)
    return log_probs(hidden[0, :len(seq)] @ np.asarray(model.output_embedding()))


CASES = [("qwen3", False), ("qwen3", True), ("next", False), ("gpt_oss", False)]


@pytest.fixture(scope="module", params=CASES,
                ids=lambda c: f"{c[0]}-{'scan' if c[1] else 'layers'}")
def case(request, tmp_path_factory):
    """A random tiny transformers model, jtree's LoRA on it with random nonzero A and B, and
    what the tests compare: the peft oracle, the merged export, the sequences."""
    kind, scan = request.param
    tmp = tmp_path_factory.mktemp(f"{kind}-{scan}")
    if kind == "qwen3":
        write_qwen3_checkpoint(tmp / "base", tie=False, bias=True)
    elif kind == "gpt_oss":  # every parameter random: biases, sinks, norms
        write_random_checkpoint(gpt_oss_config(), tmp / "base")
    else:
        random_sparse_model("next").save_pretrained(tmp / "base")
    config, model = jtree.hf.load(tmp / "base", tiny_runtime(scan_layers=scan))
    graphdef, params = nnx.split(model)
    lora = attach(params, LoraConfig(rank=RANK, alpha=ALPHA, targets=TARGETS[kind]),
                  jax.random.key(0))
    keys = iter(jax.random.split(jax.random.key(1), 256))
    lora = with_trainable(lora, jax.tree_util.tree_map(  # B = 0 would leave the base model
        lambda x: 0.1 * jax.random.normal(next(keys), x.shape), lora.adapters))
    merged = nnx.merge(graphdef, model_params(lora))
    jtree.hf.save(merged, config, tmp / "merged")  # what `export-hf --merge-lora` writes
    adapters = raw_adapters(lora)
    rng = np.random.default_rng(0)
    vocab = config.vocab_size
    return dict(kind=kind, tmp=tmp, config=config, lora=lora, merged=merged, adapters=adapters,
                oracle=peft_oracle(tmp / "base", adapters),
                seqs=[rng.integers(0, vocab, n) for n in (5, 17, 24)])


def test_peft_oracle_changes_the_model(case):
    base = load_torch_model(case["tmp"] / "base")
    seq = case["seqs"][-1]
    assert np.abs(torch_log_probs(case["oracle"], seq) - torch_log_probs(base, seq)).max() > 0.1


def test_jtree_lora_forward_equals_peft(case):
    for seq in case["seqs"]:
        np.testing.assert_allclose(jtree_log_probs(case["merged"], seq),
                                   torch_log_probs(case["oracle"], seq),
                                   rtol=RTOL, atol=ATOL[case["kind"]])


def test_merged_export_in_transformers_equals_peft(case):
    merged = load_torch_model(case["tmp"] / "merged")
    for seq in case["seqs"]:
        np.testing.assert_allclose(torch_log_probs(merged, seq),
                                   torch_log_probs(case["oracle"], seq),
                                   rtol=RTOL, atol=ATOL[case["kind"]])


def test_merged_tensors_equal_numpy_w_plus_scaled_ba(case):
    base = load_file(str(case["tmp"] / "base" / "model.safetensors"))
    merged = load_file(str(case["tmp"] / "merged" / "model.safetensors"))
    targeted = {name + ".weight": ab for name, ab in case["adapters"].items()}
    assert targeted.keys() <= merged.keys()
    for name, (a, b) in targeted.items():  # torch weight [out, in]: (A B)^T = B^T A^T
        expected = base[name].astype(np.float64) + (ALPHA / RANK) * (b.T.astype(np.float64)
                                                                     @ a.T.astype(np.float64))
        np.testing.assert_allclose(merged[name], expected, rtol=1e-5, atol=1e-6, err_msg=name)
    for name in (base.keys() & merged.keys()) - targeted.keys():
        np.testing.assert_array_equal(merged[name], base[name], err_msg=name)


def test_peft_format_export_loads_in_peft_as_the_merged_model(case):
    out = case["tmp"] / "adapters"
    save_peft_adapters(case["lora"], LoraConfig(rank=RANK, alpha=ALPHA, targets=("proj",)),
                       case["config"], out, overwrite=True)
    loaded = peft.PeftModel.from_pretrained(load_torch_model(case["tmp"] / "base"), out).eval()
    merged = load_torch_model(case["tmp"] / "merged")
    for seq in case["seqs"]:
        np.testing.assert_allclose(torch_log_probs(loaded, seq), torch_log_probs(merged, seq),
                                   rtol=RTOL, atol=ATOL[case["kind"]])

    # The same files peft itself writes for the oracle's adapters: names, values, settings.
    # (With the LM head targeted, peft would also save its frozen base weight by default, a
    # copy of what the base model holds anyway.)
    case["oracle"].save_pretrained(case["tmp"] / "peft_saved", save_embedding_layers=False)
    ours, theirs = (load_file(str(d / "adapter_model.safetensors"))
                    for d in (out, case["tmp"] / "peft_saved"))
    assert ours.keys() == theirs.keys()
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    ours, theirs = (json.loads((d / "adapter_config.json").read_text())
                    for d in (out, case["tmp"] / "peft_saved"))
    for key in ("peft_type", "task_type", "r", "lora_alpha", "use_rslora", "use_dora", "bias"):
        assert ours[key] == theirs[key], key
    # peft may save target_modules shortened to suffixes; what counts is which layers they wrap.
    assert lora_layers(loaded) == lora_layers(case["oracle"]) == set(case["adapters"])


def test_peft_export_refuses_a_mismatched_lora_config(case, tmp_path):
    with pytest.raises(ValueError, match="model.lora.rank"):
        save_peft_adapters(case["lora"], LoraConfig(rank=RANK + 1, alpha=ALPHA * (RANK + 1) / RANK,
                                                    targets=("proj",)),
                           case["config"], tmp_path)
    with pytest.raises(ValueError, match="alpha / rank"):
        save_peft_adapters(case["lora"], LoraConfig(rank=RANK, alpha=2 * ALPHA,
                                                    targets=("proj",)), case["config"], tmp_path)


def test_peft_export_leaves_out_the_critic():
    """A value head and a separate critic are not part of the HF causal LM: their adapters are
    not written (peft would find no module for them)."""
    config = tiny_config(num_hidden_layers=1)
    model = CausalLM(config, tiny_runtime(), rngs=nnx.Rngs(0), value_head=True, critic=config)
    lora = attach(nnx.split(model)[1], LoraConfig(rank=RANK, alpha=ALPHA, targets=("head",)),
                  jax.random.key(0))
    kernels = {".".join(str(p.key) for p in path[:-1])
               for path, _ in jax.tree_util.tree_flatten_with_path(lora.adapters)[0]}
    assert kernels == {"lm_head", "value_head", "critic.value_head"}
    assert set(peft_adapter_tensors(lora, config)) == {
        "base_model.model.lm_head.lora_A.weight", "base_model.model.lm_head.lora_B.weight"}


def test_export_hf_peft_adapters_of_a_run_without_lora_fails_in_one_line(tmp_path, capsys):
    assert cli(["export-hf", "--config", "configs/tiny.yaml", "--checkpoint",
                str(tmp_path / "none"), "--out", str(tmp_path / "out"), "--peft-adapters"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--peft-adapters: configs/tiny.yaml has no model.lora" in err


@pytest.mark.slow
def test_export_hf_peft_adapters_of_a_trained_run_load_in_peft(few_groups_file, tmp_path):
    """`export-hf --peft-adapters` on a trained LoRA run's checkpoint: peft applies them to the
    run's frozen base as the `--merge-lora` export of the same checkpoint runs."""
    overrides = tiny_overrides(few_groups_file, **{
        "run.steps": 3, "model.tie_word_embeddings": False,
        "model.lora": "{rank: 2, alpha: 3, targets: [q_proj, mlp, lm_head]}"})
    ckpt = tmp_path / "ckpt"
    assert main(["--config", "configs/tiny.yaml", *overrides, f"checkpoint.dir={ckpt}"]) == 0
    args = ["export-hf", "--config", "configs/tiny.yaml", "--checkpoint", str(ckpt), *overrides]
    assert cli([*args, "--out", str(tmp_path / "merged"), "--merge-lora"]) == 0
    assert cli([*args, "--out", str(tmp_path / "adapters"), "--peft-adapters",
                "--copy-from", "some/base"]) == 0
    assert json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())[
        "base_model_name_or_path"] == "some/base"

    cfg = load_config("configs/tiny.yaml", overrides)  # the run's frozen base, as HF weights
    graphdef = nnx.split(nnx.eval_shape(lambda: create_model("qwen3", cfg.model.config,
                                                             cfg.runtime)))[0]
    base = nnx.merge(graphdef, restored_params(cfg, str(ckpt))[0].base)
    jtree.hf.save(base, cfg.model.config, tmp_path / "base")

    loaded = peft.PeftModel.from_pretrained(load_torch_model(tmp_path / "base"),
                                            tmp_path / "adapters").eval()
    merged, plain = load_torch_model(tmp_path / "merged"), load_torch_model(tmp_path / "base")
    seq = np.random.default_rng(0).integers(0, cfg.model.config.vocab_size, 20)
    assert np.abs(torch_log_probs(merged, seq) - torch_log_probs(plain, seq)).max() > 1e-4
    np.testing.assert_allclose(torch_log_probs(loaded, seq), torch_log_probs(merged, seq),
                               rtol=RTOL, atol=ATOL["qwen3"])
