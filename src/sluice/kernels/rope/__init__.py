"""Rotary position embedding: `reference.py` (the torch oracle), `triton.py` (q/k norm + partial RoPE fused, and the
cos/sin tables in one launch)."""

from __future__ import annotations

import torch

from sluice.kernels.norm.reference import rms_norm_fp32_scale
from sluice.kernels.rope import reference
from sluice.kernels.rope.reference import apply_rope


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos, sin [..., rotary_dim] of integer positions [...] (`reference.rope_cos_sin`): one Triton launch on CUDA."""
    if positions.is_cuda:
        from sluice.kernels.rope import triton as rope_triton

        return rope_triton.rope_cos_sin(positions, inv_freq, dtype)
    return reference.rope_cos_sin(positions, inv_freq, dtype)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, eps: float, v: torch.Tensor | None = None,
                 k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                 positions: torch.Tensor | None = None, rows: torch.Tensor | None = None):
    """(q', k') = apply_rope(rms_norm_fp32_scale(x, w, eps), cos, sin) of q [B, T, Hq, D] and k [B, T, Hkv, D],
    each with its weight; cos/sin [B, T, r]. With k_cache, v_cache [P, Hkv, cap, D] (a decode step, T = 1): k' and
    v are written into row rows[b], slot positions[b] % cap of the caches instead and k' is None. One Triton launch
    on CUDA, the torch references elsewhere."""
    if q.is_cuda:
        try:
            from sluice.kernels.rope import triton as rope_triton
        except ImportError:
            rope_triton = None
        if rope_triton is not None:
            return rope_triton.qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps, v, k_cache, v_cache, positions,
                                            rows)
    q, k = (apply_rope(rms_norm_fp32_scale(x, w, eps), cos[:, :, None], sin[:, :, None])
            for x, w in ((q, q_weight), (k, k_weight)))
    if k_cache is None:
        return q, k
    slots = positions.long() % k_cache.shape[2]
    k_cache[rows.long(), :, slots] = k[:, 0].to(k_cache.dtype)
    v_cache[rows.long(), :, slots] = v[:, 0].to(v_cache.dtype)
    return q, None
