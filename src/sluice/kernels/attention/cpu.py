"""Attention decode step through the native CPU kernels: RoPE, cache write and GQA attention in one call
(replaces ~20 small torch ops per layer per token)."""

import torch

from sluice.kernels.cpu import lib


def decode_step(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, pos: int, scale: float) -> torch.Tensor:
    """qkv [Hq + 2 Hkv, D] fp32 contiguous (one token); cos, sin [rot]; k_cache, v_cache [Hkv, cap, D] fp32
    contiguous. Writes rope(k), v at `pos` and returns the attention output [Hq * D]."""
    Hkv, cap, D = k_cache.shape
    Hq = qkv.shape[0] - 2 * Hkv
    if D > 512 or Hq % Hkv or pos >= cap:
        raise ValueError(f"attn decode: unsupported shape (Hq={Hq}, Hkv={Hkv}, D={D}, pos={pos}, cap={cap})")
    out = torch.empty(Hq * D, dtype=torch.float32)
    lib().attn_decode(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                      Hq, Hkv, D, cos.shape[-1], cap, pos, scale, out.data_ptr())
    return out
