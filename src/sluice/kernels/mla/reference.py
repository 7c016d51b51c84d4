"""MLA attention in plain PyTorch, the oracle for later kernels.

Per token the cache holds c (the normalised latent, kv_lora_rank R values) and k_pe (the roped key, shared by all
heads); per head h, kv_b_proj holds W_UK[h] [nope, R] (keys: k_nope = W_UK c) and W_UV[h] [v, R] (values: v = W_UV c).
Query t (position p) sees keys 0..p.

* decompressed: K = [W_UK c | k_pe], V = W_UV c for every cached position, then ordinary attention (prefill);
* absorbed ("folded"): q' = W_UK^T q_nope per head, scores = q'·c + q_pe·k_pe, out = W_UV (softmax · c): the
  cache is read as it is, once for all heads (decode).

Both take the matmuls in the inputs' dtype and the softmax in fp32, as HF's eager attention does.
"""

from __future__ import annotations

import torch

from sluice.kernels.attention.reference import attention


def decompressed_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor,
                           w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """q_nope [B, T, H, nope], q_pe [B, T, H, rope]: the queries of the last T of the S cached positions, whose
    latents are c [B, S, R] and roped keys k_pe [B, S, rope]; w_uk [H, nope, R], w_uv [H, v, R]. Causal, aligned to
    the bottom right. Returns [B, T, H, v]."""
    B, S, _ = c.shape
    H, rope = w_uk.shape[0], k_pe.shape[-1]
    k_nope = torch.einsum("bsr,hnr->bhsn", c, w_uk.to(c.dtype))
    v = torch.einsum("bsr,hvr->bhsv", c, w_uv.to(c.dtype))
    k = torch.cat([k_nope, k_pe[:, None].expand(B, H, S, rope)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2).to(k.dtype)
    return attention(q, k, v, scale).transpose(1, 2).to(q_nope.dtype)


def absorbed_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, cached: torch.Tensor, w_uk: torch.Tensor,
                       w_uv: torch.Tensor, scale: float, positions: torch.Tensor | None = None) -> torch.Tensor:
    """q_nope [B, T, H, nope], q_pe [B, T, H, rope] over the cache rows cached [B, S, R + rope] ([latent | roped
    key] per position); positions [B, T]: query t of row b sees keys 0..positions[b, t] (None: all S keys).
    Returns [B, T, H, v]."""
    R = w_uk.shape[-1]
    dt = cached.dtype
    c, k_pe = cached[..., :R], cached[..., R:]
    q_lat = torch.einsum("bthn,hnr->bthr", q_nope.to(dt), w_uk.to(dt))  # q' = W_UK^T q_nope, per head
    scores = (torch.einsum("bthr,bsr->bths", q_lat, c) + torch.einsum("bthp,bsp->bths", q_pe.to(dt), k_pe)).float()
    scores = scores * scale
    if positions is not None:
        keys = torch.arange(cached.shape[1], device=cached.device)
        hidden = keys[None, None, :] > positions[:, :, None].long()  # [B, T, S]
        scores = scores.masked_fill(hidden[:, :, None], float("-inf"))
    p = torch.softmax(scores, dim=-1).to(dt)
    ctx = torch.einsum("bths,bsr->bthr", p, c)  # softmax · latents, per head
    return torch.einsum("bthr,hvr->bthv", ctx, w_uv.to(dt)).to(q_nope.dtype)
