"""CPU path for quantized matmul over the native kernels in `kernels/cpu` (fused-dequant GEMV for a few rows;
dequantize once + BLAS GEMM for many)."""

from __future__ import annotations

import torch

from sluice.kernels.cpu import available, check_buffer, lib  # noqa: F401  (available: re-exported)

SUPPORTED_BITS = (2, 4, 8)
_SCALE_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def supports(qt) -> bool:
    return (qt.bits in SUPPORTED_BITS and qt.group_size % 16 == 0 and qt.group_size <= 256
            and qt.scales.dtype in _SCALE_DTYPES and qt.weight.is_contiguous() and qt.scales.is_contiguous()
            and qt.biases.is_contiguous() and not qt.weight.is_cuda)


def _check_weights(qt) -> tuple[int, int, int]:
    """(N, K, G) of a 2-D QuantizedTensor whose packed words, scales and biases really hold N x K weights of its
    bits and group size (ValueError otherwise: the C kernels would read past them)."""
    N, K, bits, gs = qt.weight.shape[0], qt.in_features, qt.bits, qt.group_size
    if qt.weight.dim() != 2 or bits not in SUPPORTED_BITS or gs <= 0 or K % gs or K * bits % 32:
        raise ValueError(f"native CPU qmatmul: unsupported layout ({tuple(qt.weight.shape)}, in_features={K}, "
                         f"bits={bits}, group_size={gs})")
    G = K // gs
    check_buffer("packed weight", qt.weight, torch.uint32, N * K * bits // 32)
    check_buffer("scales", qt.scales, qt.scales.dtype, N * G)
    check_buffer("biases", qt.biases, qt.scales.dtype, N * G)
    if qt.scales.dtype not in _SCALE_DTYPES:
        raise ValueError(f"native CPU qmatmul: scales of dtype {qt.scales.dtype}")
    return N, K, G


class QMatmul:
    """y = x @ W^T for one 2-D QuantizedTensor W, with its call arguments prepared once (the decode loop makes
    ~100 of these calls per token, so per-call Python work matters)."""

    # Up to this many rows the fused GEMV wins; above it, dequantizing once and calling BLAS is faster.
    GEMV_MAX_ROWS = 4

    def __init__(self, qt):
        self.qt = qt  # keeps the tensors (and so the pointers) alive
        self.N, self.K, self.G = _check_weights(qt)
        self.wargs = (qt.weight.data_ptr(), qt.scales.data_ptr(), qt.biases.data_ptr(),
                      _SCALE_DTYPES[qt.scales.dtype], self.N, qt.bits, qt.group_size)
        self.fn = lib().qgemv

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 contiguous -> [M, N] float32."""
        M = x.shape[0]
        if x.dim() != 2 or x.shape[1] != self.K:
            raise ValueError(f"native CPU qmatmul: x of shape {tuple(x.shape)} for {self.K} input features")
        if M > self.GEMV_MAX_ROWS:
            return x @ dequantize_rows(self.qt).T
        check_buffer("x", x, torch.float32, M * self.K)
        buf = torch.empty(M * (self.N + self.G), dtype=torch.float32)
        self.fn(x.data_ptr(), M, self.K, *self.wargs, buf.data_ptr(), buf.data_ptr() + 4 * M * self.N)
        return buf[: M * self.N].view(M, self.N)


def dequantize_rows(qt, rows: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 rows of a 2-D QuantizedTensor (all rows when rows is None)."""
    N, K, _ = _check_weights(qt)
    if rows is not None:
        rows = rows.reshape(-1).to(torch.int64).contiguous()
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= N):
            raise IndexError(f"row index out of range for a matrix of {N} rows")
    n = N if rows is None else rows.numel()
    out = torch.empty(n, K, dtype=torch.float32)
    lib().dequant(qt.weight.data_ptr(), qt.scales.data_ptr(), qt.biases.data_ptr(), _SCALE_DTYPES[qt.scales.dtype],
                K, qt.bits, qt.group_size, None if rows is None else rows.data_ptr(), n, out.data_ptr())
    return out
