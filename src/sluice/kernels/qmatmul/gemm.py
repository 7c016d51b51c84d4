"""Tensor-core GEMMs for y = x @ W^T with W an MLX-affine QuantizedTensor, and the dispatch by rows.

- `_qgemm_kernel` (M >= 2): per quantization group the codes are loaded packed and made s q + b in registers
  (`group_weights`: for 4-bit bf16, 128 + q made from the bits two codes an instruction by `_MAGIC_BF16_ASM`, then
  128 taken off and one bf16 FMA; exact fp32 where the dot is fp32), and the dot accumulates across groups
  (`accumulate`); for few rows the operands are swapped (W is the wide side) and K is split. The MoE grouped GEMM
  (`moe.triton`) makes its tiles with the same three functions.
- `qmatmul`: per row count, the CUDA-core GEMV (`qmatmul.triton`), this GEMM, or dequantize + cuBLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels.launch import INTERPRET, num_sms
from sluice.kernels.qmatmul.triton import GEMV_MAX_ROWS, check, dequantize, qgemv


@triton.jit
def unpack_codes(words, BITS: tl.constexpr):
    """codes [BLOCK_N, W * EPW] from words [BLOCK_N, W] (code j of a word at bits j * BITS), unpacked by joins,
    so that each thread keeps the codes of the words it loaded (no reshuffle between threads)."""
    w = words.to(tl.uint32, bitcast=True)
    M: tl.constexpr = (1 << BITS) - 1
    if BITS == 8:
        t = tl.join(tl.join(w & M, (w >> 16) & M), tl.join((w >> 8) & M, (w >> 24) & M))
    else:  # nibble j at [j // 4, j // 2 % 2, j % 2] after the joins: the flat order
        t = tl.join(tl.join(tl.join(w, w >> 16), tl.join(w >> 8, w >> 24)),
                    tl.join(tl.join(w >> 4, w >> 20), tl.join(w >> 12, w >> 28)))
        if BITS == 4:
            t = t & M
        else:  # 2 bits: two codes per nibble
            t = tl.join(t & M, (t >> 2) & M)
    return tl.reshape(t, (words.shape[0], words.shape[1] * (32 // BITS)))


# 4-bit codes to bf16 128 + q, two a register: bytes i of w and of w >> 4 side by side (prmt), masked to their low
# nibbles under the exponent of 128 (lop3 (a & b) | c). Eight copies of a word in, its eight codes out, in order.
_MAGIC_BF16_ASM = tl.constexpr("""{
.reg .b32 hi;
shr.u32 hi, $4, 4;
prmt.b32 $0, $4, hi, 0x0400;
prmt.b32 $1, $4, hi, 0x0501;
prmt.b32 $2, $4, hi, 0x0602;
prmt.b32 $3, $4, hi, 0x0703;
lop3.b32 $0, $0, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 $1, $1, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 $2, $2, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 $3, $3, 0x000F000F, 0x43004300, 0xEA;
}""")


@triton.jit
def _magic_bf16_asm(words):
    """bf16 128 + q [BLOCK_N, W * 8] from 4-bit words [BLOCK_N, W] in 2.25 instructions a code (`_MAGIC_BF16_ASM`)."""
    w = tl.join(tl.join(tl.join(words, words), tl.join(words, words)),
                tl.join(tl.join(words, words), tl.join(words, words)))
    w = tl.reshape(w, (words.shape[0], words.shape[1] * 8))
    return tl.inline_asm_elementwise(_MAGIC_BF16_ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r,r", [w], dtype=tl.bfloat16,
                                     is_pure=True, pack=8)


@triton.jit
def group_weights(words, s, b, BITS: tl.constexpr, MAGIC: tl.constexpr, ASM: tl.constexpr):
    """W[rows, one group] = s q + b from the packed codes words [BLOCK_N, P / EPW] and the group's scales and
    biases s, b [BLOCK_N]. MAGIC: in bf16, q made the bf16 128 + q by its bits (ASM: by `_MAGIC_BF16_ASM`), 128
    taken off exactly, then one bf16 FMA: one rounding, as bf16 weights have. Else exact, in fp32 (`accumulate`
    rounds them to the activations' dtype where the dot is not fp32)."""
    if MAGIC:
        if ASM:
            v = _magic_bf16_asm(words)
        else:
            v = (unpack_codes(words, BITS) | 0x4300).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        w = (v - 128.0) * s.to(tl.bfloat16)[:, None] + b.to(tl.bfloat16)[:, None]
    else:
        q = unpack_codes(words, BITS)
        w = q.to(tl.float32) * s.to(tl.float32)[:, None] + b.to(tl.float32)[:, None]
    return w


@triton.jit
def accumulate(acc, a, wt, SWAP: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc + a @ wt^T (SWAP: acc + wt @ a^T), accumulated inside the dot; wt from `group_weights`."""
    if DOT_FP32:  # fp32 activations, or the interpreter (its bf16 dot is wrong in Triton 3.9)
        a, wt = a.to(tl.float32), wt.to(tl.float32)
        if SWAP:
            acc = tl.dot(wt, tl.trans(a), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(wt), acc, input_precision="ieee")
    else:
        wt = wt.to(a.dtype)
        if SWAP:
            acc = tl.dot(wt, tl.trans(a), acc)
        else:
            acc = tl.dot(a, tl.trans(wt), acc)
    return acc


@triton.jit
def _qgemm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, k_per_split,
                  stride_xm, stride_wn, stride_sn, stride_ys, stride_ym,
                  BITS: tl.constexpr, GS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SWAP: tl.constexpr, DOT_FP32: tl.constexpr,
                  MAGIC: tl.constexpr, ASM: tl.constexpr):
    """y[pid_k] (+)= x[:, k-slice] @ W[:, k-slice]^T on tensor cores: per quantization group the weights are made
    in registers (`group_weights`) and the dot accumulates across groups; SWAP computes the transposed product
    W x^T, so that for few rows the wide W tile, made in registers, is the dot's first operand. Program order is
    grouped so that neighbouring programs share W tiles in L2."""
    EPW: tl.constexpr = 32 // BITS
    P: tl.constexpr = BLOCK_K if BLOCK_K < GS else GS  # columns of one group within a K step
    GPT: tl.constexpr = BLOCK_K // P  # groups per K step
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % size_m)
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    x_rows = x_ptr + tl.minimum(offs_m, M - 1).to(tl.int64) * stride_xm
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    # K and k_per_split are multiples of BLOCK_K: no masks. (The loop counts from 0: from k_start, Triton 3.6 does
    # not pipeline the x loads)
    for k0 in range(0, k_end - k_start, BLOCK_K):
        k0 = tl.multiple_of(k_start + k0, BLOCK_K)
        for g in tl.static_range(GPT):
            kg = k0 + g * P
            x = tl.load(x_rows[:, None] + (kg + tl.arange(0, P))[None, :])
            words = tl.load(w_ptr + rows_n[:, None] * stride_wn + (kg // EPW + tl.arange(0, P // EPW))[None, :])
            s = tl.load(s_ptr + rows_n * stride_sn + kg // GS)
            b = tl.load(b_ptr + rows_n * stride_sn + kg // GS)
            acc = accumulate(acc, x, group_weights(words, s, b, BITS, MAGIC, ASM), SWAP, DOT_FP32)
    if SWAP:
        tl.store(y_ptr + pid_k * stride_ys + offs_m[None, :] * stride_ym + offs_n[:, None],
                 acc.to(y_ptr.dtype.element_ty), mask=m_ok[None, :] & n_ok[:, None])
    else:
        tl.store(y_ptr + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def qgemm(x: torch.Tensor, qt, block_m: int = 128, block_n: int = 128, block_k: int = 64, num_warps: int = 8,
          num_stages: int = 3, swap: bool | None = None, split_k: int | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T on tensor cores, in x's dtype. Few rows: swapped operands and split-K."""
    check(x, qt)
    M, K = x.shape
    N = qt.weight.shape[0]
    if swap is None:
        swap = M <= 64
    x = x.contiguous()
    block_k = min(block_k, K & -K)  # the largest power of two dividing K (>= 32) caps the K step
    k_blocks = K // block_k
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    if split_k is None:
        split_k = max(1, min(k_blocks, (2 * num_sms(x.device)) // max(tiles, 1)))
    k_per_split = triton.cdiv(k_blocks, split_k) * block_k
    split_k = triton.cdiv(K, k_per_split)
    out = torch.empty((split_k, M, N), dtype=x.dtype if split_k == 1 else torch.float32, device=x.device)
    _qgemm_kernel[(tiles, split_k)](
        x, qt.weight.view(torch.int32), qt.scales, qt.biases, out, M, N, K, k_per_split, x.stride(0),
        qt.weight.stride(0), qt.scales.stride(0), out.stride(0), out.stride(1), BITS=qt.bits, GS=qt.group_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, SWAP=swap,
        DOT_FP32=INTERPRET or x.dtype == torch.float32, MAGIC=magic_dequant(qt.bits, x.dtype),
        ASM=asm_dequant(qt.bits, x.dtype, min(block_k, qt.group_size)), num_warps=num_warps, num_stages=num_stages)
    return out[0] if split_k == 1 else out.sum(0).to(x.dtype)


def magic_dequant(bits: int, dtype: torch.dtype) -> bool:
    """Whether `group_weights` makes bf16 weights from the codes' bits (`MAGIC`: bf16 activations, codes under 8
    bits, a GPU; the interpreter's bitcast to bf16 is wrong in Triton 3.9)."""
    return bits < 8 and dtype == torch.bfloat16 and not INTERPRET


def asm_dequant(bits: int, dtype: torch.dtype, group_columns: int) -> bool:
    """Whether `group_weights` makes the codes with `_MAGIC_BF16_ASM`: 4-bit codes, bf16 activations, a GPU, and
    at least 64 columns of a group at a time (with 32, an H100 gave wrong results; the cause is not found)."""
    return bits == 4 and group_columns >= 64 and magic_dequant(bits, dtype)


def qgemm_dequant(x: torch.Tensor, qt) -> torch.Tensor:
    """Prefill: dequantize W once into a temporary (bf16/fp16 as x) and hand the product to cuBLAS. At M in the
    thousands the extra pass (0.56 + 2 bytes per weight) is a few percent of the GEMM, and cuBLAS is the fastest
    tensor-core GEMM there is."""
    check(x, qt)
    # an output row of a whole number of 16 bytes: else cuBLAS runs an unaligned kernel, 10x slower on the MoE's
    # router and shared-expert gate (513 logits)
    w = dequantize(qt, x.dtype, row_multiple=8)
    return (x @ w.T)[:, :qt.weight.shape[0]]


DEQUANT_GEMM_ROWS = 256  # from here on, dequantize + cuBLAS (measured faster than our fused GEMM at M = 4096)
MMA_MAX_ROWS = 16  # up to this many rows (past the GEMV's) the CUDA tensor-core kernel where it applies
# (`kernels/moe/mma.py` `dense`: 4-bit groups of 32/64, bf16/fp16); from 32 rows it was slower than the Triton GEMM
# on Qwen3-Next's projections (docs/perf-log.md, session 10)


def qmatmul(x: torch.Tensor, qt) -> torch.Tensor:
    M = x.shape[0]
    if M <= GEMV_MAX_ROWS:
        return qgemv(x, qt)
    if M <= MMA_MAX_ROWS:
        from sluice.kernels.moe import mma

        if mma.dense_applies(x, qt):
            return mma.dense(x, qt)
    if M <= 64:  # swapped: W the wide side (docs/perf-log.md, 2026-11-25 "engine, second session")
        return qgemm(x, qt, block_m=max(16, triton.next_power_of_2(M)), block_n=64, block_k=128, num_warps=4,
                     num_stages=4)
    if M < DEQUANT_GEMM_ROWS or INTERPRET:
        return qgemm(x, qt, block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=4)
    return qgemm_dequant(x, qt)
