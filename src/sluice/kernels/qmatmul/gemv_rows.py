"""The GEMV for a small batch of rows (a decode batch of 5-64 tokens): each program reads a block of W once and
multiplies it with R rows of x, so a batch costs about one pass over the weights instead of one per row.

- Dense: rows 0..M-1 in blocks of R.
- Grouped by expert (the MoE decode of a batch): the (token, expert) slots sorted by expert on the device, in tiles of
  up to R slots of one expert (`moe.triton._tile_table`); a tile's program reads its expert's W block once. Each
  hit expert is read once per step, not once per slot.

The arithmetic is `_gemv_kernel`'s (qmatmul.triton): x prepared by `prep_x` (int16 per group, scales, group sums),
codes multiplied with `dp2a` in int32, per group y += scale * xscale * sum(q * xq) + bias * sum(x); so a row's
result does not depend on which other rows share its program. The rows of a program are a third tensor dimension:
the W block [BLOCK_N, KB] is broadcast over R rows of x in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels.launch import INTERPRET, pdl, pdl_start
from sluice.kernels.qmatmul.triton import _code_bytes, _dp2a, _gemv_tiles, gemv_step_words, num_sms, prep_x


@triton.jit
def _gemv_rows_kernel(xp_ptr, w_ptr, s_ptr, b_ptr, y_ptr, order_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
                      wx_ptr, sx_ptr, bx_ptr, M, N, KW, w_per_split, x_div, n_experts, stride_pm, stride_we,
                      stride_wn, stride_se, stride_sn, stride_ys, stride_ym,
                      BITS: tl.constexpr, GS: tl.constexpr, BLOCK_N: tl.constexpr, KB: tl.constexpr,
                      R: tl.constexpr, GROUPED: tl.constexpr, EXTRA: tl.constexpr, EVEN_N: tl.constexpr,
                      EVEN_K: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr):
    """y[split, row, n] = sum over this split's words of x[row // x_div] . W[n] for the R rows of program
    (n-block, split, tile). GROUPED: the tile's rows are the sorted slots tile_row[tile].. of expert
    tile_expert[tile] (ids E and past: the table's unused tail, which exits), row = order[sorted slot]; with
    EXTRA, expert n_experts - 1 is the one stored apart (wx, sx, bx: the shared expert)."""
    EPW: tl.constexpr = 32 // BITS
    D: tl.constexpr = 8 // BITS
    WPG: tl.constexpr = GS // EPW
    G: tl.constexpr = KB // WPG
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    tile = tl.program_id(2)
    pdl_start(PDL)
    offs_r = tl.arange(0, R)
    if GROUPED:
        e = tl.load(tile_expert_ptr + tile)
        if e >= n_experts:
            return
        first = tl.load(tile_row_ptr + tile)
        end = tl.load(offsets_ptr + e + 1)
        r_ok = first + offs_r < end
        row = tl.load(order_ptr + tl.minimum(first + offs_r, end - 1)).to(tl.int64)  # clamped: real data
        x_row = row // x_div
        e = e.to(tl.int64)
        if EXTRA and e == n_experts - 1:
            w_ptr, s_ptr, b_ptr = wx_ptr, sx_ptr, bx_ptr
        else:
            w_ptr += e * stride_we
            s_ptr += e * stride_se
            b_ptr += e * stride_se
    else:
        row = tile * R + offs_r
        r_ok = row < M
        row = tl.minimum(row, M - 1).to(tl.int64)
        x_row = row
    x_rows = xp_ptr + x_row * stride_pm  # [R]
    xf_rows = x_rows.to(tl.pointer_type(tl.float32)) + 2 * D * KW  # x scales, then group sums
    NG = KW // WPG
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows_n = (offs_n if EVEN_N else tl.minimum(offs_n, N - 1)).to(tl.int64)  # clamped rows: never stored
    offs_k = tl.arange(0, KB)
    offs_g = tl.arange(0, G)
    w_rows = w_ptr + rows_n[:, None] * stride_wn
    s_rows = s_ptr + rows_n[:, None] * stride_sn
    b_rows = b_ptr + rows_n[:, None] * stride_sn
    w_start = pid_k * w_per_split
    w_end = tl.minimum(w_start + w_per_split, KW)
    acc = tl.zeros((R, BLOCK_N, G), dtype=tl.float32)
    for w0 in range(w_start, w_end, KB):
        w0 = tl.multiple_of(w0, KB)
        words, s, b = _gemv_tiles(w_rows, s_rows, b_rows, w0, w_end, offs_k, offs_g, WPG, EVEN_K)
        kk = w0 + offs_k
        grp = w0 // WPG + offs_g
        if EVEN_K:
            xs = tl.load(xf_rows[:, None] + grp[None, :])
            xg = tl.load(xf_rows[:, None] + NG + grp[None, :])
        else:
            g_ok = (grp < w_end // WPG)[None, :]
            xs = tl.load(xf_rows[:, None] + grp[None, :], mask=g_ok, other=0.0)
            xg = tl.load(xf_rows[:, None] + NG + grp[None, :], mask=g_ok, other=0.0)
        dot = tl.zeros((R, BLOCK_N, KB), dtype=tl.int32)
        for i in tl.static_range(D):
            a = tl.broadcast_to(_code_bytes(words, i, BITS)[None, :, :], (R, BLOCK_N, KB))
            if EVEN_K:
                x_lo = tl.load(x_rows[:, None] + (2 * i) * KW + kk[None, :])
                x_hi = tl.load(x_rows[:, None] + (2 * i + 1) * KW + kk[None, :])
            else:
                k_ok = (kk < w_end)[None, :]
                x_lo = tl.load(x_rows[:, None] + (2 * i) * KW + kk[None, :], mask=k_ok, other=0)
                x_hi = tl.load(x_rows[:, None] + (2 * i + 1) * KW + kk[None, :], mask=k_ok, other=0)
            dot = _dp2a(tl.broadcast_to(x_lo[:, None, :], (R, BLOCK_N, KB)), a, dot, False, ASM)
            dot = _dp2a(tl.broadcast_to(x_hi[:, None, :], (R, BLOCK_N, KB)), a, dot, True, ASM)
        part = tl.sum(tl.reshape(dot, (R, BLOCK_N, G, WPG)), axis=3)
        acc += part.to(tl.float32) * s[None, :, :] * xs[:, None, :] + b[None, :, :] * xg[:, None, :]
    y = tl.sum(acc, axis=2)
    tl.store(y_ptr + pid_k * stride_ys + row[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=r_ok[:, None] & n_ok[None, :])


def rows_plan(N: int, K: int, bits: int, block_n: int, device=None) -> tuple[int, int]:
    """(splits used, words per split): K is split until one tile of rows has about four one-warp programs per
    multiprocessor. It depends on the weight's shape alone, not on the batch, so that a row's sums (and so its
    result) are the same whatever else is in the batch."""
    kw, kb = K // (32 // bits), gemv_step_words(K, bits, 1)
    steps = triton.cdiv(kw, kb)
    split = max(1, min(steps, (4 * num_sms(device)) // triton.cdiv(N, block_n)))
    w_per_split = triton.cdiv(steps, split) * kb
    return triton.cdiv(kw, w_per_split), w_per_split


def gemv_rows_launch(xp, qt_w, scales, biases, out, M, N, K, bits, gs, rows_per_program, block_n, table=None,
                     x_div=1, extra=None, split=None):
    """Launch `_gemv_rows_kernel`: xp from `prep_x` ([M or slots / x_div, ...]); W [E?, N, KW] int32 with
    scales/biases [E?, N, K/GS]; out [splits, rows, N] (fp32 when split). table: (order, offsets, tile_expert,
    tile_row) of `moe.triton._tile_table` for the grouped form (tiles of `rows_per_program` slots); extra: (W,
    scales, biases) of the expert that the table's last id stands for. Returns the splits used."""
    grouped = table is not None
    tiles = table[2].numel() if grouped else triton.cdiv(M, rows_per_program)
    kw = K // (32 // bits)
    kb = gemv_step_words(K, bits, 1)
    used, w_per_split = split or rows_plan(N, K, bits, block_n, xp.device)
    order, offsets, tile_expert, tile_row = table if grouped else (xp, xp, xp, xp)
    n_experts = offsets.numel() - 1 if grouped else 0
    wx, sx, bx = extra if extra is not None else (qt_w, scales, biases)
    use_pdl = pdl(xp.device)
    _gemv_rows_kernel[(triton.cdiv(N, block_n), used, tiles)](
        xp, qt_w, scales, biases, out, order, tile_expert, tile_row, offsets, wx, sx, bx, M, N, kw, w_per_split,
        x_div, n_experts, xp.stride(0), qt_w.stride(0) if grouped else 0, qt_w.stride(-2),
        scales.stride(0) if grouped else 0, scales.stride(-2), out.stride(0), out.stride(1),
        BITS=bits, GS=gs, BLOCK_N=block_n, KB=kb, R=rows_per_program, GROUPED=grouped, EXTRA=extra is not None,
        EVEN_N=N % block_n == 0, EVEN_K=kw % kb == 0 and w_per_split % kb == 0, ASM=not INTERPRET, PDL=use_pdl,
        launch_pdl=use_pdl, num_warps=1, num_stages=1)
    return used


def qgemv_rows(x: torch.Tensor, qt, rows_per_program: int = 8, block_n: int = 2) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T for a small batch of rows, each W block read once per `rows_per_program` rows."""
    M, K = x.shape
    N = qt.weight.shape[0]
    xp = prep_x(x.contiguous(), qt.bits, qt.group_size)
    split = rows_plan(N, K, qt.bits, block_n, x.device)
    out = torch.empty((split[0], M, N), dtype=x.dtype if split[0] == 1 else torch.float32, device=x.device)
    gemv_rows_launch(xp, qt.weight.view(torch.int32), qt.scales, qt.biases, out, M, N, K, qt.bits, qt.group_size,
                     rows_per_program, block_n, split=split)
    return out[0] if out.shape[0] == 1 else out.sum(0).to(x.dtype)
