"""The MoE prefill's grouped GEMM: the (token, expert) slots sorted by expert, a table of BLOCK_M-row tiles (expert,
first row) built on the device, and ONE tensor-core GEMM launch per projection over every tile, each tile's weights
made in registers once for all its rows (`qmatmul.gemm.group_weights`), always swapped (the weights the dot's
register operand), SwiGLU fused into gate_up's epilogue. `kernels/moe/triton.py` `moe_prefill` runs it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sluice.kernels.qmatmul import gemm
from sluice.kernels.qmatmul import triton as qmm


@triton.jit
def _scales(s_ptr, b_ptr, rows, group, stride_sn):
    return tl.load(s_ptr + rows * stride_sn + group), tl.load(b_ptr + rows * stride_sn + group)


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, s_ptr, b_ptr, c_ptr, order_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
                         N, K, E, a_div, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_cm,
                         BITS: tl.constexpr, GS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, SWIGLU: tl.constexpr, STACK: tl.constexpr, PREFETCH: tl.constexpr,
                         DOT_FP32: tl.constexpr, MAGIC: tl.constexpr, ASM: tl.constexpr):
    """For the sorted rows r of one tile of expert e, with slot = order[r]:
    C[slot, n-block] = A[slot // a_div] @ W[e, n-block]^T, or with SWIGLU (W[e] = gate rows [0, N), up rows
    [N, 2N)): silu(A Wg^T) * (A Wu^T). Program (n-block, tile); tiles past the table's end exit at once.

    Per quantization group the codes are loaded packed, made s q + b in registers (`gemm.group_weights`) once for
    all the tile's rows, and multiplied with the dot accumulating across groups. The product is computed
    transposed, W A^T, so that W, made in registers, is the dot's register operand and only A goes through shared
    memory. STACK (with SWIGLU): a tile's W rows are BLOCK_N / 2 gate rows and the matching up rows, one
    accumulator for both. PREFETCH (one group a K step): each step's scales and biases are loaded a step ahead."""
    pid_n = tl.program_id(0)
    tile = tl.program_id(1)
    e = tl.load(tile_expert_ptr + tile)
    if e >= E:  # the grid is an upper bound on the tile count
        return
    row_end = tl.load(offsets_ptr + e + 1)
    offs_r = tl.load(tile_row_ptr + tile) + tl.arange(0, BLOCK_M)
    r_ok = offs_r < row_end
    slot = tl.load(order_ptr + tl.minimum(offs_r, row_end - 1)).to(tl.int64)  # clamped rows: real data, not stored
    a_rows = a_ptr + (slot // a_div) * stride_am
    e = e.to(tl.int64)
    w_ptr += e * stride_we
    s_ptr += e * stride_se
    b_ptr += e * stride_se
    OUT: tl.constexpr = BLOCK_N // 2 if STACK else BLOCK_N  # outputs of a program
    offs_n = pid_n * OUT + tl.arange(0, OUT)
    if STACK:
        i = tl.arange(0, BLOCK_N)
        rows_n = (tl.minimum(pid_n * OUT + i % OUT, N - 1) + (i // OUT) * N).to(tl.int64)
    else:
        rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    TWO: tl.constexpr = SWIGLU and not STACK  # a second accumulator for the up rows
    if TWO:
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    EPW: tl.constexpr = 32 // BITS
    P: tl.constexpr = BLOCK_K if BLOCK_K < GS else GS  # columns of one group within a K step
    if PREFETCH:
        s_n, b_n = _scales(s_ptr, b_ptr, rows_n, 0, stride_sn)
        if TWO:
            su_n, bu_n = _scales(s_ptr, b_ptr, rows_n + N, 0, stride_sn)
    for k0 in range(0, K, BLOCK_K):  # K is a multiple of BLOCK_K: no masks
        k0 = tl.multiple_of(k0, BLOCK_K)
        for g in tl.static_range(BLOCK_K // P):
            kg = k0 + g * P
            if PREFETCH:  # (one group a step)
                s, b = s_n, b_n
                nxt = tl.minimum(k0 + BLOCK_K, K - 1) // GS
                s_n, b_n = _scales(s_ptr, b_ptr, rows_n, nxt, stride_sn)
                if TWO:
                    su, bu = su_n, bu_n
                    su_n, bu_n = _scales(s_ptr, b_ptr, rows_n + N, nxt, stride_sn)
            else:
                s, b = _scales(s_ptr, b_ptr, rows_n, kg // GS, stride_sn)
                if TWO:
                    su, bu = _scales(s_ptr, b_ptr, rows_n + N, kg // GS, stride_sn)
            a = tl.load(a_rows[:, None] + (kg + tl.arange(0, P))[None, :])
            offs_w = (kg // EPW + tl.arange(0, P // EPW))[None, :]
            wt = gemm.group_weights(tl.load(w_ptr + rows_n[:, None] * stride_wn + offs_w), s, b, BITS, MAGIC, ASM)
            acc = gemm.accumulate(acc, a, wt, True, DOT_FP32)
            if TWO:
                wu = gemm.group_weights(tl.load(w_ptr + (rows_n + N)[:, None] * stride_wn + offs_w), su, bu, BITS,
                                       MAGIC, ASM)
                acc_u = gemm.accumulate(acc_u, a, wu, True, DOT_FP32)
    if SWIGLU:
        if STACK:  # gate rows first, then up rows: split the accumulator
            acc, acc_u = tl.split(tl.permute(tl.reshape(acc, (2, OUT, BLOCK_M)), (1, 2, 0)))
        acc = acc / (1.0 + tl.exp(-acc)) * acc_u
    tl.store(c_ptr + slot[None, :] * stride_cm + offs_n[:, None], acc.to(c_ptr.dtype.element_ty),
             mask=r_ok[None, :] & (offs_n < N)[:, None])


@triton.jit
def _expert_counts_kernel(ids_ptr, counts_ptr, n, EP: tl.constexpr, BLOCK: tl.constexpr):
    """counts[e] += the slots of expert e among this program's BLOCK ids (a histogram, then one atomic per bin)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + offs, mask=offs < n, other=0)
    h = tl.histogram(ids, EP, mask=(offs < n) & (ids < EP))  # (ids past the experts counted: no tiles)
    tl.atomic_add(counts_ptr + tl.arange(0, EP), h, sem="relaxed")


@triton.jit
def _min(a, b):
    return tl.minimum(a, b)


@triton.jit
def _tile_table_kernel(counts_ptr, ids_ptr, order_ptr, n, offsets_ptr, tile_expert_ptr, tile_row_ptr, E, n_tiles,
                       BLOCK_M: tl.constexpr, EP: tl.constexpr, BLOCK: tl.constexpr, SORTED: tl.constexpr):
    """One program, from each expert's slot count: offsets [E + 1] (their exclusive sums: the first sorted row of
    each expert, then the slots of experts < E), and the table of BLOCK_M-row tiles, per tile its expert and first
    sorted row, in expert order; the table's unused tail marked with expert E.
    SORTED (no histogram launch before): the first sorted row of each expert read off the slots in `order`, their
    expert ids (clamped to E) in order: where the id changes at row i, offsets[id] = i (offsets first all n), then
    a suffix minimum gives the experts without slots the next one's. O(n + E), where a histogram in one program
    is O(n E)."""
    bins = tl.arange(0, EP)
    if SORTED:
        tl.store(offsets_ptr + bins, tl.zeros((EP,), dtype=tl.int32) + n, mask=bins <= E)
        tl.debug_barrier()
        for i0 in range(0, n, BLOCK):
            i = i0 + tl.arange(0, BLOCK)
            ok = i < n
            e = tl.minimum(tl.load(ids_ptr + tl.load(order_ptr + i, mask=ok, other=0), mask=ok, other=E), E)
            had = ok & (i > 0)
            prev = tl.minimum(tl.load(ids_ptr + tl.load(order_ptr + i - 1, mask=had, other=0), mask=had, other=-1), E)
            tl.store(offsets_ptr + e, i, mask=ok & (e != prev))
        tl.debug_barrier()
        starts = tl.associative_scan(tl.load(offsets_ptr + bins, mask=bins <= E, other=n), 0, _min, reverse=True)
        tl.debug_barrier()  # (every thread has read the offsets before any is overwritten)
        tl.store(offsets_ptr + bins, starts, mask=bins <= E)
        tl.debug_barrier()
        counts = tl.where(bins < E, tl.load(offsets_ptr + bins + 1, mask=bins < E, other=0) - starts, 0)
    else:
        counts = tl.load(counts_ptr + bins, mask=bins < E, other=0)
        starts = tl.cumsum(counts, 0) - counts
    if not SORTED:
        tl.store(offsets_ptr + bins, starts, mask=bins < E)
        tl.store(offsets_ptr + E, tl.sum(counts, 0))
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    first_tile = tl.cumsum(tiles, 0) - tiles
    for j in range(0, tl.max(tiles, 0)):
        ok = j < tiles
        tl.store(tile_expert_ptr + first_tile + j, bins, mask=ok)
        tl.store(tile_row_ptr + first_tile + j, starts + j * BLOCK_M, mask=ok)
    for t0 in range(tl.sum(tiles, 0), n_tiles, BLOCK):
        offs = t0 + tl.arange(0, BLOCK)
        tl.store(tile_expert_ptr + offs, tl.zeros((BLOCK,), dtype=tl.int32) + E, mask=offs < n_tiles)


COUNT_IN_TABLE_SLOTS = 8192  # up to this many slots the table's one program reads the experts' first rows off the
# sorted slots (no zeroed counts, no histogram launch); beyond, a histogram launch of many programs first


def tile_table(ids: torch.Tensor, order: torch.Tensor, E: int, block_m: int):
    """The BLOCK_M-row tiles over the slots of ids [T, k] in `order` (their stable expert order), computed on the
    device in one launch (two past COUNT_IN_TABLE_SLOTS slots).

    Returns order, offsets [E + 1] (the first sorted row of each expert), and per tile its expert and first sorted
    row. The host cannot know the tile count without a sync, so
    the table has an upper-bound length (each expert adds at most one partial tile; every tile holds a slot), its
    unused tail marked with expert E."""
    flat = ids.reshape(-1)
    n = flat.numel()
    n_tiles = min(n, triton.cdiv(n, block_m) + E)
    EP = triton.next_power_of_2(E + 1)
    count_here = n <= COUNT_IN_TABLE_SLOTS  # one launch: the table's program finds the experts' rows itself
    counts = None
    if not count_here:
        counts = torch.zeros(EP, dtype=torch.int32, device=ids.device)
        _expert_counts_kernel[(triton.cdiv(n, 1024),)](flat, counts, n, EP=EP, BLOCK=1024, num_warps=4)
    offsets = torch.empty(E + 1, dtype=torch.int32, device=ids.device)
    tile_expert = torch.empty(n_tiles, dtype=torch.int32, device=ids.device)
    tile_row = torch.empty(n_tiles, dtype=torch.int32, device=ids.device)
    _tile_table_kernel[(1,)](offsets if counts is None else counts, flat, order, n, offsets, tile_expert, tile_row,
                             E, n_tiles, BLOCK_M=block_m, EP=EP, BLOCK=1024, SORTED=count_here, num_warps=4)
    return order, offsets, tile_expert, tile_row



class GemmConfig(NamedTuple):
    """One grouped GEMM's launch: its tile (BLOCK_N weight rows x BLOCK_K columns), warps, pipeline stages, and
    `_grouped_gemm_kernel`'s STACK and PREFETCH."""
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    stack: bool = False
    prefetch: bool = True


def grouped_gemm(a, a_div, qt, c, table, swiglu, block_m, config: GemmConfig):
    """c[row] = the product of a's rows by their expert's weight (qt, stacked experts), per `tile_table`; a row r of
    c reads row order[r] // a_div of a; with swiglu, qt is gate_up and c takes silu(gate) * up."""
    order, offsets, tile_expert, tile_row = table
    N = qt.out_features // 2 if swiglu else qt.out_features
    K = qt.in_features
    w = qt.weight.view(torch.int32)
    block_k = min(config.block_k, K & -K)  # the largest power of two dividing K (>= 32) caps the K step
    stack = config.stack and swiglu
    _grouped_gemm_kernel[(triton.cdiv(N, config.block_n // 2 if stack else config.block_n), tile_expert.numel())](
        a, w, qt.scales, qt.biases, c, order, tile_expert, tile_row, offsets, N, K, offsets.numel() - 1, a_div,
        a.stride(0), w.stride(0), w.stride(1), qt.scales.stride(0), qt.scales.stride(1), c.stride(0),
        BITS=qt.bits, GS=qt.group_size, BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=block_k, SWIGLU=swiglu,
        STACK=stack, PREFETCH=config.prefetch and block_k <= qt.group_size,
        DOT_FP32=qmm.INTERPRET or a.dtype == torch.float32, MAGIC=gemm.magic_dequant(qt.bits, a.dtype),
        ASM=gemm.asm_dequant(qt.bits, a.dtype, min(block_k, qt.group_size)), num_warps=config.num_warps,
        num_stages=config.num_stages)


def prefill_configs(rows: float) -> tuple[int, GemmConfig, GemmConfig]:
    """(block_m, gate_up's config, down's) for experts that average `rows` rows. Tiles as tall as the rows an
    expert has: each tile makes its expert's weights once for all its rows. Below 24 rows, gate_up stacks its gate
    and up rows in one tile. From the H100 sweeps at 512 to 4,096 tokens (docs/perf-log.md, 2026-11-26 "prefill,
    session 2")."""
    if rows >= 64:
        return 128, GemmConfig(), GemmConfig(128, num_stages=4)
    if rows >= 24:
        return 64, GemmConfig(), GemmConfig(128)
    return 16, GemmConfig(stack=True, prefetch=False), GemmConfig()
