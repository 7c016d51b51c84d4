"""Triton kernels for y = x @ W^T with W an MLX-affine QuantizedTensor, dequantization fused in registers.

- `_gemv_kernel` (decode, one activation row per program): integer dot products on CUDA cores. W is streamed in
  its own K-contiguous order with 16-byte loads; x is prepared once by `_prep_x_kernel`. Also the MoE expert
  GEMV: with `INDEXED`, program (.., .., slot) reads the expert whose index sits in device memory.
- `_dequant_kernel`: W (or, with `GATHER`, some of its rows: the embedding lookup) dequantized in one pass.
The tensor-core GEMM and the dispatch by row count are in `qmatmul.gemm`.

Packed layout (MLX): element k of a row sits in word k // (32/BITS) at bit (k % (32/BITS)) * BITS; scale and bias
of group k // GS; value = scale * q + bias. Bits 2, 4, 8; group sizes 32, 64, 128.

Why integers: converting each code to a float costs an int->float conversion, a quarter-rate instruction on
NVIDIA GPUs, and with it the fp32 GEMV could not go past ~half the memory bandwidth. Instead x is rounded, per
group, to 16-bit integers (error <= 2^-16 of the group's largest |x|, far below bf16's own rounding of x) and
the GEMV multiplies codes by them with `dp2a` (two 16x8-bit products added to an int32 per instruction): a word
of 4-bit codes costs one shift, two masks and four dp2a, exact in int32. Per group:
y += scale * xscale * sum(q * xq) + bias * sum(x), with xscale and the exact fp32 group sums of x prepared once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels.conv1d.triton import conv_update_columns
from sluice.kernels.launch import INTERPRET, num_sms, pdl, pdl_start, prefetch_l2, round_to

SUPPORTED_BITS = (2, 4, 8)
SUPPORTED_GROUPS = (32, 64, 128)
X_INT_MAX = 32767  # x is rounded to int16 per group: x ~= xq * amax / X_INT_MAX
_X_INT_MAX = tl.constexpr(X_INT_MAX)
# `_gemv_kernel`'s PREFETCH where the weights may be read before the dependency wait (0 no, 1 into L2, 2 into
# registers), dense and MoE expert GEMVs: defaults from the H100 sweeps (docs/perf-log.md); `prefetch=` overrides.
GEMV_PREFETCH = 2
GEMV_PREFETCH_INDEXED = 2


@triton.jit
def _load_x(x_row, offs, mask, K, S, stride_xs, SWIGLU: tl.constexpr):
    """fp32 x at columns `offs`; with SWIGLU the row is [gate | up] (K columns each) as S split-K partials and
    x = silu(gate) * up."""
    if SWIGLU:
        g = tl.load(x_row + offs, mask=mask, other=0.0)
        u = tl.load(x_row + K + offs, mask=mask, other=0.0)
        for s in range(1, S):
            g += tl.load(x_row + s * stride_xs + offs, mask=mask, other=0.0)
            u += tl.load(x_row + s * stride_xs + K + offs, mask=mask, other=0.0)
        return g / (1.0 + tl.exp(-g)) * u
    else:
        return tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _prep_groups(x_row, p_row, offs_g, g_ok, K, S, stride_xs, BITS: tl.constexpr, GS: tl.constexpr,
                 SWIGLU: tl.constexpr):
    """Prepare the groups `offs_g` of one row x (K columns) into p_row (layout: `_prep_x_kernel`). x is loaded
    once, as [groups, GS]; the planes are picked out of it in registers (loading x again per plane would wait
    for the previous plane's stores: the compiler cannot know they do not alias x)."""
    EPW: tl.constexpr = 32 // BITS
    D: tl.constexpr = 8 // BITS
    WPG: tl.constexpr = GS // EPW
    GB: tl.constexpr = offs_g.shape[0]
    KW = K // EPW
    NG = K // GS
    f_row = p_row.to(tl.pointer_type(tl.float32))
    xg = _load_x(x_row, offs_g[:, None] * GS + tl.arange(0, GS)[None, :], g_ok[:, None], K, S, stride_xs, SWIGLU)
    amax = tl.max(tl.abs(xg), axis=1)
    inv = tl.where(amax > 0, _X_INT_MAX / tl.maximum(amax, 1e-30), 0.0)[:, None]
    tl.store(f_row + 2 * D * KW + offs_g, amax / _X_INT_MAX, mask=g_ok)
    tl.store(f_row + 2 * D * KW + NG + offs_g, tl.sum(xg, axis=1), mask=g_ok)
    q = tl.minimum(tl.maximum(tl.floor(xg * inv + 0.5), -_X_INT_MAX), _X_INT_MAX).to(tl.int32)
    q = tl.reshape(q, (GB, WPG, EPW))  # element w*EPW + e of each group
    offs_e = tl.arange(0, EPW)[None, None, :]
    offs_w = offs_g[:, None] * WPG + tl.arange(0, WPG)[None, :]
    for p in tl.static_range(2 * D):
        lo = tl.sum(tl.where(offs_e == p // 2 + 2 * (p % 2) * D, q, 0), axis=2)
        hi = tl.sum(tl.where(offs_e == p // 2 + (2 * (p % 2) + 1) * D, q, 0), axis=2)
        tl.store(p_row + p * KW + offs_w, (lo & 0xFFFF) | (hi << 16), mask=g_ok[:, None])


@triton.jit
def _prep_x_kernel(x_ptr, xp_ptr, K, S, stride_xs, stride_xm, stride_pm, BITS: tl.constexpr, GS: tl.constexpr,
                   GB: tl.constexpr, SWIGLU: tl.constexpr, PDL: tl.constexpr):
    """xp[m] (int32) = [EPW/2 planes of KW int16 pairs | K/GS x scales (fp32 bits) | K/GS group sums (fp32 bits)].
    Plane 2i+h pairs, for word w, the elements whose codes `dp2a` meets in the low (h=0) or high (h=1) bytes of
    (word >> i*BITS) & byte-mask: x[w*EPW + i + 2hD] (low half) and x[w*EPW + i + (2h+1)D] (high), D = 8/BITS."""
    pdl_start(PDL)
    m = tl.program_id(0)
    offs_g = tl.program_id(1) * GB + tl.arange(0, GB)
    _prep_groups(x_ptr + m.to(tl.int64) * stride_xm, xp_ptr + m.to(tl.int64) * stride_pm, offs_g, offs_g < K // GS,
                 K, S, stride_xs, BITS, GS, SWIGLU)


@triton.jit
def _dp2a(a, b, c, HI: tl.constexpr, ASM: tl.constexpr):
    """c + a.lo16 * b.byte(2HI) + a.hi16 * b.byte(2HI + 1): a two int16, b four uint8 (PTX `dp2a`). The
    interpreter, which cannot run PTX, gets the same arithmetic spelled out."""
    if ASM:
        if HI:
            return tl.inline_asm_elementwise("dp2a.hi.s32.u32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise("dp2a.lo.s32.u32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
    else:
        SH: tl.constexpr = 16 * HI
        return c + ((a << 16) >> 16) * ((b >> SH) & 0xFF) + (a >> 16) * ((b >> (SH + 8)) & 0xFF)


@triton.jit
def _code_bytes(words, i: tl.constexpr, BITS: tl.constexpr):
    """Codes i, i + D, i + 2D, i + 3D of each word (D = 8 / BITS), one per byte: what `_dp2a` multiplies."""
    if BITS == 8:
        a = words
    else:
        a = (words >> (i * BITS)) & (((1 << BITS) - 1) * 0x01010101)
    return a


def prep_len(K: int, group_size: int) -> int:
    """int32 words of one prepared row (`prep_x`), unpadded: K/2 of int16 pairs, then K/GS scales and sums."""
    return K // 2 + 2 * (K // group_size)


@triton.jit
def _gemv_tiles(w_rows, s_rows, b_rows, w0, w_end, offs_k, offs_g, WPG: tl.constexpr, EVEN_K: tl.constexpr):
    """One step's packed words [BLOCK_N, KB] and its scales and biases, fp32 [BLOCK_N, KB / WPG]."""
    kk = w0 + offs_k
    grp = w0 // WPG + offs_g
    if EVEN_K:
        words = tl.load(w_rows + kk[None, :])
        s = tl.load(s_rows + grp[None, :]).to(tl.float32)
        b = tl.load(b_rows + grp[None, :]).to(tl.float32)
    else:
        words = tl.load(w_rows + kk[None, :], mask=(kk < w_end)[None, :], other=0)
        g_ok = (grp < w_end // WPG)[None, :]
        s = tl.load(s_rows + grp[None, :], mask=g_ok, other=0.0).to(tl.float32)
        b = tl.load(b_rows + grp[None, :], mask=g_ok, other=0.0).to(tl.float32)
    return words, s, b


@triton.jit
def _raw_x_step(x_row, w0, w_end, KW, S, stride_xs, KB: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr,
                EVEN_K: tl.constexpr, SWIGLU: tl.constexpr):
    """One GEMV step's x prepared from x itself, in registers: (x rounded as int16 per group, [4, KB/4, 4, 8/BITS]
    int32 whose low 16 bits hold it; the group's x scales and sums [KB/WPG]). What `prep_x` would write, but ties
    round to even. Each program prepares the x of its own steps (from L2, as it would read the prepared x): no
    launch of its own, no round trip through memory.
    Layout: word 4t + r of the step sits at [r, t], so each thread holds its 4 words' elements as it holds their
    codes (`_gemv_kernel`); groups of WPG >= 4 words (`raw_x_supported`) are whole threads. SWIGLU: the row is a
    gate_up projection's S split-K partials [gate | up] and x = silu(gate) * up (`_load_x`)."""
    EPW: tl.constexpr = 32 // BITS
    D: tl.constexpr = 8 // BITS
    T: tl.constexpr = KB // 4
    TPG: tl.constexpr = GS // EPW // 4  # threads per group
    G: tl.constexpr = T // TPG
    word = w0 + 4 * tl.arange(0, T)[None, :, None] + tl.arange(0, 4)[:, None, None]
    offs = word * EPW + tl.arange(0, EPW)[None, None, :]
    if SWIGLU:
        xv = _load_x(x_row, offs, word < w_end, KW * EPW, S, stride_xs, True)
    elif EVEN_K:
        xv = tl.load(x_row + offs).to(tl.float32)
    else:
        xv = tl.load(x_row + offs, mask=word < w_end, other=0.0).to(tl.float32)
    amax = tl.max(tl.reshape(tl.max(tl.max(tl.abs(xv), axis=2), axis=0), (G, TPG)), axis=1)
    xg = tl.sum(tl.reshape(tl.sum(tl.sum(xv, axis=2), axis=0), (G, TPG)), axis=1)
    inv = tl.where(amax > 0, _X_INT_MAX / tl.maximum(amax, 1e-30), 0.0)
    inv_t = tl.reshape(tl.broadcast_to(inv[:, None], (G, TPG)), (T,))
    # + 1.5 * 2^23: the float's low mantissa bits are the nearest integer (|x * inv| <= 32767), no conversion
    q = (xv * inv_t[None, :, None] + 12582912.0).to(tl.int32, bitcast=True)
    return tl.reshape(q, (4, T, 4, D)), amax / _X_INT_MAX, xg


@triton.jit
def _plane(q4, i: tl.constexpr, h: tl.constexpr):
    """Plane 2i+h of `_raw_x_step`'s x (elements j*D + i of each word, D = 8/BITS): int16 pairs (j = 2h, 2h+1)
    as int32, [KB] in word order."""
    offs_j = tl.arange(0, 4)[None, None, :, None]
    offs_i = tl.arange(0, q4.shape[3])[None, None, None, :]
    lo = tl.sum(tl.sum(tl.where((offs_j == 2 * h) & (offs_i == i), q4, 0), axis=3), axis=2)
    hi = tl.sum(tl.sum(tl.where((offs_j == 2 * h + 1) & (offs_i == i), q4, 0), axis=3), axis=2)
    return tl.reshape(tl.trans((lo & 0xFFFF) | (hi << 16)), (q4.shape[0] * q4.shape[1],))


@triton.jit
def _gemv_step(xp_ptr, xf_ptr, KW, NG, S, stride_xs, words, s, b, w0, w_end, offs_k, offs_g, acc, accb,
               BITS: tl.constexpr, GS: tl.constexpr, EVEN_K: tl.constexpr, RAW_X: tl.constexpr, SWIGLU: tl.constexpr,
               ASM: tl.constexpr):
    """acc, accb after one step (the words, scales and biases of `_gemv_tiles` at word w0) of `_gemv_kernel`."""
    EPW: tl.constexpr = 32 // BITS
    D: tl.constexpr = 8 // BITS
    WPG: tl.constexpr = GS // EPW
    V: tl.constexpr = 4 if WPG >= 4 else WPG  # words of one group held by one thread
    BLOCK_N: tl.constexpr = words.shape[0]
    KB: tl.constexpr = words.shape[1]
    G: tl.constexpr = KB // WPG
    kk = w0 + offs_k
    grp = w0 // WPG + offs_g
    k_ok = kk < w_end
    if RAW_X:
        q4, xs, xg = _raw_x_step(xp_ptr, w0, w_end, KW, S, stride_xs, KB, BITS, GS, EVEN_K, SWIGLU)
    elif EVEN_K:
        xs = tl.load(xf_ptr + grp)
        xg = tl.load(xf_ptr + NG + grp)
    else:
        g_ok = grp < w_end // WPG
        xs = tl.load(xf_ptr + grp, mask=g_ok, other=0.0)
        xg = tl.load(xf_ptr + NG + grp, mask=g_ok, other=0.0)
    dot = tl.zeros((BLOCK_N, KB), dtype=tl.int32)
    for i in tl.static_range(D):
        a = _code_bytes(words, i, BITS)
        if RAW_X:
            x_lo = _plane(q4, i, 0)
            x_hi = _plane(q4, i, 1)
        elif EVEN_K:
            x_lo = tl.load(xp_ptr + (2 * i) * KW + kk)
            x_hi = tl.load(xp_ptr + (2 * i + 1) * KW + kk)
        else:
            x_lo = tl.load(xp_ptr + (2 * i) * KW + kk, mask=k_ok, other=0)
            x_hi = tl.load(xp_ptr + (2 * i + 1) * KW + kk, mask=k_ok, other=0)
        dot = _dp2a(x_lo[None, :], a, dot, False, ASM)
        dot = _dp2a(x_hi[None, :], a, dot, True, ASM)
    part = tl.sum(tl.reshape(dot, (BLOCK_N, G, WPG // V, V)), axis=3)  # within each thread's 16 bytes
    acc += part.to(tl.float32) * (s * xs[None, :])[:, :, None]
    accb += b * xg[None, :]
    return acc, accb


@triton.jit
def _gemv_kernel(xp_ptr, w_ptr, s_ptr, b_ptr, y_ptr, ids_ptr, order_ptr, wx_ptr, sx_ptr, bx_ptr, N, KW, w_per_split,
                 x_div, n_experts, stride_pm, stride_we, stride_wn, stride_se, stride_sn, stride_wxe, stride_sxe,
                 stride_wxn, stride_sxn, stride_ys, stride_ym, S, stride_xs,
                 cw_ptr, cs_ptr, crows_ptr, C_CONV, stride_cwc, stride_cwk, stride_css, stride_csc, stride_csk,
                 BITS: tl.constexpr, GS: tl.constexpr, BLOCK_N: tl.constexpr, KB: tl.constexpr,
                 EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, INDEXED: tl.constexpr, EXTRA: tl.constexpr,
                 ORDERED: tl.constexpr, RAW_X: tl.constexpr, SWIGLU: tl.constexpr, ASM: tl.constexpr,
                 PDL: tl.constexpr, PREFETCH: tl.constexpr, CONV_W: tl.constexpr):
    """y[split, row, n] = sum over this split's words of x[row] . W[n]. Program (n-block, split, row); each step
    reads a [BLOCK_N, KB words] tile of W.
    Layout: KB = 128 words per warp, so the threads lie along K (4 words, one 16-byte load, each) and every
    thread holds all BLOCK_N rows of its columns: x is loaded once per step and reused BLOCK_N times from
    registers. (x traffic through L1 is what capped earlier layouts at ~55% of the memory bandwidth.)
    x: prepared by `_prep_x_kernel` (xp), or with RAW_X the activations themselves, prepared step by step in
    registers (`_raw_x_step`): one launch instead of two. RAW_X with SWIGLU: the S split-K partials [S, rows,
    2K] of a gate_up projection (stride_xs apart), x = silu(gate) * up (an MoE's down projection).
    CONV_W (a decode step's in-projection, K not split): output channels below C_CONV are replaced by the causal
    conv of width CONV_W, silu'd, of the sequence in conv state slot crows[row] (`conv1d.triton.conv_update_columns`:
    `causal_conv1d_update`'s bits), that state shifted in place.
    INDEXED: W, scales and biases are stacked over experts and row r uses expert ids[r] and x row r // x_div;
    with EXTRA, id n_experts + i (i >= 0) means extra expert i, stored apart (a shared expert, or slot i of a shared
    MLP n times as wide: the same [N, K] shape): wx, sx, bx advanced by i times stride_wxe (words) / stride_sxe
    (groups), rows stride_wxn / stride_sxn apart.
    ORDERED: program (.., .., p) computes row order[p] (rows sorted by expert: the programs reading one expert
    run together, and all but the first find its weights in L2).
    PREFETCH (with PDL): the weights (and ids) were written long before, so they are read before the wait for
    the previous kernel. 1: the first step's tiles are asked of L2 (ids and weights two launches back or
    earlier: x was prepared by the launch just before). 2: the first step's tiles are loaded into registers:
    the previous kernel's last programs and this one's first loads overlap, no memory round trip after the
    wait but x's."""
    WPG: tl.constexpr = GS // (32 // BITS)
    V: tl.constexpr = 4 if WPG >= 4 else WPG
    G: tl.constexpr = KB // WPG
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if ORDERED:
        row = tl.load(order_ptr + tl.program_id(2)).to(tl.int32)
    else:
        row = tl.program_id(2)
    if not PREFETCH:
        pdl_start(PDL)
    if INDEXED:
        e = tl.load(ids_ptr + row).to(tl.int64)
        w_ptr += e * stride_we
        s_ptr += e * stride_se
        b_ptr += e * stride_se
        if EXTRA:  # (before the prefetch reads: the pointers and row strides of the expert this row reads)
            xe = e - n_experts
            if xe >= 0:
                w_ptr = wx_ptr + xe * stride_wxe
                s_ptr = sx_ptr + xe * stride_sxe
                b_ptr = bx_ptr + xe * stride_sxe
            stride_wn = tl.where(xe >= 0, stride_wxn, stride_wn)
            stride_sn = tl.where(xe >= 0, stride_sxn, stride_sn)
        xp_ptr += (row // x_div).to(tl.int64) * stride_pm
    else:
        xp_ptr += row.to(tl.int64) * stride_pm
    xf_ptr = xp_ptr.to(tl.pointer_type(tl.float32)) + 2 * (8 // BITS) * KW  # x scales, then group sums (xp)
    NG = KW // WPG
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = offs_n if EVEN_N else tl.minimum(offs_n, N - 1)  # clamped rows load real data; never stored
    rows = rows.to(tl.int64)
    offs_k = tl.arange(0, KB)
    offs_g = tl.arange(0, G)
    w_rows = w_ptr + rows[:, None] * stride_wn
    s_rows = s_ptr + rows[:, None] * stride_sn
    b_rows = b_ptr + rows[:, None] * stride_sn
    w_start = pid_k * w_per_split
    w_end = tl.minimum(w_start + w_per_split, KW)
    acc = tl.zeros((BLOCK_N, G, WPG // V), dtype=tl.float32)
    accb = tl.zeros((BLOCK_N, G), dtype=tl.float32)
    first = w_start
    if PREFETCH == 1:
        kk = tl.minimum(w_start + offs_k, w_end - 1)
        grp = tl.minimum(w_start // WPG + offs_g, w_end // WPG - 1)
        prefetch_l2(w_rows + kk[None, :], PDL)
        prefetch_l2(s_rows + grp[None, :], PDL)
        prefetch_l2(b_rows + grp[None, :], PDL)
        pdl_start(PDL)
    elif PREFETCH == 2:
        words, s, b = _gemv_tiles(w_rows, s_rows, b_rows, w_start, w_end, offs_k, offs_g, WPG, EVEN_K)
        pdl_start(PDL)
        acc, accb = _gemv_step(xp_ptr, xf_ptr, KW, NG, S, stride_xs, words, s, b, w_start, w_end, offs_k, offs_g,
                               acc, accb, BITS, GS, EVEN_K, RAW_X, SWIGLU, ASM)
        first = w_start + KB
    for w0 in range(first, w_end, KB):
        w0 = tl.multiple_of(w0, KB)
        words, s, b = _gemv_tiles(w_rows, s_rows, b_rows, w0, w_end, offs_k, offs_g, WPG, EVEN_K)
        acc, accb = _gemv_step(xp_ptr, xf_ptr, KW, NG, S, stride_xs, words, s, b, w0, w_end, offs_k, offs_g, acc,
                               accb, BITS, GS, EVEN_K, RAW_X, SWIGLU, ASM)
    y = tl.sum(tl.sum(acc, axis=2), axis=1) + tl.sum(accb, axis=1)
    if CONV_W:  # K not split: y is the projection; channels below C_CONV go through the decode conv
        conv = offs_n < C_CONV
        slot = tl.load(crows_ptr + row).to(tl.int32)
        y_conv = conv_update_columns(y.to(y_ptr.dtype.element_ty), offs_n, n_ok & conv, slot, cw_ptr, cs_ptr,
                                     stride_cwc, stride_cwk, stride_css, stride_csc, stride_csk, CONV_W, True)
        y = tl.where(conv, y_conv, y)
    tl.store(y_ptr + pid_k * stride_ys + row * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, b_ptr, out_ptr, rows_ptr, N, K, stride_wn, stride_sn, stride_on,
                    BITS: tl.constexpr, GS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GATHER: tl.constexpr, RNE_BF16: tl.constexpr):
    """out [N, K] = s * q + b (fp32 math, rounded once to out's dtype), one [BLOCK_N, BLOCK_K] tile per program.
    GATHER: out row n is W's row rows[n] (an embedding lookup). RNE_BF16: `round_to`'s."""
    EPW: tl.constexpr = 32 // BITS
    WB: tl.constexpr = BLOCK_K // EPW
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    if GATHER:
        rows = tl.load(rows_ptr + rows).to(tl.int64)
    offs_w = k0 // EPW + tl.arange(0, WB)
    words = tl.load(w_ptr + rows[:, None] * stride_wn + offs_w[None, :]).to(tl.uint32, bitcast=True)
    q = tl.reshape((words[:, :, None] >> (tl.arange(0, EPW) * BITS)[None, None, :]) & ((1 << BITS) - 1),
                   (BLOCK_N, BLOCK_K))
    grp = (k0 + tl.arange(0, BLOCK_K)) // GS
    s = tl.load(s_ptr + rows[:, None] * stride_sn + grp[None, :]).to(tl.float32)
    b = tl.load(b_ptr + rows[:, None] * stride_sn + grp[None, :]).to(tl.float32)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    w = round_to(q.to(tl.float32) * s + b, out_ptr.dtype.element_ty, RNE_BF16)
    tl.store(out_ptr + offs_n[:, None].to(tl.int64) * stride_on + offs_k[None, :], w.to(out_ptr.dtype.element_ty),
             mask=(offs_n < N)[:, None])


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
    check_activations(x, qt)


def check_activations(x: torch.Tensor, qt) -> None:
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"triton qmatmul: activations must be bf16, fp16 or fp32, got {x.dtype}")
    if x.device != qt.weight.device or qt.scales.device != qt.weight.device:
        raise ValueError("triton qmatmul: x and the weight must be on the same device")
    if not (x.is_cuda or INTERPRET):
        raise ValueError("triton qmatmul: tensors must be on a CUDA device (or set TRITON_INTERPRET=1)")
    if qt.in_features % qt.group_size:
        raise ValueError(f"triton qmatmul: in_features {qt.in_features} is not a multiple of the group size")


def prep_x(x: torch.Tensor, bits: int, group_size: int, swiglu: bool = False) -> torch.Tensor:
    """x [M, K] -> the GEMV's prepared activations, int32 [M, K/2 + 2K/GS] (row stride padded to 16): x rounded
    per group to int16 pairs, then the per-group x scales and the exact group sums (fp32 bits). With `swiglu`,
    x is fp32 split-K partials [S, M, 2K] of a gate_up projection and the result is that of silu(gate) * up."""
    S, M, K = (x.shape[0], x.shape[1], x.shape[2] // 2) if swiglu else (1, *x.shape)
    stride = -(-prep_len(K, group_size) // 16) * 16
    xp = torch.empty((M, stride), dtype=torch.int32, device=x.device)
    gb = max(1, 2048 // group_size)  # groups per program
    _prep_x_kernel[(M, triton.cdiv(K // group_size, gb))](
        x, xp, K, S, x.stride(0) if swiglu else 0, x.stride(-2), stride, BITS=bits, GS=group_size, GB=gb,
        SWIGLU=swiglu, PDL=pdl(x.device), launch_pdl=pdl(x.device), num_warps=4)
    return xp


def raw_x_supported(bits: int, group_size: int) -> bool:
    """Whether `_gemv_kernel` can prepare x itself (RAW_X): a group spans whole threads (4 words each)."""
    return group_size // (32 // bits) >= 4


def gemv_step_words(K: int, bits: int, num_warps: int) -> int:
    """Packed words per GEMV step: 128 per warp (4 per thread), fewer for short rows (a power of two >= 4)."""
    return max(4, min(128 * num_warps, triton.next_power_of_2(K // (32 // bits))))


def gemv_split_k(N, K, bits, rows, block_n=4, num_warps=1, device=None) -> int:
    """Enough K splits for about eight warps per multiprocessor (1-warp programs, each waiting on its loads)."""
    steps = triton.cdiv(K // (32 // bits), gemv_step_words(K, bits, num_warps))
    programs = triton.cdiv(N, block_n) * rows * num_warps
    return max(1, min(steps, (8 * num_sms(device)) // max(programs, 1)))


def gemv_used_splits(K, bits, split_k, num_warps=1) -> tuple[int, int]:
    """(splits actually used, packed words per split): each split covers whole GEMV steps, so asking for
    `split_k` may give fewer. Size `gemv_launch`'s output with the first."""
    kw, kb = K // (32 // bits), gemv_step_words(K, bits, num_warps)
    w_per_split = triton.cdiv(triton.cdiv(kw, kb), split_k) * kb
    return triton.cdiv(kw, w_per_split), w_per_split


def gemv_launch(xp, w, s, b, out, ids, rows, N, K, bits, gs, split_k, x_div=1, block_n=4, num_warps=1, extra=None,
                ids_ready=False, raw_x=False, prefetch=None, swiglu=False, order=None, conv=None):
    """Launch `_gemv_kernel` for `rows` output rows: xp from `prep_x`, launched just before (or, raw_x, the
    activations [rows / x_div, K] themselves, unit column stride); W [E?, N, KW] int32, scales/biases
    [E?, N, K/GS]; ids [rows] expert indices (INDEXED) or None; out [split_k', rows, N] (fp32 when split); extra:
    (W, scales, biases, W expert stride, scales expert stride, W row stride, scales row stride) of the experts
    stored apart that ids E + i stand for (extra expert i: W + i * W expert stride, etc.; scales and biases alike
    strided), each [N, K] with its own row strides; ids_ready:
    the ids were written before the launch of xp (so may be read before the dependency wait); prefetch: the
    kernel's PREFETCH where the weights may be read early (default GEMV_PREFETCH, GEMV_PREFETCH_INDEXED); swiglu
    (with raw_x): xp is a gate_up projection's fp32 partials [S, rows / x_div, 2K], x = silu(gate) * up;
    order (with ids): the rows in the order their programs are launched (a permutation of [0, rows), written with
    the ids); conv (split_k 1): (weight [C, W], state [slots, C, W-1], rows [rows]) of `_gemv_kernel`'s CONV_W.
    Returns the split count actually used (<= split_k: every split covers whole steps)."""
    kw = K // (32 // bits)
    kb = gemv_step_words(K, bits, num_warps)
    used, w_per_split = gemv_used_splits(K, bits, split_k, num_warps)
    indexed = ids is not None
    wx, sx, bx, *x_strides = extra if extra is not None else (w, s, b, 0, 0, 0, 0)
    use_pdl = pdl(xp.device)
    early = not indexed or ids_ready  # (without PDL the kernel just reads them first)
    if prefetch is None:
        prefetch = GEMV_PREFETCH_INDEXED if indexed else GEMV_PREFETCH
    _gemv_kernel[(triton.cdiv(N, block_n), used, rows)](
        xp, w, s, b, out, ids if indexed else xp, order if order is not None else xp, wx, sx, bx, N, kw,
        w_per_split, x_div,
        w.shape[0] if indexed else 0, xp.stride(-2), w.stride(0) if indexed else 0, w.stride(-2),
        s.stride(0) if indexed else 0, s.stride(-2), *x_strides, out.stride(0), out.stride(1),
        xp.shape[0] if swiglu else 1, xp.stride(0) if swiglu else 0, *_conv_args(conv, out), BITS=bits, GS=gs,
        BLOCK_N=block_n, KB=kb, EVEN_N=N % block_n == 0, EVEN_K=kw % kb == 0 and w_per_split % kb == 0,
        INDEXED=indexed, EXTRA=extra is not None, ORDERED=order is not None, RAW_X=raw_x, SWIGLU=swiglu,
        ASM=not INTERPRET, PDL=use_pdl,
        PREFETCH=prefetch if early else 0, CONV_W=0 if conv is None else conv[0].shape[1], launch_pdl=use_pdl,
        num_warps=num_warps, num_stages=1)
    return used


def _conv_args(conv, placeholder) -> tuple:
    """`_gemv_kernel`'s conv pointers, channel count and strides (placeholders without a conv)."""
    if conv is None:
        return (placeholder,) * 3 + (0,) * 6
    weight, state, rows = conv
    return (weight, state, rows, weight.shape[0], weight.stride(0), weight.stride(1), *state.stride())


def qgemv_conv(x: torch.Tensor, qt, conv_weight: torch.Tensor, conv_state: torch.Tensor,
               rows: torch.Tensor) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T in x's dtype for a decode step of M <= GEMV_MAX_ROWS sequences, with its first C
    channels replaced by the causal conv + silu of sequence m in conv state slot rows[m] (conv_weight [C, W],
    conv_state [slots, C, W-1], shifted in place; `conv1d.triton.causal_conv1d_update`'s bits): a Gated DeltaNet's
    in-projection and conv in one launch."""
    M, K = x.shape
    N = qt.weight.shape[0]
    C, W = conv_weight.shape
    if not (1 <= M <= GEMV_MAX_ROWS and C <= N and W >= 2 and conv_state.shape[1:] == (C, W - 1)
            and rows.shape == (M,) and conv_state.dtype in (torch.bfloat16, torch.float16, torch.float32)):
        raise ValueError(f"qgemv_conv: unsupported shapes x {tuple(x.shape)}, W {N}x{K}, conv weight "
                         f"{tuple(conv_weight.shape)}, state {conv_state.dtype} {tuple(conv_state.shape)}, rows "
                         f"{tuple(rows.shape)}")
    return qgemv_partials(x, qt, split_k=1, dtype=x.dtype, conv=(conv_weight, conv_state, rows))[0]


def gemv_block_n(N: int, rows: int, device=None) -> int:
    """Rows per GEMV program: 4, or 8 / 16 when that puts a grid of a few waves into one (one-warp programs, 32
    per multiprocessor), so that no mostly empty last wave leaves the memory system idle."""
    wave = 32 * num_sms(device)
    if triton.cdiv(N, 4) * rows > 3 * wave:
        return 4
    return next((bn for bn in (4, 8, 16) if triton.cdiv(N, bn) * rows <= wave), 16)


def gemv_plan(N: int, K: int, bits: int, group_size: int, rows: int, device=None) -> tuple[int, int, bool]:
    """(block_n, num_warps, raw_x) of a dense GEMV, from H100 sweeps (docs/perf-log.md, 2026-11-25, "GEMV and
    MoE decode"):
    - long (more than ~3 waves of 4-row programs: the lm_heads): x prepared by its own launch, which is then
      nothing beside the GEMV, while preparing it in every program costs instructions at full bandwidth;
    - short rows of many words (an expert-sized gate_up): one step covers the row, the warps split it, 16 rows
      a program between them (faster than two rows a warp at both expert shapes of the sweep);
    - else one warp per program and the fewest rows per program (8 or 16) that keep the grid to one wave
      (~12 programs per multiprocessor at the registers the in-kernel x prep takes)."""
    sms = num_sms(device)
    fours = triton.cdiv(N, 4) * rows
    if not raw_x_supported(bits, group_size) or fours > 3 * 32 * sms:
        return gemv_block_n(N, rows, device), 1, False
    kw = K // (32 // bits)
    if kw >= 256 and fours <= 4 * sms:
        warps = min(4, kw // 128)
        return 16 // warps, warps, True
    return next((bn for bn in (8, 16) if triton.cdiv(N, bn) * rows <= 12 * sms), 16), 1, True


def qgemv_partials(x: torch.Tensor, qt, block_n: int | None = None, split_k: int | None = None,
                   num_warps: int | None = None, dtype: torch.dtype = torch.float32,
                   raw_x: bool | None = None, prefetch: int | None = None, conv=None) -> torch.Tensor:
    """[S, M, N]: the S split-K partial sums (fp32) of x [M, K] @ W^T, for a consumer that adds them itself
    instead of paying a launch for it; when K is not split (S = 1) the result itself, in `dtype`. raw_x: the
    GEMV prepares x itself, one launch, or `prep_x` runs first. prefetch, conv (with split_k 1): `gemv_launch`'s.
    What is not given comes from `gemv_plan`."""
    check(x, qt)
    M, K = x.shape
    N = qt.weight.shape[0]
    plan = gemv_plan(N, K, qt.bits, qt.group_size, M, x.device)
    block_n = block_n or plan[0]
    num_warps = num_warps or plan[1]
    if raw_x is None:
        raw_x = plan[2]
    elif raw_x and not raw_x_supported(qt.bits, qt.group_size):
        raise ValueError(f"triton qgemv: x cannot be prepared in the GEMV for {qt.bits}-bit group {qt.group_size}")
    xp = x.contiguous() if raw_x else prep_x(x, qt.bits, qt.group_size)
    if split_k is None:
        split_k = gemv_split_k(N, K, qt.bits, M, block_n, num_warps, x.device)
    split, _ = gemv_used_splits(K, qt.bits, split_k, num_warps)
    out = torch.empty((split, M, N), dtype=dtype if split == 1 else torch.float32, device=x.device)
    gemv_launch(xp, qt.weight.view(torch.int32), qt.scales, qt.biases, out, None, M, N, K, qt.bits, qt.group_size,
                split_k, block_n=block_n, num_warps=num_warps, raw_x=raw_x, prefetch=prefetch, conv=conv)
    return out


def qgemv(x: torch.Tensor, qt, block_n: int | None = None, split_k: int | None = None,
          num_warps: int | None = None, raw_x: bool | None = None, prefetch: int | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T for a few rows on CUDA cores (each row its own programs; W is re-read per row,
    mostly from L2)."""
    out = qgemv_partials(x, qt, block_n, split_k, num_warps, dtype=x.dtype, raw_x=raw_x, prefetch=prefetch)
    return out[0] if out.shape[0] == 1 else out.sum(0).to(x.dtype)


def _dequant_block_k(qt) -> int:
    """`_dequant_kernel`'s columns per program: 128, or one group (at least a word) where 128 does not divide K."""
    epw = 32 // qt.bits
    block_k = max(128, epw)
    if qt.in_features % block_k:
        block_k = qt.group_size if qt.group_size >= epw else epw
    return block_k


def dequantize(qt, dtype: torch.dtype = torch.bfloat16, row_multiple: int = 1) -> torch.Tensor:
    """The dense [N, K] weight in `dtype`, one pass over the packed bytes; with row_multiple, N rounded up to it (the
    rows past N left unset)."""
    N, K = qt.weight.shape[0], qt.in_features
    block_k = _dequant_block_k(qt)
    out = torch.empty((-(-N // row_multiple) * row_multiple, K), dtype=dtype, device=qt.weight.device)
    _dequant_kernel[(triton.cdiv(N, 32), K // block_k)](
        qt.weight.view(torch.int32), qt.scales, qt.biases, out, out, N, K, qt.weight.stride(0), qt.scales.stride(0),
        out.stride(0), BITS=qt.bits, GS=qt.group_size, BLOCK_N=32, BLOCK_K=block_k, GATHER=False,
        RNE_BF16=INTERPRET, num_warps=4)
    return out


def dequantize_rows(qt, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W's rows `rows` (int, any shape) as [*rows.shape, K] in `dtype`, in one launch: the bits of
    `QuantizedTensor.dequantize` (s * q and + b each rounded: no fused multiply-add), rounded once to dtype."""
    K = qt.in_features
    flat = rows.reshape(-1)
    flat = flat if flat.is_contiguous() else flat.contiguous()
    n = flat.numel()
    out = torch.empty((n, K), dtype=dtype, device=qt.weight.device)
    block_k = _dequant_block_k(qt)
    if n:
        _dequant_kernel[(triton.cdiv(n, 4), K // block_k)](
            qt.weight.view(torch.int32), qt.scales, qt.biases, out, flat, n, K, qt.weight.stride(0),
            qt.scales.stride(0), out.stride(0), BITS=qt.bits, GS=qt.group_size, BLOCK_N=4, BLOCK_K=block_k,
            GATHER=True, RNE_BF16=INTERPRET, num_warps=4, enable_fp_fusion=False)
    return out.view(*rows.shape, K)


GEMV_MAX_ROWS = 4  # CUDA cores, one GEMV per row, up to 4 rows (measured faster than the tensor-core path there)
