"""Torch reference for quantized matmul: dequantize to fp32, then a plain matmul. The oracle for every kernel."""

import torch


def qmatmul(x: torch.Tensor, qt) -> torch.Tensor:
    """x [..., K] @ W^T for a 2-D QuantizedTensor W [N, K]; fp32 result."""
    return x.float() @ qt.dequantize(torch.float32).T
