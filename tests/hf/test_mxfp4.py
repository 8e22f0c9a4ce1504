"""MXFP4 dequantization (`jtree.hf.mxfp4`) against an independent quantizer written here from the
format's definition (OCP Microscaling: 32-value blocks, FP4 E2M1 codes two per byte with the
even element in the low nibble, an E8M0 scale byte 2^(s - 127) per block), against
transformers' own dequantizer, and inside the loader: a gpt-oss checkpoint whose experts are
stored as `*_blocks` / `*_scales` pairs loads the dequantized weights."""

import numpy as np
import pytest

import jtree.hf
from jtree.hf import mxfp4
from jtree.hf.safetensors_io import CheckpointTensors

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_value(code: int) -> float:
    """The E2M1 code's value from its bits: sign (3), exponent (2-1, bias 1), mantissa (0);
    exponent 0 is subnormal (0 or 0.5)."""
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    if exponent == 0:
        return sign * 0.5 * mantissa
    return sign * 2.0 ** (exponent - 1) * (1 + 0.5 * mantissa)


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [..., 32 G] float -> (blocks [..., G, 16] uint8, scales [..., G] uint8): per block the
    scale 2^floor(log2(amax)) / 4 (the largest E2M1 magnitude 6 is 1.5 x 2^2), then each value
    rounded to the nearest E2M1 value (ties to the smaller magnitude), packed low nibble first."""
    *lead, n = x.shape
    blocks = x.reshape(*lead, n // 32, 32).astype(np.float64)
    amax = np.abs(blocks).max(axis=-1)
    exponent = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - 2, -127)
    exponent = np.clip(exponent, -127, 127).astype(np.int64)
    scaled = blocks / (2.0 ** exponent)[..., None]
    magnitudes = np.array(E2M1_MAGNITUDES)
    nearest = np.abs(np.abs(scaled)[..., None] - magnitudes).argmin(axis=-1)
    codes = (nearest | np.where(scaled < 0, 8, 0)).astype(np.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.astype(np.uint8), (exponent + 127).astype(np.uint8)


def reference_dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Element by element in float64 from the definition."""
    out = np.zeros(blocks.shape[:-1] + (2 * blocks.shape[-1],))
    for index in np.ndindex(*blocks.shape[:-1]):
        scale = 2.0 ** (int(scales[index]) - 127)
        for b, byte in enumerate(blocks[index]):
            out[index + (2 * b,)] = e2m1_value(int(byte) & 15) * scale
            out[index + (2 * b + 1,)] = e2m1_value(int(byte) >> 4) * scale
    return out.reshape(blocks.shape[:-2] + (-1,))


def test_code_table_and_nibble_order():
    assert [e2m1_value(c) for c in range(16)] == list(mxfp4.FP4_VALUES)
    # byte 0x21: element 0 is code 1 (0.5), element 1 code 2 (1.0); scale 2^(130 - 127) = 8
    blocks = np.array([[[0x21] + [0] * 15]], np.uint8)
    out = mxfp4.dequantize(blocks, np.array([[130]], np.uint8))
    assert out.shape == (1, 32) and out[0, :3].tolist() == [4.0, 8.0, 0.0]


def test_dequantize_equals_the_definition_and_inverts_the_quantizer():
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 4, 16), dtype=np.uint8)
    scales = rng.integers(100, 150, (3, 4), dtype=np.uint8)
    out = mxfp4.dequantize(blocks, scales)
    assert out.dtype == np.float32 and out.shape == (3, 128)
    np.testing.assert_array_equal(out, reference_dequantize(blocks, scales))
    # Values on the grid survive quantize -> dequantize exactly (the quantizer finds the same
    # scale wherever a block's largest magnitude is 4 or 6 times its scale).
    x = rng.normal(0, 3, (5, 64)).astype(np.float32)
    q_blocks, q_scales = quantize(x)
    deq = mxfp4.dequantize(q_blocks, q_scales)
    np.testing.assert_array_equal(deq, reference_dequantize(q_blocks, q_scales))
    again = mxfp4.dequantize(*quantize(deq))
    np.testing.assert_array_equal(again, deq)
    # and the error is within the block's coarsest spacing (2 x scale, between 4 and 6; values
    # scaled past 6 are clamped to it)
    scale = 2.0 ** (q_scales.astype(np.float64) - 127)
    assert np.all(np.abs(deq - x).reshape(5, 2, 32) <= 2 * scale[..., None])


