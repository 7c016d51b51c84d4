"""Triton kernels for y = x @ W^T with W an MLX-affine QuantizedTensor, dequantization fused in registers.

- `_qgemv1_kernel` / `_qgemv_kernel` (decode, M = 1 / M <= 4): CUDA cores, W streamed in its own
  K-contiguous order, split-K.
- `_qmm_kernel` (tensor cores): one 16-row tile for 5 <= M <= 16 (split-K), 128-row tiles for prefill with
  grouped program order for L2 reuse. The codes are multiplied as exact integers.
Both apply each group's scale and bias to partial products (`s * (x.q) + b * sum(x)`), never per weight.

Packed layout (MLX): element k of a row sits in word k // (32/BITS) at bit (k % (32/BITS)) * BITS; scale and bias
of group k // GS; value = scale * q + bias. Bits 2, 4, 8; group sizes 32, 64, 128.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

SUPPORTED_BITS = (2, 4, 8)
SUPPORTED_GROUPS = (32, 64, 128)
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _qmm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, k_per_split,
                stride_xm, stride_wn, stride_sn, stride_ys, stride_ym,
                BITS: tl.constexpr, GS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_FP32: tl.constexpr):
    """y[pid_k] (+)= x[:, k-slice] @ W[:, k-slice]^T. Per group g of a row n, W = s*q + b, so
    x_g . W_g = s * (x_g . q_g) + b * sum(x_g): the codes go to the tensor cores as exact small integers and the
    scale and bias are applied once per group to the [BLOCK_M, BLOCK_N] partial, not per weight."""
    EPW: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = GS // EPW  # packed words per group
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)  # grouped order: neighbouring programs share W tiles in L2
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % size_m)
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    shifts = tl.arange(0, EPW) * BITS
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        for j in tl.static_range(BLOCK_K // GS):
            kg = k0 + j * GS
            offs_k = kg + tl.arange(0, GS)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=m_ok[:, None] & (offs_k[None, :] < k_end), other=0.0)
            offs_w = kg // EPW + tl.arange(0, WPG)
            words = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_w[None, :],
                            mask=n_ok[:, None] & (offs_w[None, :] < k_end // EPW), other=0)
            q = tl.reshape((words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1), (BLOCK_N, GS))
            g_ok = n_ok & ((kg + tl.zeros_like(offs_n)) < k_end)
            s = tl.load(s_ptr + offs_n * stride_sn + kg // GS, mask=g_ok, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + offs_n * stride_sn + kg // GS, mask=g_ok, other=0.0).to(tl.float32)
            if DOT_FP32:  # fp32 activations, or the interpreter (its bf16 dot is wrong in Triton 3.9)
                part = tl.dot(x.to(tl.float32), tl.trans(q.to(tl.float32)), input_precision="ieee")
            else:
                part = tl.dot(x, tl.trans(q.to(x.dtype)))  # codes <= 255 are exact in bf16/fp16
            xsum = tl.sum(x.to(tl.float32), axis=1)
            acc += part * s[None, :] + xsum[:, None] * b[None, :]
    tl.store(y_ptr + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _load_group(w_ptr, s_ptr, b_ptr, offs_n, n_ok, w_first, w_end, stride_wn, stride_sn, WPG: tl.constexpr):
    """One group of BLOCK_N rows starting at packed word `w_first`: its word offsets and mask, the words
    [BLOCK_N, WPG], and each row's scale and bias (fp32)."""
    offs_w = w_first + tl.arange(0, WPG)
    w_ok = offs_w < w_end
    words = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_w[None, :], mask=n_ok[:, None] & w_ok[None, :],
                    other=0)
    g_ok = n_ok & ((w_first + tl.zeros_like(offs_n)) < w_end)
    s = tl.load(s_ptr + offs_n * stride_sn + w_first // WPG, mask=g_ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs_n * stride_sn + w_first // WPG, mask=g_ok, other=0.0).to(tl.float32)
    return offs_w, w_ok, words, s, b


@triton.jit
def _qgemv1_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, N, K, k_per_split, stride_wn, stride_sn, stride_ys,
                   BITS: tl.constexpr, GS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """One activation row (decode, batch 1): y[n] = sum_k x[k] W[n, k], reading W in its own K-contiguous
    order (coalesced packed words), BLOCK_W words of each of BLOCK_N rows per step, one group at a time.
    Code j of every word is a [BLOCK_N, WPG] plane against x_planes[j] = x[j::EPW] (x regrouped once by the
    caller, so these loads are contiguous); nothing is reshaped. Per group: s * sum(q x) + b * sum(x), with s
    and b loaded once per row and group; products accumulate elementwise and are reduced once at the end."""
    EPW: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = GS // EPW
    GPB: tl.constexpr = BLOCK_W // WPG  # groups per step
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_N, WPG), dtype=tl.float32)
    w_start = pid_k * (k_per_split // EPW)
    w_end = tl.minimum(w_start + k_per_split // EPW, K // EPW)
    for w0 in range(w_start, w_end, BLOCK_W):
        for gi in tl.static_range(GPB):
            offs_w, w_ok, words, s, b = _load_group(w_ptr, s_ptr, b_ptr, offs_n, n_ok, w0 + gi * WPG, w_end,
                                                    stride_wn, stride_sn, WPG)
            dot = tl.zeros((BLOCK_N, WPG), dtype=tl.float32)
            xsum = tl.zeros((WPG,), dtype=tl.float32)
            for j in tl.static_range(EPW):
                xj = tl.load(x_ptr + j * (K // EPW) + offs_w, mask=w_ok, other=0.0).to(tl.float32)
                dot += ((words >> (j * BITS)) & ((1 << BITS) - 1)).to(tl.float32) * xj[None, :]
                xsum += xj
            acc += s[:, None] * dot + b[:, None] * xsum[None, :]
    tl.store(y_ptr + pid_k * stride_ys + offs_n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _qgemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, k_per_split, stride_wn, stride_sn, stride_ys,
                  stride_ym, BITS: tl.constexpr, GS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_W: tl.constexpr):
    """A few activation rows (decode, M <= 4): y[m, n] = sum_k x[m, k] W[n, k], on CUDA cores, reading W in its
    own K-contiguous order (coalesced packed words), BLOCK_W words of each of BLOCK_N rows per step, one group
    at a time. Code j of every word is a [BLOCK_N, WPG] plane against x_planes[:, j] = x[:, j::EPW] (x regrouped
    once by the caller, so these loads are contiguous); nothing is reshaped, and the unpacked codes serve every
    row of x. Per group: s * sum(q x) + b * sum(x), s and b loaded once per row and group; products accumulate
    elementwise and are reduced once at the end."""
    EPW: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = GS // EPW
    GPB: tl.constexpr = BLOCK_W // WPG  # groups per step
    KW = K // EPW  # words per row
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_ok, m_ok = offs_n < N, offs_m < M
    acc = tl.zeros((BLOCK_M, BLOCK_N, WPG), dtype=tl.float32)
    w_start = pid_k * (k_per_split // EPW)
    w_end = tl.minimum(w_start + k_per_split // EPW, KW)
    for w0 in range(w_start, w_end, BLOCK_W):
        for gi in tl.static_range(GPB):
            offs_w, w_ok, words, s, b = _load_group(w_ptr, s_ptr, b_ptr, offs_n, n_ok, w0 + gi * WPG, w_end,
                                                    stride_wn, stride_sn, WPG)
            dot = tl.zeros((BLOCK_M, BLOCK_N, WPG), dtype=tl.float32)
            xsum = tl.zeros((BLOCK_M, WPG), dtype=tl.float32)
            for j in tl.static_range(EPW):
                xj = tl.load(x_ptr + offs_m[:, None] * K + j * KW + offs_w[None, :],
                             mask=m_ok[:, None] & w_ok[None, :], other=0.0).to(tl.float32)
                q = ((words >> (j * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
                dot += q[None, :, :] * xj[:, None, :]
                xsum += xj
            acc += s[None, :, None] * dot + b[None, :, None] * xsum[:, None, :]
    tl.store(y_ptr + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :],
             tl.sum(acc, axis=2).to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def check(x: torch.Tensor, qt) -> None:
    """Clear errors before any launch."""
    if qt.bits not in SUPPORTED_BITS:
        raise ValueError(f"triton qmatmul: {qt.bits}-bit weights are not supported (bits {SUPPORTED_BITS})")
    if qt.group_size not in SUPPORTED_GROUPS:
        raise ValueError(f"triton qmatmul: group size {qt.group_size} is not supported ({SUPPORTED_GROUPS})")
    if qt.weight.dim() != 2:
        raise ValueError("triton qmatmul: the weight must be 2-D [N, K]")
    if x.dim() != 2 or x.shape[1] != qt.in_features:
        raise ValueError(f"triton qmatmul: x must be [M, {qt.in_features}], got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"triton qmatmul: activations must be bf16, fp16 or fp32, got {x.dtype}")
    if x.device != qt.weight.device or qt.scales.device != qt.weight.device:
        raise ValueError("triton qmatmul: x and the weight must be on the same device")
    if not (x.is_cuda or INTERPRET):
        raise ValueError("triton qmatmul: tensors must be on a CUDA device (or set TRITON_INTERPRET=1)")


GEMV_MAX_ROWS = 16


def _num_sms(device) -> int:
    if INTERPRET or not torch.cuda.is_available():
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _launch(x, qt, block_m, block_n, block_k, split_k, num_warps, num_stages):
    check(x, qt)
    M, K = x.shape
    N = qt.weight.shape[0]
    x = x.contiguous()
    w = qt.weight.view(torch.int32)
    block_k = max(block_k, qt.group_size)
    k_blocks = triton.cdiv(K, block_k)
    if split_k is None:  # enough programs to cover every SM a few times over
        tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
        split_k = max(1, min(k_blocks, (2 * _num_sms(x.device)) // max(tiles, 1)))
    k_per_split = triton.cdiv(k_blocks, split_k) * block_k
    split_k = triton.cdiv(K, k_per_split)
    # one split: the kernel writes y in x's dtype; several: fp32 partials, summed after
    out = torch.empty((split_k, M, N), dtype=x.dtype if split_k == 1 else torch.float32, device=x.device)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n), split_k)
    _qmm_kernel[grid](x, w, qt.scales, qt.biases, out, M, N, K, k_per_split, x.stride(0), w.stride(0),
                      qt.scales.stride(0), out.stride(0), out.stride(1), BITS=qt.bits, GS=qt.group_size,
                      BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
                      DOT_FP32=INTERPRET or x.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages)
    return out[0] if split_k == 1 else out.sum(0).to(x.dtype)


def qgemv(x: torch.Tensor, qt, block_n: int = 64, block_k: int = 512, split_k: int | None = None,
          num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T for few rows (decode). Up to 4 rows: the CUDA-core kernel over W's own layout;
    5..16 rows: one 16-row tensor-core tile; split-K in both to fill the GPU."""
    if x.shape[0] <= GEMV_CUDA_CORE_ROWS:
        return _gemv_cuda_cores(x, qt, block_n, block_k * qt.bits // 32, split_k, num_warps, num_stages)
    return _launch(x, qt, 16, block_n, min(block_k, 128), split_k, num_warps, num_stages)


GEMV_CUDA_CORE_ROWS = 4


def _gemv_cuda_cores(x, qt, block_n, block_w, split_k, num_warps, num_stages):
    check(x, qt)
    M, K = x.shape
    N = qt.weight.shape[0]
    epw = 32 // qt.bits
    block_w = max(block_w, qt.group_size // epw)  # whole groups per step
    k_block = block_w * epw
    k_blocks = triton.cdiv(K, k_block)
    if split_k is None:
        split_k = max(1, min(k_blocks, (4 * _num_sms(x.device)) // max(triton.cdiv(N, block_n), 1)))
    k_per_split = triton.cdiv(k_blocks, split_k) * k_block
    split_k = triton.cdiv(K, k_per_split)
    # [M, EPW, K/EPW]: plane j of row m holds x[m, j::EPW], so the kernel's loads of x are contiguous
    x_planes = x.reshape(M, K // epw, epw).transpose(1, 2).contiguous()
    out = torch.empty((split_k, M, N), dtype=x.dtype if split_k == 1 else torch.float32, device=x.device)
    if M == 1:  # the 2-D kernel: measured ~1.3-1.5x faster than the general one at M = 1
        _qgemv1_kernel[(triton.cdiv(N, block_n), split_k)](
            x_planes, qt.weight.view(torch.int32), qt.scales, qt.biases, out, N, K, k_per_split, qt.weight.stride(0),
            qt.scales.stride(0), out.stride(0), BITS=qt.bits, GS=qt.group_size, BLOCK_N=block_n, BLOCK_W=block_w,
            num_warps=num_warps, num_stages=num_stages)
        return out[0] if split_k == 1 else out.sum(0).to(x.dtype)
    _qgemv_kernel[(triton.cdiv(N, block_n), split_k)](
        x_planes, qt.weight.view(torch.int32), qt.scales, qt.biases, out, M, N, K, k_per_split, qt.weight.stride(0),
        qt.scales.stride(0), out.stride(0), out.stride(1), BITS=qt.bits, GS=qt.group_size,
        BLOCK_M=triton.next_power_of_2(M), BLOCK_N=block_n, BLOCK_W=block_w, num_warps=num_warps,
        num_stages=num_stages)
    return out[0] if split_k == 1 else out.sum(0).to(x.dtype)


def qgemm(x: torch.Tensor, qt, block_m: int = 128, block_n: int = 128, block_k: int = 64,
          num_warps: int = 8, num_stages: int = 3) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T on tensor cores (prefill), in x's dtype."""
    return _launch(x, qt, block_m, block_n, block_k, 1, num_warps, num_stages)


def qmatmul(x: torch.Tensor, qt) -> torch.Tensor:
    return qgemv(x, qt) if x.shape[0] <= GEMV_MAX_ROWS else qgemm(x, qt)
