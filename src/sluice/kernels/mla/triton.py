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

Sizes (H100/H200: 228 KB shared memory and 64K 32-bit registers per SM), R = 512, P = 64 in bf16. Per position
and head the products cost 2 (R + P) + 2 R = 2,176 FLOP against 1,152 bytes of latent shared by all heads: 30
FLOP/byte at 16 heads (bandwidth-bound: the tile loads matter), 242 at 128 (at an H200's ridge: the tensor cores
matter, and bandwidth alone would put batch 16 at 32k in ~130 us, its 146 GFLOP ~150-250 us).
* up to 16 heads, 16 a program (`default_sizes`): the accumulator [16, R] fp32 is 64 registers a thread over 4
  warps; M = 16 is below wgmma's 64, so mma.sync; 128 registers, 56 KB shared (2 stages of 32-position tiles,
  36 KB each, and q): four programs an SM by both.
* 17-32 heads: 32 a program at 8 warps (128 registers, mma.sync).
* more (DeepSeek-V3's 128, Kimi-K2's 64): 64 heads a program at 8 warps, FlashMLA's tile. M = 64 takes wgmma;
  Triton lays the 8 warps out as two warpgroups splitting N, so each holds half the accumulator ([64, 256] fp32:
  128 registers a thread) and computes the scores of half the tile's positions; q [64, 576] stays in shared
  memory (72 KB) with the tiles. Each latent tile is read by H / 64 programs (neighbours in the grid: the second
  read is an L2 hit) instead of H / 16-32 mma.sync programs that each spent ~1/8 of the tensor rate (measured
  before this change: 128 heads at 0.07-0.10 of the read ceiling, ~75-115 TFLOP/s). One program an SM (all
  registers), latency hidden by the 2-stage cp.async pipeline and wgmma's asynchrony.
* the partials are fp32 [block heads, R] a program (32 KB at 16 heads, 128 KB at 64) written once and read back
  by the merge (L2); the split plan keeps them few (below).
What ptxas makes of it for sm_90 (compiled without a GPU by `triton.compile(ASTSource(...), target=GPUTarget("cuda",
90, 32))`, not timed; bf16, R = 512, P = 64; registers / spill stack / shared memory):
  Triton 3.6 (the H200's): 16 heads: BLOCK_N 32, 4 warps, 2 stages 128 / 0 / 55 KB (mma.sync); 3 stages 127 / 0 /
  91 KB; BLOCK_N 16 127 / 0 / 36 KB; BLOCK_N 64 130 / 0 / 92 KB. 32 heads at 8 warps 128 / 0 / 74 KB; at 4 warps
  252. 64 heads (wgmma: m64n16k16 scores and m64n256k16 products at BLOCK_N 32): 8 warps, BLOCK_N 32, 2 stages
  255 / 0 / 144 KB (paged the same); 3 stages 254 / 0 / 180 KB; BLOCK_N 16 228 / 0 / 128 KB; BLOCK_N 64 255
  / 0 / 216 KB (m64n32k16 scores: half the shared-memory reads of q a FLOP); 16 warps, BLOCK_N 32: 128 / 0 / 144
  KB, BLOCK_N 64: 128 / 40 B. 128 heads a program at 16 warps does not compile (ptxas: needs >= 158 registers).
  Triton 3.9 spills the 64-head tile (255 + 184-192 B of stack); 16 heads as above.
  So: 64 heads, BLOCK_N 32, 8 warps, 2 stages by default above 32 heads (BLOCK_N 64 reads q half as often but
  leaves 11 KB of shared memory; the sweep decides). Every size is an argument; `benchmarks/mla_gpu.py --sweep`
  times the alternatives.
Splits (`plan_splits`): the grid is (sequence x head block, split); the programs one SM holds (`resident_programs`,
read from the compiled kernel: 4 at 16 heads, 1 at 64) times the SMs are the slots, and the split count is the
smallest that fills the programs' last wave (within 5 % of the best): 16 heads at batch 16 take 32 splits (512
programs of 528 slots; before, 17 splits gave 272 programs, some SMs three and most two), 128 heads at batch 64 one
split (128 programs on 132 SMs: partials 1/256 of the latent bytes), batch 16 four, batch 1 ~64 (splits of 512
positions: the 128 KB of partials a program ~5 % of its tensor time). Splits keep >= `min_per_split` positions
(MIN_PER_SPLIT), except in a short launch (`short_launch`: splits that long would leave SMs idle), where a split
may be one tile. Paged, a program reads the block table once a block its split touches (the positions walked a
block at a time), not once a tile: a tile's load then waits on no other load.

