"""GGUF tensors onto sluice's layout: dense types to torch tensors, Q4_0/Q4_1/Q8_0 to MLX-affine without loss.

Each of those block types is an affine code over 32 consecutive inputs with fp16 parameters:

* Q4_0 ``f16 d; u8 qs[16]``: ``x = d*(q-8)``  -> 4-bit codes q, scale d, bias -8d
* Q4_1 ``f16 d; f16 m; u8 qs[16]``: ``x = d*q + m``  -> 4-bit codes q, scale d, bias m
* Q8_0 ``f16 d; i8 qs[32]``: ``x = d*q``  -> 8-bit codes q+128, scale d, bias -128d

so they map onto ``QuantizedTensor(bits, group_size=32)``. In fp32 ``scale*q' + bias`` equals the GGUF formula
bit for bit: ``d`` has an 11-bit significand and the codes at most 8 bits, so every product and the final sum are
exact. In Q4_0/Q4_1 byte j of a block holds element j (low nibble) and element j+16 (high nibble); MLX wants
sequential pairs, so the nibbles are re-packed.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from sluice.errors import ModelFileError, UnsupportedError
from sluice.quant.affine import QuantizedTensor, pack

T = GGMLQuantizationType
SUPPORTED_GGUF_TYPES = (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q8_0)
_DENSE = {T.F32: (np.float32, torch.float32), T.F16: (np.float16, torch.float16), T.BF16: (np.int16, torch.bfloat16)}


def from_gguf(data: np.ndarray, ggml_type: GGMLQuantizationType | int, shape: tuple[int, ...] | None = None,
              *, name: str | None = None) -> QuantizedTensor | torch.Tensor:
    """A GGUF tensor's data (as ``gguf.ReaderTensor.data`` gives it: typed for F32/F16, raw bytes with rows
    ``[..., bytes_per_row]`` otherwise; any array holding the right bytes works) -> a dense torch tensor
    (F32, F16, BF16: dtype kept) or a QuantizedTensor (Q4_0, Q4_1, Q8_0).

    ``shape`` is the torch shape (the reversed GGUF dims, input dim last); without it, it is read off ``data``.
    Raises UnsupportedError for any other type and ModelFileError when the byte count does not match the shape.
    """
    what = f"tensor {name!r}" if name else "GGUF tensor"
    try:
        qtype = GGMLQuantizationType(int(ggml_type))
    except ValueError:
        raise UnsupportedError(f"{what} has unknown GGUF type id {int(ggml_type)}; the file may be newer than "
                               "this gguf package, or corrupt.") from None
    if qtype not in SUPPORTED_GGUF_TYPES:
        raise UnsupportedError(
            f"{what} has GGUF type {qtype.name}, which sluice does not support yet; supported: "
            f"{', '.join(t.name for t in SUPPORTED_GGUF_TYPES)}. Re-quantize the model to one of those "
            f"(e.g. llama-quantize --allow-requantize model.gguf out.gguf Q4_1, or Q8_0).")
    block, type_size = GGML_QUANT_SIZES[qtype]
    data = np.asarray(data)
    if shape is None:
        # Raw bytes (uint8) carry the row's byte count in the last dim; typed arrays carry the element count.
        shape = data.shape
        if data.dtype.itemsize == 1 and data.ndim:
            shape = (*data.shape[:-1], data.shape[-1] // type_size * block)
    shape = tuple(int(d) for d in shape)
    if not shape or shape[-1] % block:
        raise ModelFileError(f"{what}: shape {shape} does not fit {qtype.name} blocks of {block} elements.")
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    expected = math.prod(shape) // block * type_size
    if raw.size != expected:
        raise ModelFileError(f"{what}: {qtype.name} data of shape {shape} needs {expected} bytes, found "
                             f"{raw.size}; the file is truncated or corrupt.")

    if qtype in _DENSE:
        np_dtype, torch_dtype = _DENSE[qtype]
        t = torch.from_numpy(raw.view(np_dtype).copy()).reshape(shape)  # copy: the reader's memmap is read-only
        return t.view(torch_dtype)  # BF16: int16 bits reinterpreted

    blocks = raw.reshape(-1, type_size)
    d = _f16(blocks, 0)
    if qtype == T.Q8_0:
        codes = blocks[:, 2:] ^ np.uint8(0x80)  # int8 q -> uint8 q+128 (flipping the sign bit)
        bits, biases = 8, _exact_product(d, -128.0)
        scales = d
    else:
        qs = blocks[:, 4:] if qtype == T.Q4_1 else blocks[:, 2:]
        codes = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=1)  # elements 0..15, then 16..31
        bits = 4
        if qtype == T.Q4_1:
            scales, biases = d, _f16(blocks, 2)
        else:
            scales, biases = d, _exact_product(d, -8.0)
    if scales.dtype != biases.dtype:  # a bias only fp32 holds exactly: keep both in fp32
        scales = scales.astype(np.float32)
    groups = (*shape[:-1], shape[-1] // block)
    weight = pack(torch.from_numpy(np.ascontiguousarray(codes).reshape(shape)), bits)
    qt = QuantizedTensor(weight, torch.from_numpy(scales.reshape(groups)), torch.from_numpy(biases.reshape(groups)),
                         bits, block)
    qt.validate(name)
    return qt


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 field at byte ``offset`` of every block, as a contiguous float16 array."""
    return blocks[:, offset:offset + 2].copy().view(np.float16).reshape(-1)  # copy: the memmap is read-only


def _exact_product(d: np.ndarray, k: float) -> np.ndarray:
    """``k*d`` as fp16 when that is exact (always, unless it overflows fp16), else as fp32 (always exact)."""
    wide = d.astype(np.float32) * np.float32(k)
    with np.errstate(over="ignore"):
        narrow = wide.astype(np.float16)
    return narrow if np.array_equal(narrow.astype(np.float32), wide, equal_nan=True) else wide
