"""Absorbed ("folded") MLA decode attention on CUDA: split-K flash-decoding over the latent cache.

One new query per sequence b, at position positions[b] in cache row rows[b]; it sees positions 0..positions[b].
The caller folds W_UK into the query (q_lat = W_UK^T q_nope per head, [B, H, R]) and W_UV into the output, so the
kernel attends the cache as it is stored (`cache/latent.py`: per position [latent c (R) | roped key k_pe (P)]):

    scores = (q_lat . c + q_pe . k_pe) * scale,  o_lat = softmax(scores) . c     ([B, H, R])

Program (sequence, block of BLOCK_H heads, split): the heads of the block are the M dimension of both products,
so each latent tile [BLOCK_N, R + P] that one program loads serves all its heads (FlashMLA's point: with
H <= BLOCK_H, e.g. Moonlight's and V2-Lite's 16 heads, every latent byte is read once per token; with more heads
the head blocks of a (sequence, split) are neighbouring programs and the later ones find the tile in L2). Over its
split's positions in blocks of BLOCK_N, with an online softmax in base 2 (the scale times log2(e) on the scores),
it writes its unnormalised partial output [BLOCK_H, R] and (max, sum) per head; `_merge_kernel` combines the splits
(a split that saw no key, max = -inf, weighs 0; a query that saw no key at all gets 0, not NaN), as
`kernels/attention/triton.py` does for the dense cache.

Sizes (H100/H200: 228 KB shared memory and 64K 32-bit registers per SM), R = 512, P = 64 in bf16:
* the accumulator [BLOCK_H, R] fp32 lives in registers: 16 x 512 x 4 B = 32 KB, over 4 warps 64 registers a thread;
  q_lat [16, 512] bf16 as a dot operand another 32; with the score/probability fragments ~130-160 registers a
  thread, 2-3 programs an SM. 32 heads (H > 16) double both: 8 warps keep a thread at the same count. 64 heads
  (FlashMLA's tile, two warpgroups splitting R) would need 128 accumulator registers a thread at 8 warps: Triton
  spills, so more than 32 heads take several head blocks.
* a latent tile of BLOCK_N = 32 positions is 32 x 576 x 2 B = 36 KB; two pipeline stages 72 KB: three programs fit
  an SM's shared memory, the loads of the next tile in flight while the current one is multiplied.
* the partials are fp32 [heads, R] a split: 32 KB for 16 heads, about a quarter of a 128-position split's latent
  bytes; they are written and read back at once (in L2), so splits shorter than 128 positions are not made.
What ptxas makes of it for sm_90 (Triton 3.9, bf16, R = 512, P = 64; compiled without a GPU, not timed): 16 heads,
BLOCK_N 32, 4 warps, 2 stages: 128 registers, 56 KB shared, no spills, cp.async pipelined, mma.sync (four programs
fit an SM by both); 3 stages 93 KB; 32 heads at 8 warps 161 registers (one program an SM by registers), at 4 warps
255; 64 heads at 8 warps takes wgmma but spills (255 registers + 88 B stack). So 16 heads a program up to 16
heads, 32 (8 warps) above. These defaults are reasoned, not timed: a GPU sweep should set them (every one is an
argument).

Compile-time sizes do not depend on the batch: the launch is planned for the batch rounded up to a power of two
(splits, the merge's load sizes), so serving does not compile per batch size. No host reads of device values:
`visible` is a host int bounding the keys (a loose bound such as the capacity is correct; the splits past a
query's keys weigh 0), so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from sluice.kernels.launch import num_sms, pdl as pdl_available, pdl_start

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MERGE_ELEMS = 16384  # partial-output values one merge program loads at once (64 KB of fp32)
LOG2E = 1.4426950408889634


@triton.jit
def _mla_split_kernel(ql_ptr, qp_ptr, kv_ptr, pos_ptr, rows_ptr, tab_ptr, op_ptr, ml_ptr, scale_log2, H, n_hb,
                      per_split, cap, page, stride_tab,
                      stride_lb, stride_lh, stride_pb, stride_ph, stride_kr, stride_kt,
                      R: tl.constexpr, P: tl.constexpr, BR: tl.constexpr, BP: tl.constexpr, BH: tl.constexpr,
                      BLOCK_N: tl.constexpr, TC: tl.constexpr, PAGED: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)  # q and the cache come from the kernels before
    bh = tl.program_id(0)  # head blocks fastest: the programs of one (sequence, split) run side by side (L2)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    b = bh // n_hb
    hb = bh % n_hb
    p = tl.load(pos_ptr + b)
    row = tl.load(rows_ptr + b).to(tl.int64)
    start = split * per_split
    stop = tl.minimum(tl.minimum(start + per_split, p + 1), cap)  # never past the row, whatever positions say
    g = tl.arange(0, BH)
    heads = hb * BH + g
    h_ok = heads < H
    r = tl.arange(0, BR)
    e = tl.arange(0, BP)
    q_lat = tl.load(ql_ptr + b.to(tl.int64) * stride_lb + heads[:, None] * stride_lh + r[None, :],
                    mask=_cols(h_ok, r, R, BR), other=0.0)
    q_pe = tl.load(qp_ptr + b.to(tl.int64) * stride_pb + heads[:, None] * stride_ph + e[None, :],
                   mask=_cols(h_ok, e, P, BP), other=0.0)
    base = kv_ptr + row * stride_kr
    m = tl.full((BH,), float("-inf"), dtype=tl.float32)
    lsum = tl.zeros((BH,), dtype=tl.float32)
    acc = tl.zeros((BH, BR), dtype=tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        valid = j < stop
        if PAGED:  # the block of this tile's positions (a tile never straddles two: page % BLOCK_N == 0)
            blk = tl.load(tab_ptr + row * stride_tab + n0 // page).to(tl.int64)
            tile = kv_ptr + blk * stride_kr + (j % page)[:, None].to(tl.int64) * stride_kt
        else:
            tile = base + j[:, None].to(tl.int64) * stride_kt
        c = tl.load(tile + r[None, :], mask=_cols(valid, r, R, BR), other=0.0)  # [BLOCK_N, R]: K and V
        kp = tl.load(tile + R + e[None, :], mask=_cols(valid, e, P, BP), other=0.0)  # [BLOCK_N, P]
        s = _dot(q_lat, tl.trans(c), TC) + _dot(q_pe, tl.trans(kp), TC)
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a head that has seen nothing yet stays at 0
        alpha = tl.exp2(m - m_safe)
        pr = tl.exp2(s - m_safe[:, None])
        lsum = lsum * alpha + tl.sum(pr, axis=1)
        m = m_new
        acc = acc * alpha[:, None] + _dot(pr, c, TC)  # the probabilities in the cache's dtype, as FlashAttention
    part = bh * n_splits + split
    tl.store(op_ptr + (part * BH + g[:, None]).to(tl.int64) * BR + r[None, :], acc)
    tl.store(ml_ptr + (part * 2) * BH + g, m)
    tl.store(ml_ptr + (part * 2 + 1) * BH + g, lsum)


@triton.jit
def _cols(rows_ok, cols, N: tl.constexpr, BN: tl.constexpr):
    """The mask [rows, BN] of rows_ok rows and the first N of BN columns; a row mask alone when N = BN (the real
    sizes: whole 16-byte vectors, no per-column predicate)."""
    mask = rows_ok[:, None]
    if N != BN:
        mask = mask & (cols < N)[None, :]
    return mask


@triton.jit
def _dot(a, b, TC: tl.constexpr):
    """a @ b with fp32 accumulation: on a GPU (TC) the operands in b's dtype (the cache's: bf16/fp16 tensor cores;
    an fp32 cache multiplies in full fp32); under the interpreter in fp32, whose bf16 dot is wrong."""
    if TC:
        if b.dtype == tl.float32:
            return tl.dot(a.to(tl.float32), b, input_precision="ieee")
        return tl.dot(a.to(b.dtype), b)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _merge_kernel(op_ptr, ml_ptr, o_ptr, H, n_hb, n_splits, stride_ob, stride_oh,
                  R: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr, NSP: tl.constexpr,
                  SB: tl.constexpr, PDL: tl.constexpr):
    """Program (sequence and head, BD latent coordinates): the splits' weights 2^(m_s - M) and the weighted sum of
    their partial outputs over the total weight. All (max, sum) pairs and (SB >= splits, the usual case) all partial
    outputs are loaded at once: the merge is latency, one round trip."""
    pdl_start(PDL)
    row = tl.program_id(0)
    b = row // H
    h = row % H
    bh = b * n_hb + h // BH
    g = h % BH
    sp = tl.arange(0, NSP)
    ml = ml_ptr + (bh * n_splits) * 2 * BH + g
    m = tl.load(ml + sp * 2 * BH, mask=sp < n_splits, other=float("-inf"))
    lsum = tl.load(ml + sp * 2 * BH + BH, mask=sp < n_splits, other=0.0)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    parts = op_ptr + ((bh * n_splits) * BH + g).to(tl.int64) * BR + d[None, :]
    sb = tl.arange(0, SB)
    first = tl.load(parts + sb[:, None] * BH * BR, mask=(sb < n_splits)[:, None], other=0.0)
    M = tl.max(m, axis=0)
    M = tl.where(M == float("-inf"), 0.0, M)  # no split saw a key: every weight 0
    denom = tl.sum(_split_weight(m, M) * lsum, axis=0)
    ws = tl.load(ml + sb * 2 * BH, mask=sb < n_splits, other=float("-inf"))
    acc = tl.sum(_split_weight(ws, M)[:, None] * first, axis=0)
    for s0 in range(SB, n_splits, SB):  # more splits than one load holds
        s = s0 + sb
        ms = tl.load(ml + s * 2 * BH, mask=s < n_splits, other=float("-inf"))
        part = tl.load(parts + s[:, None] * BH * BR, mask=(s < n_splits)[:, None], other=0.0)
        acc += tl.sum(_split_weight(ms, M)[:, None] * part, axis=0)
    acc = acc / tl.where(denom > 0, denom, 1.0)  # no key seen at all (a padding query): 0
    tl.store(o_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + d, acc.to(o_ptr.dtype.element_ty), mask=d < R)


@triton.jit
def _split_weight(m, M):
    """2^(m - M) for the splits' maxima m (base-2 scores); a split that saw no key (m = -inf) weighs nothing."""
    return tl.where(m == float("-inf"), 0.0, tl.exp2(m - M))