def test_hf_tensor_equals_transformers_dequantizer():
    torch = pytest.importorskip("torch")
    convert = pytest.importorskip("transformers.integrations.mxfp4").convert_moe_packed_tensors
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (2, 6, 3, 16), dtype=np.uint8)  # [E, rows, G, 16]
    scales = rng.integers(110, 140, (2, 6, 3), dtype=np.uint8)
    theirs = convert(torch.as_tensor(blocks), torch.as_tensor(scales), dtype=torch.float32)
    ours = mxfp4.hf_tensor(blocks, scales)
    assert ours.shape == tuple(theirs.shape) == mxfp4.hf_shape(blocks.shape) == (2, 96, 6)
    np.testing.assert_array_equal(ours, theirs.numpy())


def _quantized_checkpoint(tmp_path):
    """A tiny gpt-oss checkpoint written by transformers (`plain`), its copy with the experts'
    matrices quantized by `quantize` (`q`: HF tensor W [E, in, out] stored as blocks of W^T's rows,
    as the released checkpoints are, with their `quantization_config`) and the dequantized tensors
    by name."""
    transformers = pytest.importorskip("transformers")
    from tests.hf_path_checks import write_random_checkpoint
    from tests.hf_util import copy_checkpoint

    config = transformers.GptOssConfig(
        vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=4)
    write_random_checkpoint(config, tmp_path / "plain")
    dequantized = {}

    def to_mxfp4(tensors):
        for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
            w = tensors.pop(name)
            blocks, scales = quantize(np.ascontiguousarray(w.transpose(0, 2, 1)))
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            dequantized[name] = mxfp4.hf_tensor(blocks, scales)

    def quant_config(c):
        c["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]}

    quantized = copy_checkpoint(tmp_path / "plain", tmp_path / "q", edit_tensors=to_mxfp4,
                                edit_config=quant_config)
    return quantized, dequantized


def test_gpt_oss_checkpoint_with_mxfp4_experts_loads_dequantized(tmp_path):
    """The loader reads the dequantized tensors, lists neither blocks nor scales, and the model
    equals the one loaded from the same dequantized weights stored unquantized; another
    quantization method is refused."""
    from tests.hf_util import assert_same_params, copy_checkpoint
    from tests.models_util import tiny_runtime

    quantized, dequantized = _quantized_checkpoint(tmp_path)
    plain = copy_checkpoint(tmp_path / "plain", tmp_path / "d",
                            edit_tensors=lambda tensors: tensors.update(dequantized))
    with CheckpointTensors(quantized) as ckpt:
        name = "model.layers.0.mlp.experts.gate_up_proj"
        assert name in ckpt.names() and name + "_blocks" not in ckpt.names()
        assert ckpt.shape(name) == (4, 64, 64) and ckpt.dtype(name) == "F32"
        np.testing.assert_array_equal(ckpt.read(name), dequantized[name])
    _, from_quantized = jtree.hf.load(quantized, tiny_runtime())
    _, from_plain = jtree.hf.load(plain, tiny_runtime())
    assert_same_params(from_quantized, from_plain)
    bad = copy_checkpoint(quantized, tmp_path / "bad", edit_config=lambda c: c.update(
        quantization_config={"quant_method": "fp8"}))
    with pytest.raises(ValueError, match="quantization_config"):
        jtree.hf.load(bad)


def test_mxfp4_checkpoint_loads_as_transformers_loads_it(tmp_path):
    """transformers itself loads the quantized checkpoint (on CPU it dequantizes the experts):
    every tensor of its model equals jtree's loaded model mapped back to HF names, so blocks,
    scales, nibble order, transposes and the gate/up interleave agree end to end."""
    pytest.importorskip("torch")
    from jtree.hf.torch_reference import load_torch_model
    from tests.models_util import tiny_runtime

    quantized, _ = _quantized_checkpoint(tmp_path)
    theirs = {n: p.detach().numpy() for n, p in load_torch_model(quantized).state_dict().items()}
    config, model = jtree.hf.load(quantized, tiny_runtime())
    ours = jtree.hf.to_hf_tensors(model, config, names=frozenset(theirs))
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)
