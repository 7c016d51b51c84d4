"""Triton kernel of Gated DeltaNet's output norm (HF Qwen3NextRMSNormGated), the oracle `reference.gated_rms_norm`:
out = (w * rmsnorm(x)) * silu(z) per row of D (the head dim), rounded where the reference rounds:
rmsnorm in fp32 -> x's dtype; times w in the promoted dtype of (w, x) (exact in fp32 for bf16/fp16 operands,
then rounded once, like torch); times silu(z) in fp32 -> x's dtype.

One program normalises BLOCK_R rows x D (about 4K elements), so a [T * heads, 128] input is T * heads / 32
programs rather than one per row. x and z are addressed as [outer, heads, D] with two row strides each: z is
typically a slice of the fused in-projection's output reshaped to [B, T, heads, D], whose (B, T) rows are not a
multiple of heads * D apart, and copying it would cost a pass over memory.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from sluice.kernels.launch import pdl, pdl_start, round_to
from sluice.kernels.moe import ExpertOutputs
from sluice.kernels.moe.triton import expert_sum

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_D = 8192  # a row lives in registers
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def row_block(R, H, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's rows of an [outer, heads, D] tensor: (rows, outer index, head index, column offsets,
    column mask, [BLOCK_R, BLOCK_D] mask). Shared by the row-wise norm kernels (here and `kernels/rope`)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    outer = rows // H
    head = rows - outer * H
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    return rows, outer, head, offs_d, d_ok, (rows < R)[:, None] & d_ok[None, :]


@triton.jit
def gated_rms_norm_rows(x, z, w, D, eps, X_DTYPE: tl.constexpr, H_DTYPE: tl.constexpr, RNE_BF16: tl.constexpr):
    """(w * rmsnorm(x)) * silu(z) of [rows, BLOCK_D] fp32 tiles x (values of X_DTYPE) and z, zero past column D,
    w [BLOCK_D] fp32: fp32, rounded to X_DTYPE. The math of `_gated_rms_norm_kernel`, shared with the GDN decode
    kernel that fuses it (`kernels/gdn/triton.py`): the same operations in the same order."""
    inv = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    n = round_to(x * inv[:, None], X_DTYPE, RNE_BF16)
    h = round_to(w[None, :] * n, H_DTYPE, RNE_BF16)
    return round_to(h * (z * tl.sigmoid(z)), X_DTYPE, RNE_BF16)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, y_ptr, R, H, D, stride_xo, stride_xh, stride_zo, stride_zh, eps,
                           H_DTYPE: tl.constexpr, RNE_BF16: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    rows, outer, head, offs_d, d_ok, mask = row_block(R, H, D, BLOCK_R, BLOCK_D)
    x_rows = outer.to(tl.int64) * stride_xo + head.to(tl.int64) * stride_xh
    x = tl.load(x_ptr + x_rows[:, None] + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    z_rows = outer.to(tl.int64) * stride_zo + head.to(tl.int64) * stride_zh
    z = tl.load(z_ptr + z_rows[:, None] + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    out = gated_rms_norm_rows(x, z, w, D, eps, x_ptr.dtype.element_ty, H_DTYPE, RNE_BF16)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * D + offs_d[None, :], out.to(y_ptr.dtype.element_ty), mask=mask)


def rows_per_program(block_d: int, block_elems: int) -> int:
    """Rows one program of a row-wise kernel takes: set by the row length alone, never by the row count, so a row's
    reductions run in the same order whatever the batch (a sequence's tokens do not depend on its batch)."""
    return max(1, block_elems // block_d)


def as_rows(t: torch.Tensor, outer: int, heads: int, D: int) -> torch.Tensor:
    """t [..., D] as an [outer, heads, D] view with unit last stride (a copy only if no such view exists)."""
    if t.stride(-1) == 1:
        try:
            return t.view(outer, heads, D)
        except RuntimeError:
            pass
    return t.contiguous().view(outer, heads, D)


def weight_product_dtype(weight_dtype: torch.dtype, x_dtype: torch.dtype):
    """The Triton dtype of `weight * normed` in torch (normed in x's dtype): the gated norm rounds there."""
    return _TL_DTYPES[torch.promote_types(weight_dtype, x_dtype)]


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   block_elems: int = 4096, num_warps: int = 4) -> torch.Tensor:
    """x, z [..., D] (bf16/fp16/fp32; views with unit last stride are read in place), weight [D]
    -> w * rmsnorm(x) * silu(z), [..., D] in x's dtype (contiguous), as `reference.gated_rms_norm`."""
    what = "gated_rms_norm"
    if x.dim() < 1 or x.dtype not in FLOAT_DTYPES or z.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{what}: x and z must be bf16, fp16 or fp32 [..., D], got {x.dtype} {tuple(x.shape)} and "
                         f"{z.dtype}")
    if z.shape != x.shape:
        raise ValueError(f"{what}: z {tuple(z.shape)} must have x's shape {tuple(x.shape)}")
    D = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != D or weight.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{what}: weight must be a bf16/fp16/fp32 [{D}] tensor, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    if not 1 <= D <= MAX_D:
        raise ValueError(f"{what}: D must be in [1, {MAX_D}], got {D}")
    if x.device != z.device or x.device != weight.device:
        raise ValueError(f"{what}: all tensors must be on the same device")
    if not (x.is_cuda or INTERPRET):
        raise ValueError(f"{what}: tensors must be on a CUDA device (or set TRITON_INTERPRET=1)")

    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    R = x.numel() // D
    if R == 0:
        return y
    heads = x.shape[-2] if x.dim() >= 2 else 1
    outer = R // heads
    x3, z3 = as_rows(x, outer, heads, D), as_rows(z, outer, heads, D)
    weight = weight if weight.stride(0) == 1 else weight.contiguous()
    block_d = triton.next_power_of_2(D)
    block_r = rows_per_program(block_d, block_elems)
    h_dtype = weight_product_dtype(weight.dtype, x.dtype)
    _gated_rms_norm_kernel[(triton.cdiv(R, block_r),)](
        x3, z3, weight, y, R, heads, D, x3.stride(0), x3.stride(1), z3.stride(0), z3.stride(1), eps,
        H_DTYPE=h_dtype, RNE_BF16=INTERPRET, BLOCK_R=block_r, BLOCK_D=block_d, PDL=pdl(y.device),
        launch_pdl=pdl(y.device), num_warps=num_warps)
    return y