def num_splits(programs: int, visible: int, device, min_per_split: int, per_sm: int = 2) -> int:
    """Enough splits for about `per_sm` programs per multiprocessor over `programs` (sequences x head blocks),
    each with >= `min_per_split` positions."""
    want = triton.cdiv(per_sm * num_sms(device), programs)
    return max(1, min(want, triton.cdiv(visible, min_per_split)))


def mla_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor,
               positions: torch.Tensor, visible: int, scale: float, *, splits: int | None = None,
               block_n: int = 32, block_h: int | None = None, num_warps: int | None = None, num_stages: int = 2,
               min_per_split: int = 128, merge_elems: int = MERGE_ELEMS, out_dtype: torch.dtype | None = None,
               pdl: bool = False, table: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed MLA decode attention. q_lat [B, H, R] (W_UK folded in), q_pe [B, H, P] (roped), unit last strides;
    cache [rows, capacity, R + P] (one layer of `LatentCache.latent`: [latent | roped key] per position, unit last
    stride); rows, positions: contiguous int32/int64 [B] on the device (query b reads cache row rows[b], positions
    0..positions[b]; neither checked on the host: nothing is read back). `visible`: a host int bound on the
    positions any query sees (sizes the splits; clamped to the capacity). Returns o_lat = softmax((q_lat . c +
    q_pe . k_pe) * scale) . c, [B, H, R] in out_dtype (default q_lat's). The rest (splits, block_n positions a
    step, block_h heads a program, warps, stages, the shortest split, the merge's load size, programmatic
    dependent launch where the GPU has it) default to the sizes the module docstring reasons out. Paged (`table`,
    int32 [rows, max blocks] on the device, `cache/blocks.py`): cache is blocks [N, page, R + P], and query b's
    position j sits in block table[rows[b], j // page] at slot j % page (the tiles' block_n a divisor of the
    page)."""
    if q_lat.dim() != 3 or q_pe.dim() != 3 or q_pe.shape[:2] != q_lat.shape[:2]:
        raise ValueError(f"mla decode: q_lat [B, H, R] and q_pe [B, H, P] must share B and H, got "
                         f"{tuple(q_lat.shape)} and {tuple(q_pe.shape)}")
    B, H, R = q_lat.shape
    P = q_pe.shape[-1]
    if B < 1 or H < 1 or R < 1 or P < 1:
        raise ValueError(f"mla decode: empty query, q_lat {tuple(q_lat.shape)}, q_pe {tuple(q_pe.shape)}")
    if cache.dim() != 3 or cache.shape[-1] != R + P or cache.stride(-1) != 1:
        raise ValueError(f"mla decode: cache must be [rows, capacity, R + P = {R + P}] with a unit last stride, got "
                         f"{tuple(cache.shape)}")
    if q_lat.stride(-1) != 1 or q_pe.stride(-1) != 1:
        raise ValueError("mla decode: q_lat and q_pe need unit last strides")
    for name, t in (("q_lat", q_lat), ("q_pe", q_pe)):
        if not t.is_floating_point() or t.device != cache.device:
            raise ValueError(f"mla decode: {name} must be a floating tensor on the cache's device {cache.device}, got "
                             f"{t.dtype} on {t.device}")
    for name, index in (("positions", positions), ("rows", rows)):
        if (index.shape != (B,) or index.dtype not in (torch.int32, torch.int64) or not index.is_contiguous()
                or index.device != cache.device):
            raise ValueError(f"mla decode: {name} must be contiguous int32 or int64 [B={B}] on {cache.device}, got "
                             f"{index.dtype} {tuple(index.shape)} on {index.device}")
    if not isinstance(visible, int) or isinstance(visible, bool) or visible < 1:
        raise ValueError(f"mla decode: visible must be a host int >= 1, got {visible!r}")
    if not math.isfinite(scale):
        raise ValueError(f"mla decode: scale must be finite, got {scale}")
    if splits is not None and splits < 1:
        raise ValueError(f"mla decode: splits must be >= 1, got {splits}")
    if block_n < 16 or block_n & (block_n - 1) or (block_h is not None and (block_h < 16 or block_h & (block_h - 1))):
        raise ValueError(f"mla decode: block_n and block_h must be powers of two >= 16, got {block_n}, {block_h}")
    if table is not None:  # a tile within one block: block_n divides the page
        block_n = math.gcd(block_n, cache.shape[1])
        if (table.dim() != 2 or table.dtype != torch.int32 or table.stride(-1) != 1 or table.device != cache.device
                or block_n < 16):
            raise ValueError(f"mla decode: a block table must be int32 [rows, blocks] with a unit last stride on the "
                             f"cache's device, the page ({cache.shape[1]}) a multiple of 16")
    page = cache.shape[1]
    capacity = page if table is None else page * table.shape[1]  # positions a row holds
    visible = min(visible, capacity)
    BR, BP = max(16, triton.next_power_of_2(R)), max(16, triton.next_power_of_2(P))
    BH = block_h or (16 if H <= 16 else 32)
    n_hb = triton.cdiv(H, BH)
    warps = num_warps or (4 if BH * BR <= 16 * 512 else 8)
    # the launch is planned for the batch rounded up to a power of two: the compile-time sizes then take a few
    # values whatever the batch (a decode step's tokens come in any number)
    Bp = triton.next_power_of_2(B)
    ns = splits or num_splits(Bp * n_hb, visible, cache.device, max(min_per_split, block_n))
    per_split = triton.cdiv(triton.cdiv(visible, ns), block_n) * block_n
    ns = triton.cdiv(visible, per_split)
    device = cache.device
    op = torch.empty((B * n_hb, ns, BH, BR), dtype=torch.float32, device=device)
    ml = torch.empty((B * n_hb, ns, 2, BH), dtype=torch.float32, device=device)
    use_pdl = pdl and pdl_available(device)
    _mla_split_kernel[(B * n_hb, ns)](
        q_lat, q_pe, cache, positions, rows, positions if table is None else table, op, ml, scale * LOG2E, H, n_hb,
        per_split, capacity, page, 0 if table is None else table.stride(0),
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), cache.stride(0), cache.stride(1),
        R=R, P=P, BR=BR, BP=BP, BH=BH, BLOCK_N=block_n, TC=not INTERPRET, PAGED=table is not None, PDL=use_pdl,
        launch_pdl=use_pdl,
        num_warps=warps, num_stages=num_stages)
    o = torch.empty((B, H, R), dtype=out_dtype or q_lat.dtype, device=device)
    # the merge: coordinate blocks small enough that one load holds every split's partials (<= 64 KB a program),
    # narrower when there are few (sequence, head) programs (batch 1) to spread the round trip over more SMs
    nsp = triton.next_power_of_2(ns)
    BD = min(BR, 128, max(16, merge_elems // nsp))
    while BD > 16 and Bp * H * (BR // BD) < num_sms(device) // 2:
        BD //= 2
    sb = min(nsp, max(1, merge_elems // BD))
    _merge_kernel[(B * H, BR // BD)](op, ml, o, H, n_hb, ns, o.stride(0), o.stride(1), R=R, BR=BR, BH=BH, BD=BD,
                                     NSP=nsp, SB=sb, PDL=use_pdl, launch_pdl=use_pdl,
                                     num_warps=max(1, min(8, sb * BD // 2048)))
    return o


def applies(cache: torch.Tensor) -> bool:
    """Whether `absorbed_decode` runs the kernel for this cache layer: on a GPU (elsewhere the torch reference)."""
    return cache.is_cuda


def absorbed_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor,
                    positions: torch.Tensor, visible: int, w_uk: torch.Tensor, w_uv: torch.Tensor,
                    scale: float, table: torch.Tensor | None = None) -> torch.Tensor:
    """The whole folded decode of `reference.absorbed_attention` through the kernel: q_nope [B, H, nope], q_pe
    [B, H, P] (one query per sequence), cache [rows, capacity, R + P] (or paged: blocks through `table`), w_uk
    [H, nope, R], w_uv [H, v, R]; the
    products in the cache's dtype, as the reference takes them. Returns [B, H, v] in q_nope's dtype."""
    dt = cache.dtype
    q_lat = torch.einsum("bhn,hnr->bhr", q_nope.to(dt), w_uk.to(dt))  # q' = W_UK^T q_nope, per head
    o_lat = mla_decode(q_lat, q_pe.to(dt).contiguous(), cache, rows, positions, visible, scale, table=table)
    return torch.einsum("bhr,hvr->bhv", o_lat, w_uv.to(dt)).to(q_nope.dtype)
