"""The gated attention's q- and k-head norms and partial RoPE in one Triton launch (Qwen3-Next / Qwen3.5), and in a
decode step over a dense cache the new key and value written straight into the cache too: out = apply_rope(
rms_norm_fp32_scale(x, w), cos, sin) for the q heads (weight wq) and the k heads (weight wk), with every rounding
where the references round (`norm.reference.rms_norm_fp32_scale`, `rope.reference.apply_rope`): the norm in fp32,
rounded once to x's dtype; each RoPE product and the sum rounded to that dtype, as torch's elementwise ops in bf16
do. A rotary element needs its partner (i + r/2 or i - r/2): the row is loaded a second time in partner order (from
L1) rather than shuffled. Programs take BLOCK_R rows (token, head) of q, then of k (a program's rows are all q or
all k). The cache append reads sequence b's position and cache row on the device (slot position % capacity), so a
CUDA graph captures it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels.launch import pdl, pdl_start
from sluice.kernels.norm.triton import FLOAT_DTYPES, INTERPRET, as_rows, round_to, rows_per_program


@triton.jit
def _norm_rope_kernel(q_ptr, k_ptr, v_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, yq_ptr, yk_ptr, kc_ptr, vc_ptr,
                      pos_ptr, rows_ptr, Rq, Rk, Hq, Hkv, D, ROT, cap, stride_qo, stride_qh, stride_ko, stride_kh,
                      stride_vo, stride_vh, stride_c, stride_cb, stride_ch, stride_ct, eps,
                      CACHE: tl.constexpr, RNE_BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                      PDL: tl.constexpr):
    """q [tokens, Hq, D], k and v [tokens, Hkv, D] by their strides; cos/sin [tokens, ROT]. CACHE (one token per
    sequence): k's rows and v's go to kc, vc [P, Hkv, cap, D] at row rows[t], slot pos[t] % cap, not to yk."""
    pdl_start(PDL)
    block = tl.program_id(0)
    n_q = tl.cdiv(Rq, BLOCK_R)
    dt = q_ptr.dtype.element_ty
    if block < n_q:
        y, rows, tok, head, offs, mask = _norm_rope_rows(q_ptr, wq_ptr, cos_ptr, sin_ptr, block, Rq, Hq, D, ROT,
                                                         stride_qo, stride_qh, stride_c, eps, dt, RNE_BF16, BLOCK_R,
                                                         BLOCK_D)
        tl.store(yq_ptr + rows.to(tl.int64)[:, None] * D + offs[None, :], y.to(dt), mask=mask)
    else:
        y, rows, tok, head, offs, mask = _norm_rope_rows(k_ptr, wk_ptr, cos_ptr, sin_ptr, block - n_q, Rk, Hkv, D,
                                                         ROT, stride_ko, stride_kh, stride_c, eps, dt, RNE_BF16,
                                                         BLOCK_R, BLOCK_D)
        if CACHE:
            ok = rows < Rk
            slot = tl.load(pos_ptr + tok, mask=ok, other=0) % cap
            row = tl.load(rows_ptr + tok, mask=ok, other=0)
            at = (row.to(tl.int64) * stride_cb + head.to(tl.int64) * stride_ch
                  + slot.to(tl.int64) * stride_ct)[:, None] + offs[None, :]
            cdt = kc_ptr.dtype.element_ty
            tl.store(kc_ptr + at, round_to(y, cdt, RNE_BF16).to(cdt), mask=mask)
            v_at = (tok.to(tl.int64) * stride_vo + head.to(tl.int64) * stride_vh)[:, None] + offs[None, :]
            v = tl.load(v_ptr + v_at, mask=mask, other=0.0).to(tl.float32)
            tl.store(vc_ptr + at, round_to(v, cdt, RNE_BF16).to(cdt), mask=mask)
        else:
            tl.store(yk_ptr + rows.to(tl.int64)[:, None] * D + offs[None, :], y.to(dt), mask=mask)


@triton.jit
def _norm_rope_rows(x_ptr, w_ptr, cos_ptr, sin_ptr, block, R, H, D, ROT, stride_xo, stride_xh, stride_c, eps,
                    dt: tl.constexpr, RNE_BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows block * BLOCK_R.. of x [tokens, H, D] normed and rotated (fp32 holding dt values), with (rows, token,
    head, column offsets, mask)."""
    rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
    tok = rows // H
    head = rows - tok * H
    offs = tl.arange(0, BLOCK_D)
    d_ok = offs < D
    mask = (rows < R)[:, None] & d_ok[None, :]
    half = ROT // 2
    partner = tl.where(offs < half, offs + half, tl.where(offs < ROT, offs - half, offs))
    base = (tok.to(tl.int64) * stride_xo + head.to(tl.int64) * stride_xh)[:, None]
    x = tl.load(x_ptr + base + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    xq = tl.load(x_ptr + base + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
    n = round_to((x * inv) * tl.load(w_ptr + offs, mask=d_ok, other=0.0).to(tl.float32)[None, :], dt, RNE_BF16)
    nq = round_to((xq * inv) * tl.load(w_ptr + partner, mask=d_ok, other=0.0).to(tl.float32)[None, :], dt, RNE_BF16)
    rot = (offs < ROT)[None, :]
    c_off = tok.to(tl.int64)[:, None] * stride_c + tl.where(offs < ROT, offs, 0)[None, :]
    c = tl.load(cos_ptr + c_off, mask=mask & rot, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + c_off, mask=mask & rot, other=0.0).to(tl.float32)
    sign = tl.where(offs < half, -1.0, 1.0)[None, :]
    y = round_to(round_to(n * c, dt, RNE_BF16) + sign * round_to(nq * s, dt, RNE_BF16), dt, RNE_BF16)
    return tl.where(rot, y, n), rows, tok, head, offs, mask


@triton.jit
def _cos_sin_kernel(pos_ptr, inv_ptr, cos_ptr, sin_ptr, N, HALF, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                    PDL: tl.constexpr, ON_CPU: tl.constexpr):
    """cos, sin [N, 2 HALF] of freqs = float(pos[t]) * inv_freq[j], column j and j + HALF alike
    (`reference.rope_cos_sin`): fp32, libdevice's accurate cos and sin (as torch's), rounded once to the output.
    ON_CPU: the interpreter's (numpy's) cos and sin, and its bf16 casts made to round to nearest even."""
    pdl_start(PDL)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_t < N)[:, None] & (offs_h < HALF)[None, :]
    freqs = (tl.load(pos_ptr + offs_t, mask=offs_t < N, other=0).to(tl.float32)[:, None]
             * tl.load(inv_ptr + offs_h, mask=offs_h < HALF, other=0.0)[None, :])
    if ON_CPU:
        c, s = tl.cos(freqs), tl.sin(freqs)
    else:
        c, s = tl.extra.cuda.libdevice.cos(freqs), tl.extra.cuda.libdevice.sin(freqs)
    dt = cos_ptr.dtype.element_ty
    c, s = round_to(c, dt, ON_CPU).to(dt), round_to(s, dt, ON_CPU).to(dt)
    out = offs_t.to(tl.int64)[:, None] * (2 * HALF) + offs_h[None, :]
    for half in tl.static_range(2):
        tl.store(cos_ptr + out + half * HALF, c, mask=mask)
        tl.store(sin_ptr + out + half * HALF, s, mask=mask)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """`reference.rope_cos_sin` in one launch: cos, sin [*positions.shape, 2 * len(inv_freq)] in dtype."""
    flat = positions.reshape(-1).contiguous()
    inv = inv_freq.to(device=flat.device, dtype=torch.float32).contiguous()
    N, half = flat.numel(), inv.numel()
    cos = torch.empty((N, 2 * half), dtype=dtype, device=flat.device)
    sin = torch.empty_like(cos)
    if N:
        block_h = triton.next_power_of_2(half)
        block_t = max(1, min(64, 4096 // block_h))
        _cos_sin_kernel[(triton.cdiv(N, block_t),)](flat, inv, cos, sin, N, half, BLOCK_T=block_t, BLOCK_H=block_h,
                                                     PDL=pdl(flat.device), ON_CPU=INTERPRET,
                                                     launch_pdl=pdl(flat.device), num_warps=4)
    shape = (*positions.shape, 2 * half)
    return cos.view(shape), sin.view(shape)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, eps: float, v: torch.Tensor | None = None,
                 k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                 positions: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                 block_elems: int = 2048, num_warps: int = 4):
    """q [B, T, Hq, D], k [B, T, Hkv, D] (views with unit last stride are read in place), weights [D], cos, sin
    [B, T, r] (r even, <= D) -> (q', k'), each apply_rope(rms_norm_fp32_scale(x, w, eps), cos[:, :, None],
    sin[:, :, None]), contiguous. With k_cache, v_cache [P, Hkv, cap, D] (T = 1): k' and v [B, 1, Hkv, D] go
    into cache row rows[b] at slot positions[b] % cap (int32/int64 [B] on the device) instead, and k' is None."""
    what = "qk_norm_rope"
    if q.dim() != 4 or k.dim() != 4 or q.dtype not in FLOAT_DTYPES or k.dtype != q.dtype:
        raise ValueError(f"{what}: q and k must be bf16/fp16/fp32 [B, T, heads, D] tensors of one dtype, got "
                         f"{q.dtype} {tuple(q.shape)} and {k.dtype} {tuple(k.shape)}")
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    r = cos.shape[-1]
    if k.shape[:2] != (B, T) or k.shape[3] != D:
        raise ValueError(f"{what}: k {tuple(k.shape)} must be [{B}, {T}, heads, {D}]")
    if tuple(cos.shape) != (B, T, r) or sin.shape != cos.shape or r % 2 or not 0 < r <= D:
        raise ValueError(f"{what}: cos and sin must be [{B}, {T}, r] with r even and <= {D}, got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if any(w.dim() != 1 or w.shape[0] != D for w in (q_weight, k_weight)):
        raise ValueError(f"{what}: weights must be [{D}], got {tuple(q_weight.shape)} and {tuple(k_weight.shape)}")
    cache = k_cache is not None
    tensors = [k, q_weight, k_weight, cos, sin]
    if cache:
        if T != 1 or v is None or v.shape != k.shape or v_cache is None or k_cache.dim() != 4 \
                or tuple(k_cache.shape[1:]) != (Hkv, k_cache.shape[2], D) or v_cache.shape != k_cache.shape \
                or v_cache.stride() != k_cache.stride() or k_cache.stride(-1) != 1 or v_cache.dtype != k_cache.dtype:
            raise ValueError(f"{what}: a cache append takes one token per sequence, v shaped as k and k, v caches "
                             f"[P, {Hkv}, cap, {D}] of one layout with unit last stride")
        for name, index in (("positions", positions), ("rows", rows)):
            if index is None or index.shape != (B,) or index.dtype not in (torch.int32, torch.int64) \
                    or not index.is_contiguous():
                raise ValueError(f"{what}: {name} must be contiguous int32 or int64 [{B}]")
        tensors += [v, k_cache, v_cache, positions, rows]
    if not (q.is_cuda or INTERPRET) or any(t.device != q.device for t in tensors):
        raise ValueError(f"{what}: all tensors must be on one CUDA device (or set TRITON_INTERPRET=1)")
    yq = torch.empty((B, T, Hq, D), dtype=q.dtype, device=q.device)
    yk = None if cache else torch.empty((B, T, Hkv, D), dtype=q.dtype, device=q.device)
    Rq, Rk = B * T * Hq, B * T * Hkv
    if Rq + Rk == 0:
        return yq, yk
    q3, k3 = as_rows(q, B * T, Hq, D), as_rows(k, B * T, Hkv, D)
    v3 = as_rows(v, B * T, Hkv, D) if cache else k3
    cos, sin = (t.reshape(B * T, r).contiguous() for t in (cos, sin))
    kc, vc = (k_cache, v_cache) if cache else (yq, yq)
    block_d = triton.next_power_of_2(D)
    block_r = rows_per_program(block_d, block_elems)
    grid = (triton.cdiv(Rq, block_r) + triton.cdiv(Rk, block_r),)
    _norm_rope_kernel[grid](
        q3, k3, v3, q_weight.contiguous(), k_weight.contiguous(), cos, sin, yq, yq if cache else yk, kc, vc,
        positions if cache else cos, rows if cache else cos, Rq, Rk, Hq, Hkv, D, r, kc.shape[2] if cache else 1,
        q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), v3.stride(0), v3.stride(1), cos.stride(0),
        kc.stride(0) if cache else 0, kc.stride(1) if cache else 0, kc.stride(2) if cache else 0, eps,
        CACHE=cache, RNE_BF16=INTERPRET, BLOCK_R=block_r, BLOCK_D=block_d, PDL=pdl(q.device),
        launch_pdl=pdl(q.device), num_warps=num_warps)
    return yq, yk
