"""Rotary position embedding: `reference.py` (the torch oracle), `triton.py` (q/k norm + partial RoPE fused)."""

from __future__ import annotations

import torch

from sluice.kernels.norm.reference import rms_norm_fp32_scale
from sluice.kernels.rope.reference import apply_rope


def norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """apply_rope(rms_norm_fp32_scale(x, weight, eps), cos, sin) for x [B, T, heads, D], cos/sin [B, T, r]: one
    Triton launch on CUDA, the torch references elsewhere."""
    if x.is_cuda:
        try:
            from sluice.kernels.rope import triton as rope_triton
        except ImportError:
            rope_triton = None
        if rope_triton is not None:
            return rope_triton.norm_rope(x, weight, cos, sin, eps)
    return apply_rope(rms_norm_fp32_scale(x, weight, eps), cos[:, :, None], sin[:, :, None])
