"""Triton kernels for y = x @ W^T with W an MLX-affine QuantizedTensor, dequantization fused in registers.

- `_qgemv_kernel` (M <= 16 rows: decode): each program owns BLOCK_N output rows of one K-slice; it streams the
  packed words, scales and biases once, dequantizes in registers and reduces with FMAs (no tensor cores: at
  M <= 16 the kernel is bound by the bytes of W). Split-K partials go to an fp32 workspace summed afterwards.
- `_qgemm_kernel` (prefill): tiles of W are dequantized to the activation dtype in registers and fed to
  `tl.dot` (tensor cores), fp32 accumulation.

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
def _load_dequant(w_ptr, s_ptr, b_ptr, offs_n, k0, N, K, stride_wn, stride_sn,
                  BITS: tl.constexpr, GS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Dequantized fp32 tile W[offs_n, k0:k0+BLOCK_K] of shape [BLOCK_N, BLOCK_K] (zeros out of range)."""
    EPW: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // EPW
    GROUPS: tl.constexpr = BLOCK_K // GS
    offs_w = k0 // EPW + tl.arange(0, WORDS)
    n_ok = offs_n < N
    words = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_w[None, :],
                    mask=n_ok[:, None] & (offs_w[None, :] < K // EPW), other=0)
    shifts = tl.arange(0, EPW) * BITS
    q = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    q = tl.reshape(q, (BLOCK_N, BLOCK_K)).to(tl.float32)
    offs_g = k0 // GS + tl.arange(0, GROUPS)
    g_mask = n_ok[:, None] & (offs_g[None, :] < K // GS)
    s = tl.load(s_ptr + offs_n[:, None] * stride_sn + offs_g[None, :], mask=g_mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs_n[:, None] * stride_sn + offs_g[None, :], mask=g_mask, other=0.0).to(tl.float32)
    q = tl.reshape(q, (BLOCK_N, GROUPS, GS))
    w = q * s[:, :, None] + b[:, :, None]
    return tl.reshape(w, (BLOCK_N, BLOCK_K))


@triton.jit
def _qgemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, k_per_split,
                  stride_xm, stride_wn, stride_sn, stride_os, stride_om,
                  BITS: tl.constexpr, GS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        w = _load_dequant(w_ptr, s_ptr, b_ptr, offs_n, k0, N, K, stride_wn, stride_sn, BITS, GS, BLOCK_N, BLOCK_K)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    tl.store(out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :], acc,
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _qgemm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                  BITS: tl.constexpr, GS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_FP32: tl.constexpr):
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)  # grouped order: neighbouring programs share W tiles in L2
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % size_m)
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
        w = _load_dequant(w_ptr, s_ptr, b_ptr, offs_n, k0, N, K, stride_wn, stride_sn, BITS, GS, BLOCK_N, BLOCK_K)
        if DOT_FP32:  # the interpreter's bf16 dot is wrong (Triton 3.9); fp32 operands are exact there
            acc = tl.dot(x.to(tl.float32), tl.trans(w), acc)
        else:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


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


def qgemv(x: torch.Tensor, qt, block_n: int | None = None, block_k: int | None = None,
          split_k: int | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T for M <= 16, in x's dtype (fp32 accumulation)."""
    check(x, qt)
    M, K = x.shape
    N = qt.weight.shape[0]
    x = x.contiguous()
    w = qt.weight.view(torch.int32)
    block_m = max(1, triton.next_power_of_2(M))
    block_k = block_k or max(qt.group_size, 128 if M <= 4 else 64)
    block_n = block_n or (64 if M <= 4 else 32)
    k_blocks = triton.cdiv(K, block_k)
    if split_k is None:  # enough programs to cover every SM a few times over
        n_blocks = triton.cdiv(N, block_n)
        split_k = max(1, min(k_blocks, (4 * _num_sms(x.device)) // max(n_blocks, 1)))
    k_per_split = triton.cdiv(k_blocks, split_k) * block_k
    split_k = triton.cdiv(K, k_per_split)
    out = torch.empty(split_k, M, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(N, block_n), split_k)
    _qgemv_kernel[grid](x, w, qt.scales, qt.biases, out, M, N, K, k_per_split,
                        x.stride(0), w.stride(0), qt.scales.stride(0), out.stride(0), out.stride(1),
                        BITS=qt.bits, GS=qt.group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                        num_warps=4)
    y = out[0] if split_k == 1 else out.sum(0)
    return y.to(x.dtype)


def qgemm(x: torch.Tensor, qt, block_m: int = 128, block_n: int = 128, block_k: int = 64,
          num_warps: int = 8, num_stages: int = 3) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T on tensor cores (prefill), in x's dtype."""
    check(x, qt)
    M, K = x.shape
    N = qt.weight.shape[0]
    x = x.contiguous()
    w = qt.weight.view(torch.int32)
    block_k = max(block_k, qt.group_size)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    _qgemm_kernel[grid](x, w, qt.scales, qt.biases, y, M, N, K, x.stride(0), w.stride(0), qt.scales.stride(0),
                        y.stride(0), BITS=qt.bits, GS=qt.group_size, BLOCK_M=block_m, BLOCK_N=block_n,
                        BLOCK_K=block_k, GROUP_M=8, DOT_FP32=INTERPRET or x.dtype == torch.float32,
                        num_warps=num_warps, num_stages=num_stages)
    return y


def qmatmul(x: torch.Tensor, qt) -> torch.Tensor:
    return qgemv(x, qt) if x.shape[0] <= GEMV_MAX_ROWS else qgemm(x, qt)
