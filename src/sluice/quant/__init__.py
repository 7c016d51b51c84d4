"""Quantized weights: the MLX affine layout (`affine`) and GGUF block types mapped onto it (`gguf_blocks`,
imported on its own so the kernels do not need the `gguf` package)."""

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

__all__ = [
    "QuantizedTensor",
    "SCALE_DTYPES",
    "SUPPORTED_BITS",
    "SUPPORTED_GROUP_SIZES",
    "dequantize",
    "pack",
    "quantize",
    "unpack",
]
