"""Quantized matmul y = x @ W^T with W an MLX-affine QuantizedTensor; picks the implementation by device.

CPU: the native kernel (fused dequant GEMV for a few rows; dequantize once + BLAS GEMM for many rows), else the
torch reference. CUDA: the Triton kernels (bits 2/4/8, groups 32/64/128), else the torch reference.
"""

import torch

from sluice.kernels.qmatmul import cpu, reference


def prepare(qt):
    """The fastest implementation of x @ W^T for this weight where it lives, as a callable on x [M, K] (any float
    dtype; returns [M, N])."""
    if qt.weight.is_cuda:
        triton_mm = _triton_for(qt)
        if triton_mm is not None:
            return triton_mm
        return lambda x2: reference.qmatmul(x2, qt)
    if cpu.supports(qt) and cpu.available():
        native = cpu.QMatmul(qt)
        return lambda x2: native(x2 if x2.dtype == torch.float32 and x2.is_contiguous() else x2.float().contiguous())
    return lambda x2: reference.qmatmul(x2, qt)


def _triton_for(qt):
    try:
        from sluice.kernels.qmatmul import triton as qmm
    except ImportError:  # no Triton: the reference (correct, slow)
        return None
    if qt.bits not in qmm.SUPPORTED_BITS or qt.group_size not in qmm.SUPPORTED_GROUPS or qt.weight.dim() != 2:
        return None
    from sluice.kernels.qmatmul import gemm

    return lambda x2: gemm.qmatmul(x2, qt)


def qmatmul(x: torch.Tensor, qt, prepared=None) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x's dtype. `prepared` (from `prepare(qt)`) saves per-call set-up."""
    K = x.shape[-1]
    if K != qt.in_features:
        raise ValueError(f"qmatmul: x has {K} features but the weight expects {qt.in_features}")
    fn = prepared or prepare(qt)
    y = fn(x.reshape(-1, K))
    y = y.view(*x.shape[:-1], y.shape[-1])
    return y if y.dtype == x.dtype else y.to(x.dtype)


def dequantize_rows(qt, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows of W in `dtype` (an embedding lookup): s * q + b in fp32, rounded once to dtype."""
    if not qt.weight.is_cuda and cpu.supports(qt) and cpu.available():
        return cpu.dequantize_rows(qt, rows).reshape(*rows.shape, qt.in_features).to(dtype)
    if qt.weight.is_cuda and qt.weight.dim() == 2:
        from sluice.kernels.qmatmul import triton as qmm

        if qt.bits in qmm.SUPPORTED_BITS and qt.group_size in qmm.SUPPORTED_GROUPS:
            return qmm.dequantize_rows(qt, rows, dtype)  # one launch, not a gather and a dozen elementwise kernels
    from sluice.quant.affine import QuantizedTensor

    words = qt.weight.view(torch.int32)[rows].view(torch.uint32)  # CUDA has no uint32 gather; int32 is the same bits
    sub = QuantizedTensor(words, qt.scales[rows], qt.biases[rows], qt.bits, qt.group_size)
    return sub.dequantize(dtype)
