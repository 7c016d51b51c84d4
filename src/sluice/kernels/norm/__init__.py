"""RMSNorms: `reference.py` (the torch oracles), `triton.py` (CUDA), `cpu.py` (the native CPU kernel)."""

from __future__ import annotations

import torch

from sluice.kernels.moe import ExpertOutputs
from sluice.kernels.norm import reference


def add_rms_norm_fp32_scale(h: torch.Tensor, delta, weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, its Qwen RMSNorm `reference.rms_norm_fp32_scale`): one Triton launch on CUDA, the torch
    reference elsewhere. delta None: (h, the norm of h); delta may be an MoE block's unsummed
    `moe.ExpertOutputs` (only a CUDA MoE makes them), summed in the same launch."""
    if h.is_cuda:
        try:
            from sluice.kernels.norm import triton as norm_triton
        except ImportError:
            norm_triton = None
        if norm_triton is not None:
            return norm_triton.add_rms_norm(h, delta, weight, eps)
    if isinstance(delta, ExpertOutputs):
        delta = delta.combine().view(h.shape)
    s = h if delta is None else h + delta
    return s, reference.rms_norm_fp32_scale(s, weight, eps)
