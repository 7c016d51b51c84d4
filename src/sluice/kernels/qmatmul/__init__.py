"""Quantized matmul y = x @ W^T with W an MLX-affine QuantizedTensor; picks the implementation by device.

CPU: the C kernel (fused dequant GEMV for a few rows; dequantize once + BLAS GEMM for many rows), else the
torch reference. CUDA: the torch reference until the Triton kernels land.
"""

import torch

from sluice.kernels.qmatmul import cpu, reference

# Up to this many rows the fused GEMV wins; above it, dequantizing once and calling BLAS is faster.
GEMV_MAX_ROWS = 4


def qmatmul(x: torch.Tensor, qt) -> torch.Tensor:
    K = x.shape[-1]
    if K != qt.in_features:
        raise ValueError(f"qmatmul: x has {K} features but the weight expects {qt.in_features}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if not x.is_cuda and cpu.supports(qt) and cpu.available():
        x2 = x2.float().contiguous()
        y = cpu.gemv(x2, qt) if x2.shape[0] <= GEMV_MAX_ROWS else x2 @ cpu.dequantize_rows(qt).T
    else:
        y = reference.qmatmul(x2, qt)
    return y.reshape(*lead, y.shape[-1]).to(x.dtype)


def dequantize_rows(qt, rows: torch.Tensor) -> torch.Tensor:
    """fp32 rows of W (an embedding lookup)."""
    if not qt.weight.is_cuda and cpu.supports(qt) and cpu.available():
        return cpu.dequantize_rows(qt, rows).reshape(*rows.shape, qt.in_features)
    from sluice.quant.affine import QuantizedTensor

    sub = QuantizedTensor(qt.weight[rows], qt.scales[rows], qt.biases[rows], qt.bits, qt.group_size)
    return sub.dequantize(torch.float32)
