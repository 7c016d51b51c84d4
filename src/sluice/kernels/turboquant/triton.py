"""Quantize-on-append for the TurboQuant KV cache on CUDA: one launch per K or V of a decode step, checked against
`reference.quantize`.

Program: up to 16 vectors (sequence, KV head) of the new position. y = (x * signs) @ H / sqrt(d) (H the +-1
Hadamard matrix in bf16; bf16 inputs multiply exactly, fp32 ones as a bf16 hi + lo pair; fp32 accumulation), in
two halves; the code of each coordinate of sqrt(d) y / |y| by a 4-step binary search over the 15 cell boundaries;
scale = |x| / |levels[codes]|; codes packed two per byte (byte i: coordinate i low, i + d/2 high) into the cache
slot, the scale beside them, and the exact rotated vector into the recent ring.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from sluice.kernels.turboquant import reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # its bf16 tl.dot is wrong (Triton 3.9): fp32 operands there


@triton.jit
def _append_kernel(x_ptr, sign_ptr, h_ptr, lv_ptr, bd_ptr, codes_ptr, scale_ptr, ring_ptr, n_rows, Hkv, slot, rslot,
                   stride_xr, stride_cb, stride_ch, stride_ct, stride_sb, stride_sh, stride_rb, stride_rh, stride_rt,
                   D: tl.constexpr, BF16: tl.constexpr, INTERPRET: tl.constexpr):
    rows = tl.program_id(0) * 16 + tl.arange(0, 16)
    ok = rows < n_rows
    d = tl.arange(0, D)
    dh = tl.arange(0, D // 2)
    x = tl.load(x_ptr + rows[:, None] * stride_xr + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    xs = x * tl.load(sign_ptr + d)[None, :]  # a sign flip: still exactly the input's bf16 values
    # the two halves of y = xs H / sqrt(d) (H's columns 0..d/2-1 and d/2..d-1): they go to the low and the high
    # nibbles
    y_lo = _times_h(xs, tl.load(h_ptr + d[:, None] * D + dh[None, :]), BF16, INTERPRET) * (1.0 / tl.sqrt(D * 1.0))
    y_hi = _times_h(xs, tl.load(h_ptr + d[:, None] * D + D // 2 + dh[None, :]), BF16, INTERPRET) * (
        1.0 / tl.sqrt(D * 1.0))
    norm = tl.sqrt(tl.sum(y_lo * y_lo, axis=1) + tl.sum(y_hi * y_hi, axis=1))
    unit = tl.sqrt(D * 1.0) / tl.maximum(norm, 1e-30)
    c_lo = _nearest_code(y_lo * unit[:, None], bd_ptr)
    c_hi = _nearest_code(y_hi * unit[:, None], bd_ptr)
    lv_lo = tl.load(lv_ptr + c_lo)
    lv_hi = tl.load(lv_ptr + c_hi)
    scale = norm / tl.maximum(tl.sqrt(tl.sum(lv_lo * lv_lo, axis=1) + tl.sum(lv_hi * lv_hi, axis=1)), 1e-30)
    b = rows // Hkv
    hh = rows % Hkv
    tl.store(codes_ptr + b[:, None].to(tl.int64) * stride_cb + hh[:, None] * stride_ch + slot * stride_ct + dh[None, :],
             (c_lo | (c_hi << 4)).to(tl.uint8), mask=ok[:, None])
    tl.store(scale_ptr + b.to(tl.int64) * stride_sb + hh * stride_sh + slot, scale, mask=ok)
    ring = ring_ptr + b[:, None].to(tl.int64) * stride_rb + hh[:, None] * stride_rh + rslot * stride_rt + dh[None, :]
    tl.store(ring, y_lo.to(ring_ptr.dtype.element_ty), mask=ok[:, None])
    tl.store(ring + D // 2, y_hi.to(ring_ptr.dtype.element_ty), mask=ok[:, None])


@triton.jit
def _times_h(xs, h, BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """xs @ h for h of +-1 in bf16 (exact): fp32 under the interpreter; else x = hi + lo in bf16 (lo = 0 for bf16
    inputs), ~16 significant bits on bf16 tensor cores."""
    if INTERPRET:
        return tl.dot(xs, h.to(tl.float32), input_precision="ieee")
    hi = xs.to(tl.bfloat16)
    y = tl.dot(hi, h)
    if not BF16:
        y += tl.dot((xs - hi.to(tl.float32)).to(tl.bfloat16), h)
    return y


@triton.jit
def _nearest_code(yn, bd_ptr):
    """The number of cell boundaries below each coordinate, by a 4-step binary search over the 15 boundaries."""
    code = tl.zeros(yn.shape, dtype=tl.int32)
    for step in tl.static_range(4):
        half = 8 >> step
        code += tl.where(yn > tl.load(bd_ptr + code + (half - 1)), half, 0)
    return code


@triton.jit
def _rotate_kernel(x_ptr, y_ptr, sign_ptr, h_ptr, n_rows, stride_xr, D: tl.constexpr, INVERSE: tl.constexpr,
                   BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """16 rows: y = (x * s) H / sqrt(d) (R x), or with INVERSE y = (x H) * s / sqrt(d) (R^T x); fp32 out."""
    rows = tl.program_id(0) * 16 + tl.arange(0, 16)
    ok = rows < n_rows
    d = tl.arange(0, D)
    x = tl.load(x_ptr + rows[:, None] * stride_xr + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    s = tl.load(sign_ptr + d)[None, :]
    if not INVERSE:
        x = x * s
    y = _times_h(x, tl.load(h_ptr + d[:, None] * D + d[None, :]), BF16, INTERPRET) * (1.0 / tl.sqrt(D * 1.0))
    if INVERSE:
        y = y * s
    tl.store(y_ptr + rows[:, None] * D + d[None, :], y, mask=ok[:, None])


_TABLES: dict = {}


def _tables(D: int, device):
    key = (D, device)
    if key not in _TABLES:
        _TABLES[key] = (reference.signs(D, device), reference.hadamard(D, device).to(torch.bfloat16).contiguous(),
                        reference.codebook(device), reference.boundaries(device))
    return _TABLES[key]


def rotate(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """reference.rotate (or with inverse, reference.unrotate) over the last dim on the GPU, one launch: fp32 out.
    (cuBLAS took ~30 us for the [16, 256] x [256, 256] fp32 product of one decode step.)"""
    D = x.shape[-1]
    rows = x.reshape(-1, D)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty(rows.shape, dtype=torch.float32, device=x.device)
    signs, hadamard, _, _ = _tables(D, x.device)
    _rotate_kernel[(triton.cdiv(rows.shape[0], 16),)](rows, y, signs, hadamard, rows.shape[0], rows.stride(0), D=D,
                                                      INVERSE=inverse, BF16=x.dtype == torch.bfloat16,
                                                      INTERPRET=INTERPRET, num_warps=4)
    return y.reshape(x.shape)


def quantize_append(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, ring: torch.Tensor, slot: int,
                    ring_slot: int) -> None:
    """x [B, Hkv, D] (the new position's keys or values) -> codes[:, :, slot] (uint8 [B, Hkv, cap, D/2]),
    scales[:, :, slot] (fp32 [B, Hkv, cap]) and ring[:, :, ring_slot] (the rotated x, [B, Hkv, R, D])."""
    B, Hkv, D = x.shape
    if D & (D - 1) or D < 16 or D > 256 or codes.shape[-1] != D // 2 or codes.dtype != torch.uint8:
        raise ValueError(f"quantize_append: D = {D} must be a power of two in 16..256 and codes uint8 [..., D/2]")
    if scales.stride(-1) != 1 or codes.stride(-1) != 1 or ring.stride(-1) != 1:
        raise ValueError("quantize_append: cache tensors need a unit last stride")
    rows = x.reshape(B * Hkv, D)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    signs, hadamard, levels, bounds = _tables(D, x.device)
    _append_kernel[(triton.cdiv(B * Hkv, 16),)](
        rows, signs, hadamard, levels, bounds, codes, scales, ring, B * Hkv, Hkv, slot, ring_slot,
        rows.stride(0), codes.stride(0), codes.stride(1), codes.stride(2), scales.stride(0), scales.stride(1),
        ring.stride(0), ring.stride(1), ring.stride(2),
        D=D, BF16=x.dtype == torch.bfloat16, INTERPRET=INTERPRET, num_warps=4)
