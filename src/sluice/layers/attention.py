"""GQA self-attention with RoPE over a KV cache (Llama-style: fused qkv projection, no biases)."""

from __future__ import annotations

import torch
import torch.nn as nn

from sluice.kernels.rope import qk_norm_rope
from sluice.kernels.rope.reference import apply_rope
from sluice.layers.linear import Linear, fuse_linears


class Attention(nn.Module):
    def __init__(self, qkv: Linear, o: Linear, num_heads: int, num_kv_heads: int, head_dim: int, layer_index: int):
        super().__init__()
        self.qkv, self.o = qkv, o
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer_index = layer_index
        self.scale = head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, meta) -> torch.Tensor:
        """x [B, T, hidden] at meta's rows and positions; cos, sin [B, T, rot]."""
        B, T, _ = x.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(x)
        if meta.decode and cache.attention.native_decode:  # one C call per sequence: RoPE,
            o = cache.attention.rope_decode(self.layer_index, qkv, cos, sin, meta, self.scale, H)  # cache, attention
            return self.o(o.view(B, 1, H * D))
        # RoPE on the q and k heads together: one rotation instead of two.
        qk = apply_rope(qkv[..., :(H + Hkv) * D].view(B, T, H + Hkv, D), cos[:, :, None],
                        sin[:, :, None]).transpose(1, 2)
        q, k = qk[:, :H], qk[:, H:]
        v = qkv[..., (H + Hkv) * D:].view(B, T, Hkv, D).transpose(1, 2)
        o = cache.attend(self.layer_index, q, k, v, meta, self.scale)
        return self.o(o.transpose(1, 2).reshape(B, T, H * D))


class GatedAttention(nn.Module):
    """Qwen3-Next / Qwen3.5 full attention: per-head [query | gate] projection, q/k RMSNorm (fp32 scale) before
    partial RoPE, GQA, and a sigmoid output gate before o_proj."""

    def __init__(self, q_proj: Linear, k_proj: Linear, v_proj: Linear, o_proj: Linear, q_norm: torch.Tensor,
                 k_norm: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, eps: float, cache_index: int):
        super().__init__()
        self.qkv = fuse_linears([q_proj, k_proj, v_proj])
        self.o = o_proj
        self.register_buffer("q_norm", q_norm)  # effective scales (1 + w for HF's zero-centred weights)
        self.register_buffer("k_norm", k_norm)
        self.num_heads, self.num_kv_heads, self.head_dim, self.eps = num_heads, num_kv_heads, head_dim, eps
        self.cache_index = cache_index
        self.scale = head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, meta) -> torch.Tensor:
        B, T, _ = x.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(x)
        qg, k, v = qkv.split([2 * H * D, Hkv * D, Hkv * D], dim=-1)
        q, gate = qg.view(B, T, H, 2 * D).chunk(2, dim=-1)
        k, v = k.view(B, T, Hkv, D), v.view(B, T, Hkv, D)
        # q and k norm + RoPE in one launch on CUDA; in a decode step over a dense cache it also stores k and v
        stores = cache.append_buffers(self.cache_index, meta)
        if stores is None:
            q, k = qk_norm_rope(q, k, self.q_norm, self.k_norm, cos, sin, self.eps)
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        else:
            q, k = qk_norm_rope(q, k, self.q_norm, self.k_norm, cos, sin, self.eps, v, *stores)
            v = None
        # o * sigmoid(gate): in the decode kernel's merge, or torch
        o = cache.attend(self.cache_index, q.transpose(1, 2), k, v, meta, self.scale, gate=gate.transpose(1, 2))
        return self.o(o.transpose(1, 2).reshape(B, T, H * D))
