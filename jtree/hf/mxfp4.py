"""MXFP4 tensors (the OCP Microscaling format's FP4 with E8M0 scales), dequantized on the host.

gpt-oss's released checkpoints store each expert matrix W as two uint8 tensors, `NAME_blocks`
[..., rows, G, 16] and `NAME_scales` [..., rows, G]: every row is cut into G blocks of 32
values; a block's 32 values are FP4 E2M1 codes packed two per byte, the element at even index 2i
in the low nibble of byte i and the one at 2i + 1 in the high nibble, and its scale is one E8M0
byte, the power of two 2^(s - 127). An E2M1 code is sign (bit 3), exponent (bits 2-1, bias 1)
and mantissa (bit 0), i.e. one of +-{0, 0.5, 1, 1.5, 2, 3, 4, 6} (`FP4_VALUES`, indexed by the
code). Every product code x 2^(s - 127) is exact in float32 (at most two significant bits), so
dequantizing loses nothing.

The dequantized [..., rows, 32 G] matrix is the transpose (last two axes) of the tensor
transformers' gpt-oss module holds under NAME (`integrations/mxfp4.py`, which transposes after
dequantizing), so `hf_tensor` returns that: the checkpoint then reads as an unquantized one.
"""

from __future__ import annotations

import numpy as np

FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
SCALE_BIAS = 127
BLOCK = 32  # values per block (16 bytes)
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks [..., G, B] uint8 and scales [..., G] uint8 -> values [..., G * 2 B] float32."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"mxfp4: blocks and scales must be uint8, got {blocks.dtype} and "
                         f"{scales.dtype}")
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"mxfp4: blocks {blocks.shape} do not match scales {scales.shape} "
                         "(blocks are [..., G, bytes], scales [..., G])")
    values = np.empty(blocks.shape[:-1] + (2 * blocks.shape[-1],), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    exponent = scales.astype(np.int32)[..., None] - SCALE_BIAS
    return np.ldexp(values, exponent).reshape(blocks.shape[:-2] + (-1,))


def hf_tensor(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The unquantized tensor transformers holds for `NAME_blocks` [..., rows, G, B] and
    `NAME_scales` [..., rows, G]: the dequantized rows transposed, [..., 2 B G, rows],
    dequantized one leading index at a time (bounding the host's temporaries)."""
    if blocks.ndim < 3:
        raise ValueError(f"mxfp4: blocks of shape {blocks.shape}: expected [..., rows, G, B]")
    if blocks.ndim == 3:
        return np.ascontiguousarray(dequantize(blocks, scales).T)
    return np.stack([hf_tensor(b, s) for b, s in zip(blocks, scales)])


def hf_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """`hf_tensor`'s shape for blocks of shape [..., rows, G, B]."""
    *lead, rows, groups, nbytes = blocks_shape
    return (*lead, 2 * nbytes * groups, rows)
