"""RMSNorm through the native CPU kernels (one call instead of ~6 torch ops in the decode loop)."""

import torch

from sluice.kernels.cpu import check_buffer, lib


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 RMSNorm over the last dim of a contiguous fp32 tensor (fp32 weight of that length)."""
    D = x.shape[-1]
    check_buffer("x", x, torch.float32, x.numel())
    check_buffer("weight", weight, torch.float32, D)
    if weight.numel() != D:
        raise ValueError(f"native CPU RMSNorm: weight has {weight.numel()} elements for rows of {D}")
    out = torch.empty_like(x)
    lib().rms_norm(x.data_ptr(), weight.data_ptr(), eps, x.numel() // max(D, 1), D, out.data_ptr())
    return out
