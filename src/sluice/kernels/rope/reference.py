"""Rotary position embedding, HF "rotate_half" convention (first half / second half of the rotary dims)."""

import torch


def rope_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos, sin [..., rotary_dim] for integer positions [...] (computed in fp32 as HF does)."""
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., D] with cos, sin broadcastable to x[..., :r]: rotates the first r = cos.shape[-1] dims (partial
    RoPE); the rest pass through."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    xr, xp = x[..., :r], x[..., r:]
    return torch.cat((xr * cos + rotate_half(xr) * sin, xp), dim=-1)
