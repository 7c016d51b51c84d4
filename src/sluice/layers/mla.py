"""Multi-head latent attention (DeepSeek-V2/V3 MLA), HF `DeepseekV3Attention`'s math over a latent cache.

x -> [q_a | kv_a] in one matmul (or [q | kv_a] without a q LoRA); q = q_b(RMSNorm(q_a)) per head [nope | rope];
kv_a = [latent (kv_lora_rank) | k_pe (rope, one key shared by all heads)]; the latent RMS-normalised; RoPE on q_pe and
k_pe (rotate-half: DeepSeek's interleaved rope rows are reordered at load, `models/deepseek_v3.py`), with YaRN's
cos/sin factor in the tables and its mscale in `scale`. The cache (`cache/latent.py`) keeps the latent and the
roped key; kv_b_proj, per head W_UK [nope, R] and W_UV [v, R], decompresses them (prefill) or is folded into the
query and the output (decode). Then o_proj.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from sluice.kernels.mla import chain
from sluice.kernels.rope.reference import apply_rope
from sluice.layers.linear import Linear, RMSNorm

LORA_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: HF's and mlx-lm's default, whatever rms_norm_eps says


class MLA(nn.Module):
    # On a GPU a decode step without host rows (a captured graph) takes the batched, masked path of
    # `MLAAttention.forward`: device tensors only, so it can be captured.
    capturable = True

    def __init__(self, proj_a: nn.Module, q_a_norm: torch.Tensor | None, q_b: Linear | None, kv_a_norm: torch.Tensor,
                 kv_b: Linear, o: Linear, num_heads: int, q_lora_rank: int, kv_lora_rank: int, nope: int, rope: int,
                 v_head_dim: int, scale: float, layer_index: int):
        super().__init__()
        self.proj_a, self.q_b, self.kv_b, self.o = proj_a, q_b, kv_b, o
        self.q_a_norm = None if q_a_norm is None else RMSNorm(q_a_norm, LORA_NORM_EPS)
        self.kv_a_norm = RMSNorm(kv_a_norm, LORA_NORM_EPS)
        self.num_heads, self.q_lora_rank, self.kv_lora_rank = num_heads, q_lora_rank, kv_lora_rank
        self.nope, self.rope, self.v_head_dim = nope, rope, v_head_dim
        self.scale, self.layer_index = scale, layer_index

    def per_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj per head: W_UK [H, nope, R] and W_UV [H, v, R] (views of the dense weight)."""
        w = self.kv_b.weight.view(self.num_heads, self.nope + self.v_head_dim, self.kv_lora_rank)
        return w[:, :self.nope], w[:, self.nope:]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, meta, unsummed: bool = False):
        """x [B, T, hidden] at meta's rows and positions; cos, sin [B, T, rope]. unsummed: o_proj's output may come
        as its GEMV's split-K partials (`kernels.mla.chain.Partials`, for a residual add that sums them)."""
        B, T, _ = x.shape
        H, R = self.num_heads, self.kv_lora_rank
        attention = cache.attention
        if T == 1 and meta.decode and not meta.flat and getattr(attention, "fuses_decode", None) is not None \
                and attention.fuses_decode(x) and chain.applies(x) and isinstance(self.o, Linear):  # (not split)
            return self._fused_decode(x, cos, sin, cache, meta, unsummed)
        a = self.proj_a(x)
        if self.q_b is not None:
            q_a, kv = a.split([self.q_lora_rank, R + self.rope], dim=-1)
            q = self.q_b(self.q_a_norm(q_a.contiguous()))
        else:
            q, kv = a.split([H * (self.nope + self.rope), R + self.rope], dim=-1)
        q_nope, q_pe = q.view(B, T, H, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        c = self.kv_a_norm(kv[..., :R].contiguous())
        q_pe = apply_rope(q_pe, cos[:, :, None], sin[:, :, None])
        k_pe = apply_rope(kv[..., R:], cos, sin)
        w_uk, w_uv = self.per_head()
        forward, index, scale = cache.attention.forward, self.layer_index, self.scale
        o = cache.mix(lambda m, qn, qp, lat, kp: forward(index, qn, qp, lat, kp, m, scale, w_uk, w_uv),
                      meta, q_nope.contiguous(), q_pe.contiguous(), c, k_pe.contiguous())
        return self.o(o.reshape(B, T, H * self.v_head_dim))

    def _fused_decode(self, x, cos, sin, cache, meta, unsummed):
        """A decode step (one token a sequence) on the GPU: the projections' split-K partials go to
        `fused.mla_prep` (latent norm, RoPE, cache store, W_UK fold: one launch), then the split kernel and its
        merge, then `fused.uv_out` (W_UV, o_proj's layout) and o_proj: about 7 launches instead of ~40."""
        B = x.shape[0]
        qn = self.num_heads * (self.nope + self.rope)
        x2 = x.reshape(B, -1)
        if self.q_b is not None:  # q_a normed (a launch of its own: q_b's GEMV needs it whole), then q_b
            a = self.proj_a(x2)
            q = chain.gemv_partials(self.q_b, _llama_norm(a[:, :self.q_lora_rank], self.q_a_norm))
            kv = a[None, :, self.q_lora_rank:]
        else:
            a = chain.gemv_partials(self.proj_a, x2)
            q, kv = a[..., :qn], a[..., qn:]
        w_uk, w_uv = self.per_head()
        index, scale, dtype = self.layer_index, self.scale, x.dtype
        decode, norm = cache.attention.fused_decode, self.kv_a_norm

        def mixer(m, q, kv, cos, sin):
            return decode(index, q, kv, cos, sin, norm.weight, norm.eps, m, scale, w_uk, w_uv, dtype)

        o = cache.mix(mixer, meta, q, kv, cos.reshape(B, -1), sin.reshape(B, -1))
        y = chain.gemv_partials(self.o, o)
        out = chain.Partials(y, dtype)
        return out if unsummed else out.sum().view(B, 1, -1)


def _llama_norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """`norm(x)` (Llama's rounding), one launch on the fused path (x a view of rows, read in place)."""
    return chain.add_rms_norm(x, None, norm)[1]


# -- YaRN (HF `_compute_yarn_parameters` and DeepSeek's softmax mscale) ------------------------------------------

def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, base: float, factor: float, original_max_positions: int, beta_fast: float = 32.0,
                  beta_slow: float = 1.0, truncate: bool = True) -> torch.Tensor:
    """YaRN's inverse frequencies [dim / 2] (fp32): interpolated (/ factor) below the correction range,
    extrapolated (as plain RoPE) above it, a linear ramp between."""
    def correction_dim(rotations):
        return dim * math.log(original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
