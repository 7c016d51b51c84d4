"""Quantized weights: the MLX affine layout (`affine`) and GGUF block types mapped onto it (`gguf_blocks`)."""

from sluice.quant.affine import (
    SCALE_DTYPES,
    SUPPORTED_BITS,
    SUPPORTED_GROUP_SIZES,
    QuantizedTensor,
    dequantize,
    pack,
    quantize,
    unpack,
)
from sluice.quant.gguf_blocks import SUPPORTED_GGUF_TYPES, from_gguf

__all__ = [
    "QuantizedTensor",
    "SCALE_DTYPES",
    "SUPPORTED_BITS",
    "SUPPORTED_GGUF_TYPES",
    "SUPPORTED_GROUP_SIZES",
    "dequantize",
    "from_gguf",
    "pack",
    "quantize",
    "unpack",
]