Compile-time sizes do not depend on the batch: the launch is planned for the batch rounded up to a power of two
(splits, the merge's load sizes), so serving does not compile per batch size. No host reads of device values:
`visible` is a host int bounding the keys (a loose bound such as the capacity is correct; the splits past a
query's keys weigh 0), so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
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
    m = tl.full((BH,), float("-inf"), dtype=tl.float32)
    lsum = tl.zeros((BH,), dtype=tl.float32)
    acc = tl.zeros((BH, BR), dtype=tl.float32)
    # the split's positions block by block (unpaged: page = cap, one block, the row itself), each block's id read
    # once, not once a tile; tiles never straddle two blocks (page % BLOCK_N == 0, start % BLOCK_N == 0)
    for k in range(start // page, tl.cdiv(stop, page)):
        if PAGED:
            blk = tl.load(tab_ptr + row * stride_tab + k).to(tl.int64)
        else:
            blk = row
        block = kv_ptr + blk * stride_kr
        hi = tl.minimum(stop, (k + 1) * page)
        for n0 in range(tl.maximum(start, k * page), hi, BLOCK_N):
            j = n0 + tl.arange(0, BLOCK_N)
            valid = j < hi
            tile = block + (j - k * page)[:, None].to(tl.int64) * stride_kt
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
    if stop > start:  # a split past the query's keys writes (max -inf, sum 0) alone: the merge skips its output
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
    ws = tl.load(ml + sb * 2 * BH, mask=sb < n_splits, other=float("-inf"))
    # the outputs of the splits that saw a key: the others wrote none (reading them would read garbage, NaN too)
    first = tl.load(parts + sb[:, None] * BH * BR, mask=(ws != float("-inf"))[:, None], other=0.0)
    M = tl.max(m, axis=0)
    M = tl.where(M == float("-inf"), 0.0, M)  # no split saw a key: every weight 0
    denom = tl.sum(_split_weight(m, M) * lsum, axis=0)
    acc = tl.sum(_split_weight(ws, M)[:, None] * first, axis=0)
    for s0 in range(SB, n_splits, SB):  # more splits than one load holds
        s = s0 + sb
        ms = tl.load(ml + s * 2 * BH, mask=s < n_splits, other=float("-inf"))
        part = tl.load(parts + s[:, None] * BH * BR, mask=(ms != float("-inf"))[:, None], other=0.0)
        acc += tl.sum(_split_weight(ms, M)[:, None] * part, axis=0)
    acc = acc / tl.where(denom > 0, denom, 1.0)  # no key seen at all (a padding query): 0
    tl.store(o_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + d, acc.to(o_ptr.dtype.element_ty), mask=d < R)


@triton.jit
def _split_weight(m, M):
    """2^(m - M) for the splits' maxima m (base-2 scores); a split that saw no key (m = -inf) weighs nothing."""
    return tl.where(m == float("-inf"), 0.0, tl.exp2(m - M))


@functools.lru_cache(maxsize=4096)
def plan_splits(units: int, visible: int, slots: int, min_per_split: int) -> int:
    """Splits of the context for `units` programs a split index (sequences, rounded up to a power of two, x head
    blocks) on `slots` resident programs (multiprocessors x programs one holds): the fewest that keep the slots
    busiest. Programs run in waves of `slots`; a split count whose programs fill their last wave to within 95 % of
    the best is taken, the smallest such (fewer splits: fewer partials to write and merge). Splits keep >=
    `min_per_split` positions, so a short context or a large batch takes fewer (down to 1)."""
    most = max(1, min(visible // max(1, min_per_split), 4 * slots))

    def filled(ns):
        n = units * ns
        return n / (-(-n // slots) * slots)
    best = max(filled(ns) for ns in range(1, most + 1))
    return next(ns for ns in range(1, most + 1) if filled(ns) >= 0.95 * best)


MIN_PER_SPLIT = 128  # positions a split keeps at least (its partial output [heads, R] in fp32 written and merged)
SHORT_BLOCK_N = 16  # positions a step of a short launch (`short_launch`, up to 16 heads)


def short_launch(units: int, visible: int, min_per_split: int, sms: int) -> bool:
    """Whether a launch of `units` programs a split index over `visible` positions is short: splits of at least
    `min_per_split` positions would leave multiprocessors idle (a short context at a small batch: Moonlight's batch
    1 over ~600 positions took 4-6 programs, each a chain of dependent tile loads). Such a launch waits on latency,
    not bandwidth: its splits go down to one tile (about one program an SM: a batch-1 launch over a long pool
    keeps splits of ~visible / SMs positions), and up to 16 heads the default tiles are SHORT_BLOCK_N positions in
    two stages (docs/perf-log.md, session 8: the step's time by split length and tile size)."""
    return units * max(1, visible // min_per_split) < sms


def default_sizes(H: int, R: int) -> tuple[int, int, int, int]:
    """(block_h, block_n, num_warps, num_stages) for H heads of latent width R: the module docstring's reasoning
    (up to 16 heads: 16 a program, mma.sync; 17-32: 32 at 8 warps; more: 64 heads a program at 8 warps, wgmma, one
    program an SM, each latent tile read by H / 64 programs), then the H200 sweep (`benchmarks/mla_gpu.py --sweep`,
    docs/perf-log.md): three stages at 16 heads (0.94x the time of two, geo-mean of six shapes), tiles of 64
    positions at 64 heads (0.77x those of 32; 255 registers, no spills, 216 KB of shared memory)."""
    if H <= 16:
        return 16, 32, 4, 3
    if H <= 32:
        return 32, 32, 8, 2
    return 64, 64, 8, 2


_RESIDENT: dict = {}  # compiled variant -> programs a multiprocessor holds


def resident_programs(kernel, make_args, kwargs, key, device) -> int:
    """Programs of this compiled split kernel one multiprocessor holds at once (registers, shared memory, threads),
    read from the compiled kernel (compiled here by `warmup` on `make_args()`, arguments of the launch's types and
    alignments, if it was not yet: the same specialisation the launch takes), once a variant; 2 under the
    interpreter or where Triton does not say."""
    if INTERPRET or not torch.cuda.is_available():
        return 2
    if key not in _RESIDENT:
        try:
            k = kernel.warmup(*make_args(), grid=(1,), **kwargs)
            k._init_handles()
            warps = kwargs["num_warps"]
            props = torch.cuda.get_device_properties(device)
            regs_sm = getattr(props, "regs_per_multiprocessor", 65536)
            smem_sm = getattr(props, "shared_memory_per_multiprocessor", 233472)
            threads_sm = getattr(props, "max_threads_per_multi_processor", 2048)
            per_warp = -(-max(1, k.n_regs) * 32 // 256) * 256  # allocated in 256-register units a warp
            _RESIDENT[key] = max(1, min(regs_sm // per_warp // warps, smem_sm // (k.metadata.shared + 1024),
                                        threads_sm // (32 * warps), 32))
        except Exception:  # noqa: BLE001 (an older/newer Triton without these attributes: the usual count)
            _RESIDENT[key] = 2
    return _RESIDENT[key]


def mla_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor,
               positions: torch.Tensor, visible: int, scale: float, *, splits: int | None = None,
               block_n: int | None = None, block_h: int | None = None, num_warps: int | None = None,
               num_stages: int | None = None, min_per_split: int | None = None, programs_per_sm: int | None = None,
               merge_elems: int = MERGE_ELEMS, out_dtype: torch.dtype | None = None, pdl: bool = False,
               table: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed MLA decode attention. q_lat [B, H, R] (W_UK folded in), q_pe [B, H, P] (roped), unit last strides;
    cache [rows, capacity, R + P] (one layer of `LatentCache.latent`: [latent | roped key] per position, unit last
    stride); rows, positions: contiguous int32/int64 [B] on the device (query b reads cache row rows[b], positions
    0..positions[b]; neither checked on the host: nothing is read back). `visible`: a host int bound on the
    positions any query sees (sizes the splits; clamped to the capacity). Returns o_lat = softmax((q_lat . c +
    q_pe . k_pe) * scale) . c, [B, H, R] in out_dtype (default q_lat's). The rest default to the sizes the module
    docstring reasons out (`default_sizes`, `plan_splits`): splits (else planned), block_n positions a step,
    block_h heads a program, warps, stages, the shortest split (MIN_PER_SPLIT positions; one tile where the grid
    would leave multiprocessors idle, `short_launch`), programs_per_sm (the programs one multiprocessor holds at
    once, for the plan; else read from the compiled kernel), the merge's load size, programmatic dependent launch
    where the GPU has it. Paged (`table`, int32 [rows, max blocks] on the device,
    `cache/blocks.py`): cache is blocks [N, page, R + P], and query b's position j sits in block
    table[rows[b], j // page] at slot j % page (the tiles' block_n a divisor of the page)."""
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
    page = cache.shape[1]
    capacity = page if table is None else page * table.shape[1]  # positions a row holds
    visible = min(visible, capacity)
    device = cache.device
    d_bh, d_bn, d_warps, d_stages = default_sizes(H, R)
    BH = block_h or d_bh
    n_hb = triton.cdiv(H, BH)
    # the launch is planned for the batch rounded up to a power of two: the compile-time sizes then take a few
    # values whatever the batch (a decode step's tokens come in any number), and a row's splits do not depend on
    # its batch
    Bp = triton.next_power_of_2(B)
    sms = num_sms(device)
    if splits is None and short_launch(Bp * n_hb, visible, min_per_split or MIN_PER_SPLIT, sms):
        if BH <= 16:
            d_bn, d_stages = SHORT_BLOCK_N, 2
        # about one program an SM, down to one tile a split: at a short context latency is all, at a long one the
        # partials (a split's [heads, R] in fp32) stay a small part of the latents read
        min_per_split = min_per_split or max(1, visible * Bp * n_hb // sms)  # (raised to one tile below)
    min_per_split = min_per_split or MIN_PER_SPLIT
    block_n = block_n or d_bn
    if block_n < 16 or block_n & (block_n - 1) or BH < 16 or BH & (BH - 1):
        raise ValueError(f"mla decode: block_n and block_h must be powers of two >= 16, got {block_n}, {block_h}")
    if table is not None:  # a tile within one block: block_n divides the page
        block_n = math.gcd(block_n, page)
        if (table.dim() != 2 or table.dtype != torch.int32 or table.stride(-1) != 1 or table.device != cache.device
                or block_n < 16):
            raise ValueError(f"mla decode: a block table must be int32 [rows, blocks] with a unit last stride on the "
                             f"cache's device, the page ({page}) a multiple of 16")
    BR, BP = max(16, triton.next_power_of_2(R)), max(16, triton.next_power_of_2(P))
    warps = num_warps or (d_warps if BH == d_bh else (4 if BH <= 16 else 8))
    stages = num_stages or d_stages
    use_pdl = pdl and pdl_available(device)
    kernel_kw = dict(R=R, P=P, BR=BR, BP=BP, BH=BH, BLOCK_N=block_n, TC=not INTERPRET, PAGED=table is not None,
                     PDL=use_pdl, launch_pdl=use_pdl, num_warps=warps, num_stages=stages)

    def kernel_args(op, ml, per_split):
        return (q_lat, q_pe, cache, positions, rows, positions if table is None else table, op, ml, scale * LOG2E,
                H, n_hb, per_split, capacity, page, 0 if table is None else table.stride(0), q_lat.stride(0),
                q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), cache.stride(0), cache.stride(1))

    ns = splits
    if ns is None:
        per_sm = programs_per_sm or resident_programs(
            _mla_split_kernel, lambda: kernel_args(*[torch.empty(16, dtype=torch.float32, device=device)] * 2, block_n),
            kernel_kw,
            (device.index, cache.dtype, q_lat.dtype, R, P, BH, block_n, warps, stages, table is not None, use_pdl),
            device)
        ns = plan_splits(Bp * n_hb, visible, per_sm * sms, max(min_per_split, block_n))
    per_split = triton.cdiv(triton.cdiv(visible, ns), block_n) * block_n
    ns = triton.cdiv(visible, per_split)
    op = torch.empty((B * n_hb, ns, BH, BR), dtype=torch.float32, device=device)
    ml = torch.empty((B * n_hb, ns, 2, BH), dtype=torch.float32, device=device)
    _mla_split_kernel[(B * n_hb, ns)](*kernel_args(op, ml, per_split), **kernel_kw)
    o = torch.empty((B, H, R), dtype=out_dtype or q_lat.dtype, device=device)
    # the merge: coordinate blocks small enough that one load holds every split's partials (<= 64 KB a program),
    # narrower when there are few (sequence, head) programs (batch 1) to spread the round trip over more SMs
    nsp = triton.next_power_of_2(ns)
    BD = min(BR, 128, max(16, merge_elems // nsp))
    while BD > 16 and Bp * H * (BR // BD) < sms // 2:
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