@triton.jit
def _add_rms_norm_kernel(h_ptr, d_ptr, w_ptr, s_ptr, y_ptr, R, H, D, stride_ho, stride_hh, stride_do, stride_dh, eps,
                         ey_ptr, ew_ptr, es_ptr, eg_ptr, ES, stride_eys, stride_eym, stride_esh, stride_eg,
                         DELTA: tl.constexpr, TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr,
                         RNE_BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """s = h + delta (rounded to h's dtype, as torch adds), y = (s * rsqrt(mean(s^2) + eps)) * w in fp32, rounded
    once (`reference.rms_norm_fp32_scale`); rows addressed as [outer, heads, D]. DELTA 0: none; 1: a tensor; 2: an
    MoE block's unsummed outputs (`moe.triton.expert_sum`, rounded to h's dtype as `combine` rounds)."""
    pdl_start(PDL)
    rows, outer, head, offs_d, d_ok, mask = row_block(R, H, D, BLOCK_R, BLOCK_D)
    h_rows = outer.to(tl.int64) * stride_ho + head.to(tl.int64) * stride_hh
    x = tl.load(h_ptr + h_rows[:, None] + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    out_rows = rows.to(tl.int64)[:, None] * D + offs_d[None, :]
    if DELTA == 1:
        d_rows = outer.to(tl.int64) * stride_do + head.to(tl.int64) * stride_dh
        x += tl.load(d_ptr + d_rows[:, None] + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    if DELTA == 2:
        x += round_to(expert_sum(ey_ptr, ew_ptr, es_ptr, eg_ptr, rows, rows < R, offs_d, d_ok, ES, stride_eys,
                                 stride_eym, stride_esh, stride_eg, TOP_K, HAS_SHARED),
                      h_ptr.dtype.element_ty, RNE_BF16)
    if DELTA != 0:
        x = round_to(x, h_ptr.dtype.element_ty, RNE_BF16)
        tl.store(s_ptr + out_rows, x.to(s_ptr.dtype.element_ty), mask=mask)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    w = tl.load(w_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    y = round_to((x * inv[:, None]) * w[None, :], y_ptr.dtype.element_ty, RNE_BF16)
    tl.store(y_ptr + out_rows, y.to(y_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | ExpertOutputs | None, weight: torch.Tensor, eps: float,
                 block_elems: int = 2048, num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, y): s = h + delta in h's dtype (delta of the same dtype; h itself, as it is, when delta is None) and
    y = `reference.rms_norm_fp32_scale(s, weight, eps)` [..., D] contiguous, in one launch: the residual add and the
    next layer's input norm of a decoder block. h and delta may be views with unit last stride (read in place).
    delta may be an MoE block's `ExpertOutputs` (its tokens the rows of h): summed here, the bits of `combine`."""
    what = "add_rms_norm"
    experts = delta if isinstance(delta, ExpertOutputs) else None
    if experts is not None:
        delta = None
        if experts.dtype != h.dtype or experts.y.shape[2] != h.shape[-1] or experts.weights.shape[0] * h.shape[-1] \
                != h.numel():
            raise ValueError(f"{what}: the expert outputs ({experts.weights.shape[0]} tokens of "
                             f"{experts.y.shape[2]}, {experts.dtype}) must match h {h.dtype} {tuple(h.shape)}")
    if h.dim() < 1 or h.dtype not in FLOAT_DTYPES or (delta is not None and (delta.shape != h.shape
                                                                        or delta.dtype != h.dtype)):
        got = f"{h.dtype} {tuple(h.shape)}" + ("" if delta is None else f" and {delta.dtype} {tuple(delta.shape)}")
        raise ValueError(f"{what}: h (and delta of its shape) must be bf16, fp16 or fp32 [..., D], got {got} (delta "
                         "in h's dtype)")
    D = h.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != D or weight.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{what}: weight must be a float [{D}] tensor, got {weight.dtype} {tuple(weight.shape)}")
    if not 1 <= D <= MAX_D:
        raise ValueError(f"{what}: D must be in [1, {MAX_D}], got {D}")
    if any(t.device != h.device for t in (weight, delta, experts and experts.y) if t is not None):
        raise ValueError(f"{what}: all tensors must be on the same device")
    if not (h.is_cuda or INTERPRET):
        raise ValueError(f"{what}: tensors must be on a CUDA device (or set TRITON_INTERPRET=1)")
    y = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    s = h if delta is None and experts is None else torch.empty(h.shape, dtype=h.dtype, device=h.device)
    R = h.numel() // D
    if R == 0:
        return s, y
    heads = h.shape[-2] if h.dim() >= 2 else 1
    outer = R // heads
    h3 = as_rows(h, outer, heads, D)
    d3 = h3 if delta is None else as_rows(delta, outer, heads, D)
    weight = weight if weight.stride(0) == 1 else weight.contiguous()
    block_d = triton.next_power_of_2(D)
    block_r = rows_per_program(block_d, block_elems)
    ey, ew, es, eg, ES, *e_strides, top_k, has_shared = (experts.args() if experts is not None else
                                                         (h3, weight, h3, weight, 1, 0, 0, 0, 0, 1, False))
    if num_warps is None:  # the expert sum loads k rows per row: enough threads to have them all in flight at once
        num_warps = 4 if experts is None else 16
    _add_rms_norm_kernel[(triton.cdiv(R, block_r),)](
        h3, d3, weight, s, y, R, heads, D, h3.stride(0), h3.stride(1), d3.stride(0), d3.stride(1), eps,
        ey, ew, es, eg, ES, *e_strides, DELTA=2 if experts is not None else int(delta is not None), TOP_K=top_k,
        HAS_SHARED=has_shared, RNE_BF16=INTERPRET, BLOCK_R=block_r, BLOCK_D=block_d, PDL=pdl(y.device),
        launch_pdl=pdl(y.device), num_warps=num_warps)
    return s, y
