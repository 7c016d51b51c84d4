"""The attention layers' q/k head norm and partial RoPE in one Triton launch (Qwen3-Next / Qwen3.5 gated attention):
out = apply_rope(rms_norm_fp32_scale(x, w), cos, sin), with every rounding where the references round
(`norm.reference.rms_norm_fp32_scale`, `rope.reference.apply_rope`): the norm in fp32, rounded once to x's dtype;
each RoPE product and the sum rounded to that dtype, as torch's elementwise ops in bf16 do. A rotary element needs
its partner (i + r/2 or i - r/2): the row is loaded a second time in partner order (from L1) rather than shuffled."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels.norm.triton import FLOAT_DTYPES, INTERPRET, as_rows, round_to, row_block


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr, R, H, D, ROT, stride_xo, stride_xh, stride_c, eps,
                      RNE_BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows are (token, head) pairs addressed as [tokens, heads, D]; cos/sin [tokens, ROT]."""
    rows, tok, head, offs, d_ok, mask = row_block(R, H, D, BLOCK_R, BLOCK_D)
    half = ROT // 2
    partner = tl.where(offs < half, offs + half, tl.where(offs < ROT, offs - half, offs))
    base = (tok.to(tl.int64) * stride_xo + head.to(tl.int64) * stride_xh)[:, None]
    x = tl.load(x_ptr + base + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    xq = tl.load(x_ptr + base + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
    dt = y_ptr.dtype.element_ty
    n = round_to((x * inv) * tl.load(w_ptr + offs, mask=d_ok, other=0.0).to(tl.float32)[None, :], dt, RNE_BF16)
    nq = round_to((xq * inv) * tl.load(w_ptr + partner, mask=d_ok, other=0.0).to(tl.float32)[None, :], dt, RNE_BF16)
    rot = (offs < ROT)[None, :]
    c_off = tok.to(tl.int64)[:, None] * stride_c + tl.where(offs < ROT, offs, 0)[None, :]
    c = tl.load(cos_ptr + c_off, mask=mask & rot, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + c_off, mask=mask & rot, other=0.0).to(tl.float32)
    sign = tl.where(offs < half, -1.0, 1.0)[None, :]
    y = round_to(round_to(n * c, dt, RNE_BF16) + sign * round_to(nq * s, dt, RNE_BF16), dt, RNE_BF16)
    y = tl.where(rot, y, n)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * D + offs[None, :], y.to(dt), mask=mask)


def norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
              block_elems: int = 2048, num_warps: int = 4) -> torch.Tensor:
    """x [B, T, heads, D] (a view with unit last stride is read in place), weight [D], cos, sin [B, T, r] (r even,
    <= D) -> apply_rope(rms_norm_fp32_scale(x, weight, eps), cos[:, :, None], sin[:, :, None]), contiguous."""
    what = "norm_rope"
    if x.dim() != 4 or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{what}: x must be a bf16/fp16/fp32 [B, T, heads, D] tensor, got {x.dtype} "
                         f"{tuple(x.shape)}")
    B, T, H, D = x.shape
    r = cos.shape[-1]
    if tuple(cos.shape) != (B, T, r) or sin.shape != cos.shape or r % 2 or not 0 < r <= D:
        raise ValueError(f"{what}: cos and sin must be [{B}, {T}, r] with r even and <= {D}, got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if weight.dim() != 1 or weight.shape[0] != D:
        raise ValueError(f"{what}: weight must be [{D}], got {tuple(weight.shape)}")
    if not (x.is_cuda or INTERPRET) or any(t.device != x.device for t in (weight, cos, sin)):
        raise ValueError(f"{what}: all tensors must be on one CUDA device (or set TRITON_INTERPRET=1)")
    y = torch.empty((B, T, H, D), dtype=x.dtype, device=x.device)
    R = B * T * H
    if R == 0:
        return y
    x3 = as_rows(x, B * T, H, D)
    cos, sin = (t.reshape(B * T, r).contiguous() for t in (cos, sin))
    block_d = triton.next_power_of_2(D)
    block_r = min(max(1, block_elems // block_d), triton.next_power_of_2(R))
    _norm_rope_kernel[(triton.cdiv(R, block_r),)](
        x3, weight.contiguous(), cos, sin, y, R, H, D, r, x3.stride(0), x3.stride(1), cos.stride(0), eps,
        RNE_BF16=INTERPRET, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=num_warps)
    return y
