"""Split-K decode attention (flash-decoding) on CUDA, for the dense and the TurboQuant KV caches.

One new query per sequence (position p, keys 0..p, or p-W+1..p with a sliding window W), its cache in batch row b
of the cache tensors or, with `rows` (a pool of cache rows), in row rows[b]. Program (sequence and KV head, split):
all G = Hq / Hkv query heads of the KV head at once (each K/V byte read once), over the split's positions in
blocks, with an online softmax; it writes its partial output and (max, sum) per head. A second kernel merges the
splits (a split that saw no key, max = -inf, weighs 0; no NaN: `visible` may bound the positions loosely, e.g. by
the capacity, as a captured graph does) and may apply the gated attention's output gate, o * sigmoid(gate).
Positions map to slots p, or p % capacity in a ring. On Hopper both launch with programmatic dependent launch
(`launch.pdl_start`): each one's launch and set-up overlap the end of the kernel before it.

TurboQuant (QUANT): keys and values of positions p - j >= RECENT come from the 4-bit codes (byte i of a vector
holds coordinates i and i + D/2, so the two halves of q and of the output meet the low and the high nibbles with
no shuffling; value codes sit four positions side by side, `reference.interleave`, as the P V product's int8
operand wants them; value = level[code] * scale, the scale applied to the scores and to the probabilities
rather than to every coordinate), the RECENT newest from the exact ring (slot j % RECENT); all in the rotated
domain: the caller rotates q (`turboquant.triton.decode_step_prep`), the merge kernel rotates the output back
(`unrotate`). The codes become integer levels in registers by byte permutes (`_lookup_ptx`): no table lookups in
memory. The products run on int8 tensor cores (`INT8_PRODUCTS`: q and the probabilities as int8 pairs 128 a + b,
exact int32 sums), on fp16 ones where the int8 shapes do not fit. On NVIDIA GPUs `decode_attention` hands the
TurboQuant split to the CUDA C kernel of `cuda.py` where it applies (same partials, same merge; it rotates each
split's output back itself); this Triton kernel remains the path under the interpreter and everywhere else.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from sluice.kernels.attention import cuda as tq_cuda
from sluice.kernels.launch import num_sms, pdl, pdl_start
from sluice.kernels.norm.triton import round_to
from sluice.kernels.turboquant import reference
from sluice.kernels.turboquant.triton import _hadamard_rows, _tables

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
INT8_PRODUCTS = 2  # TurboQuant products on int8 tensor cores: 0 none, 1 the scores, 2 also P V
MERGE_ELEMS = 16384  # partial-output values one merge program loads at once (64 KB of fp32)


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, kr_ptr, vr_ptr, lv_ptr, pos_ptr, rows_ptr, tab_ptr,
                         op_ptr, ml_ptr, cnt_ptr, scale, Hkv, cap, per_split, n_splits, stride_tab,
                         stride_qb, stride_qh, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
                         stride_sb, stride_sh,
                         stride_rb, stride_rh, stride_rt,
                         G: tl.constexpr, BG: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                         QUANT: tl.constexpr, RING: tl.constexpr, WINDOW: tl.constexpr, RECENT: tl.constexpr,
                         INT8: tl.constexpr, TC: tl.constexpr, ZERO_CNT: tl.constexpr, HAS_ROWS: tl.constexpr,
                         PAGED: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)  # q and the cache come from the kernels before
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // Hkv
    h = bh % Hkv
    if ZERO_CNT:  # the merge's counter of this KV head (unrotate), for the launch after this one
        if split == 0:
            tl.store(cnt_ptr + bh, 0)
    p = tl.load(pos_ptr + b)
    if HAS_ROWS:  # the cache tensors' batch row of query row b
        cache_row = tl.load(rows_ptr + b).to(tl.int64)
    else:
        cache_row = b.to(tl.int64)
    first = 0
    if WINDOW > 0:
        first = tl.maximum(p - WINDOW + 1, 0)
    start = first + split * per_split
    stop = tl.minimum(start + per_split, p + 1)
    g = tl.arange(0, BG)
    kv_base = cache_row * stride_kb + h * stride_kh
    v_base = cache_row * stride_vb + h * stride_vh
    q_row = q_ptr + b.to(tl.int64) * stride_qb + (h * G + g[:, None]) * stride_qh
    m = tl.full((BG,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BG,), dtype=tl.float32)
    part = bh * n_splits + split
    if QUANT:
        # coordinates in two halves: byte i of a row holds coordinate i (low nibble) and i + D/2 (high nibble).
        # Codes decode to integer levels (exact in fp16); q enters the fp16 products scaled to max |q| = 1 and the
        # probabilities scaled by each block's largest value scale, both factors restored in fp32.
        dh = tl.arange(0, D // 2)
        q_lo = tl.load(q_row + dh[None, :], mask=g[:, None] < G, other=0.0).to(tl.float32)
        q_hi = tl.load(q_row + D // 2 + dh[None, :], mask=g[:, None] < G, other=0.0).to(tl.float32)
        q_max = tl.maximum(tl.maximum(tl.max(tl.max(tl.abs(q_lo), 1), 0), tl.max(tl.max(tl.abs(q_hi), 1), 0)), 1e-30)
        q_lo = q_lo / q_max
        q_hi = q_hi / q_max
        # INT8 >= 1: the scores on int8 tensor cores, q as 128 a + b with int8 a, b (|q| <= Q_INT: 15 bits) and the
        # key levels int8 straight from the byte permutes, exact int32 sums; INT8 = 2: so are the probabilities
        # times the values. Else fp16 products.
        if INT8 >= 1:
            qa_lo, qb_lo = _int8_pair(q_lo)
            qa_hi, qb_hi = _int8_pair(q_hi)
        k_factor = scale * q_max * LEVEL_STEP / (Q_INT if INT8 >= 1 else 1)
        acc_lo = tl.zeros((BG, D // 2), dtype=tl.float32)
        acc_hi = tl.zeros((BG, D // 2), dtype=tl.float32)
        s_base = cache_row * stride_sb + h * stride_sh
        coded_stop = tl.minimum(stop, p - RECENT + 1)  # older positions: from the codes
        t4 = tl.arange(0, BLOCK_N // 4)
        # tiles from a multiple of 4 (the value groups); paged, of BLOCK_N, so that a tile never straddles two blocks
        n_lo = start - start % BLOCK_N if PAGED else start - start % 4
        for n0 in range(n_lo, coded_stop, BLOCK_N):
            j = n0 + tl.arange(0, BLOCK_N)
            valid = (j >= start) & (j < coded_stop)
            if PAGED:  # the block holding this tile's positions (cap % BLOCK_N == 0)
                blk = tl.load(tab_ptr + cache_row * stride_tab + n0 // cap).to(tl.int64)
                kv_base = blk * stride_kb + h * stride_kh
                v_base = blk * stride_vb + h * stride_vh
                s_base = blk * stride_sb + h * stride_sh
                slot = j % cap
            else:
                slot = j % cap if RING else j
            c_off = kv_base + slot[:, None] * stride_kt + dh[None, :]
            k_codes = tl.load(k_ptr + c_off, mask=valid[:, None], other=0)
            if INT8 >= 1:
                k_lo, k_hi = _int8_levels(k_codes, lv_ptr, TC)
                s = _int8_dot(qa_lo, qb_lo, tl.trans(k_lo)) + _int8_dot(qa_hi, qb_hi, tl.trans(k_hi))
            else:
                k_lo, k_hi = _int_levels(k_codes, lv_ptr, TC)
                s = _dot16(q_lo, tl.trans(k_lo), TC) + _dot16(q_hi, tl.trans(k_hi), TC)
            k_sc = tl.load(ks_ptr + s_base + slot, mask=valid, other=0.0)
            s = tl.where(valid[None, :], s * (k_sc * k_factor)[None, :], float("-inf"))
            pr, alpha, m, l = _online_softmax(s, m, l)
            v_sc = tl.load(vs_ptr + s_base + slot, mask=valid, other=0.0)
            v_max = tl.maximum(tl.max(v_sc, 0), 1e-30)
            pv = pr * (v_sc / v_max)[None, :]
            # the value codes [BLOCK_N / 4, D / 2, 4] (four positions of a byte column side by side, cap a multiple
            # of 4) as [BLOCK_N, D / 2]; whole groups (a group's positions outside the split have probability 0)
            if PAGED:
                g4 = n0 % cap // 4 + t4
            else:
                g4 = (n0 + 4 * t4) % cap // 4 if RING else n0 // 4 + t4
            g_ok = (n0 + 4 * t4 < coded_stop) & (n0 + 4 * t4 + 4 > start)
            v_codes = tl.load(v_ptr + v_base + g4[:, None] * stride_vt + tl.arange(0, 2 * D)[None, :],
                              mask=g_ok[:, None], other=0)  # a group's 2D bytes at once: 16-byte loads
            v_codes = tl.reshape(tl.permute(tl.reshape(v_codes, (BLOCK_N // 4, D // 2, 4)), (0, 2, 1)),
                                 (BLOCK_N, D // 2))
            if INT8 == 2:
                pa, pb = _int8_pair(pv)
                v_lo, v_hi = _int8_levels(v_codes, lv_ptr, TC)
                v_factor = v_max * (LEVEL_STEP / Q_INT)
                acc_lo = acc_lo * alpha[:, None] + _int8_dot(pa, pb, v_lo) * v_factor
                acc_hi = acc_hi * alpha[:, None] + _int8_dot(pa, pb, v_hi) * v_factor
            else:
                v_lo, v_hi = _int_levels(v_codes, lv_ptr, TC)
                acc_lo = acc_lo * alpha[:, None] + _dot16(pv, v_lo, TC) * (v_max * LEVEL_STEP)
                acc_hi = acc_hi * alpha[:, None] + _dot16(pv, v_hi, TC) * (v_max * LEVEL_STEP)
        r_base = cache_row * stride_rb + h * stride_rh
        # the newest: exact, from the ring (one block in one split: not worth pipeline buffers)
        for n0 in tl.range(tl.maximum(start, p - RECENT + 1), stop, BLOCK_N, num_stages=1):
            j = n0 + tl.arange(0, BLOCK_N)
            valid = j < stop
            r_off = r_base + (j % RECENT)[:, None] * stride_rt + dh[None, :]
            s = _dot(q_lo, tl.trans(tl.load(kr_ptr + r_off, mask=valid[:, None], other=0.0)), TC)
            s += _dot(q_hi, tl.trans(tl.load(kr_ptr + r_off + D // 2, mask=valid[:, None], other=0.0)), TC)
            s = tl.where(valid[None, :], s * (scale * q_max), float("-inf"))
            pr, alpha, m, l = _online_softmax(s, m, l)
            acc_lo = acc_lo * alpha[:, None] + _dot(pr, tl.load(vr_ptr + r_off, mask=valid[:, None], other=0.0), TC)
            acc_hi = acc_hi * alpha[:, None] + _dot(pr, tl.load(vr_ptr + r_off + D // 2, mask=valid[:, None],
                                                               other=0.0), TC)
        o_row = op_ptr + (part * BG + g[:, None]) * D
        tl.store(o_row + dh[None, :], acc_lo, mask=g[:, None] < G)
        tl.store(o_row + D // 2 + dh[None, :], acc_hi, mask=g[:, None] < G)
    else:
        d = tl.arange(0, D)
        q = tl.load(q_row + d[None, :], mask=g[:, None] < G, other=0.0)
        acc = tl.zeros((BG, D), dtype=tl.float32)
        for n0 in range(start, stop, BLOCK_N):
            j = n0 + tl.arange(0, BLOCK_N)
            valid = j < stop
            if PAGED:  # the block holding this tile's positions (a tile never straddles two: cap % BLOCK_N == 0)
                blk = tl.load(tab_ptr + cache_row * stride_tab + n0 // cap).to(tl.int64)
                kv_base = blk * stride_kb + h * stride_kh
                v_base = blk * stride_vb + h * stride_vh
                slot = j % cap
            else:
                slot = j % cap if RING else j
            off = kv_base + slot[:, None] * stride_kt + d[None, :]
            s = _dot(q, tl.trans(tl.load(k_ptr + off, mask=valid[:, None], other=0.0)), TC)
            s = tl.where(valid[None, :], s * scale, float("-inf"))
            pr, alpha, m, l = _online_softmax(s, m, l)
            v_off = v_base + slot[:, None] * stride_vt + d[None, :]
            acc = acc * alpha[:, None] + _dot(pr, tl.load(v_ptr + v_off, mask=valid[:, None], other=0.0), TC)
        tl.store(op_ptr + (part * BG + g[:, None]) * D + d[None, :], acc, mask=g[:, None] < G)
    tl.store(ml_ptr + (part * 2) * BG + g, m)
    tl.store(ml_ptr + (part * 2 + 1) * BG + g, l)


@triton.jit
def _online_softmax(s, m, l):
    """One block of scores [BG, BLOCK_N] into the running (max, sum): the block's probabilities, the factor that
    rescales what came before, and the new (max, sum)."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays at 0
    alpha = tl.exp(m - m_safe)
    pr = tl.exp(s - m_safe[:, None])
    return pr, alpha, m_new, l * alpha + tl.sum(pr, axis=1)


@triton.jit
def _dot(a, b, TC: tl.constexpr):
    """Tensor cores on bf16 operands (fp32 accumulation; the probabilities rounded to bf16 as FlashAttention
    does); fp32 under the interpreter, whose bf16 dot is wrong."""
    if TC:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _dot16(a, b, TC: tl.constexpr):
    """As _dot on fp16 operands: 11 significant bits for the scaled q and probabilities, integer levels exact."""
    if TC:
        return tl.dot(a.to(tl.float16), b.to(tl.float16))
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


def _lookup_ptx(src: str, table: list[int]) -> str:
    """PTX lines that look up the 8 nibbles of the 32-bit `src` in a 16-byte table: v0 gets the bytes of nibbles
    0-3, v1 those of nibbles 4-7 (in nibble order: low, high nibble of one byte, then the next byte's). A byte
    permute (prmt) picks bytes from an 8-byte table by 3-bit selectors: entries 0-7 and 8-15 are looked up
    separately and a third prmt keeps, per nibble, the one its bit 3 names. Registers q, qh, a, b, s."""
    t = [f"{int.from_bytes(bytes(table[4 * w:4 * w + 4]), 'little'):#010x}" for w in range(4)]
    return f"""and.b32 q, {src}, 0x77777777;
    shr.b32 qh, q, 16;
    prmt.b32 a, {t[0]}, {t[1]}, q;
    prmt.b32 b, {t[2]}, {t[3]}, q;
    shr.b32 s, {src}, 1;
    lop3.b32 s, s, 0x4444, 0x3210, 0xea;
    prmt.b32 v0, a, b, s;
    prmt.b32 a, {t[0]}, {t[1]}, qh;
    prmt.b32 b, {t[2]}, {t[3]}, qh;
    shr.b32 s, {src}, 17;
    lop3.b32 s, s, 0x4444, 0x3210, 0xea;
    prmt.b32 v1, a, b, s;"""


def _levels_asm() -> str:
    """PTX that decodes 4 code bytes (8 nibbles, $4) into the integer levels of the low and of the high nibbles,
    two fp16 pairs each ($0, $1 and $2, $3), by `_lookup_ptx`. Each level is stored as the byte level + 128;
    placed under the fp16 exponent byte 0x64 it reads 1024 + byte exactly, and subtracting 1152 leaves the
    level."""
    return f"""{{
    .reg .b32 q, qh, a, b, s, v0, v1, k64, off;
    mov.b32 k64, 0x64646464;
    mov.b32 off, 0x64806480;
    {_lookup_ptx("$4", [x + 128 for x in reference.int_levels()])}
    prmt.b32 $0, v0, k64, 0x4240;
    prmt.b32 $1, v1, k64, 0x4240;
    prmt.b32 $2, v0, k64, 0x4341;
    prmt.b32 $3, v1, k64, 0x4341;
    sub.f16x2 $0, $0, off;
    sub.f16x2 $1, $1, off;
    sub.f16x2 $2, $2, off;
    sub.f16x2 $3, $3, off;
    }}"""


def _int8_levels_asm() -> str:
    """PTX that decodes 4 code bytes ($2) into the int8 levels of the low nibbles ($0) and of the high nibbles
    ($1), byte i of each from code byte i: `_lookup_ptx` on the levels as two's complement bytes, then two
    permutes that gather the low-nibble and the high-nibble levels."""
    return f"""{{
    .reg .b32 q, qh, a, b, s, v0, v1;
    {_lookup_ptx("$2", [x & 0xFF for x in reference.int_levels()])}
    prmt.b32 $0, v0, v1, 0x6420;
    prmt.b32 $1, v0, v1, 0x7531;
    }}"""


LEVELS_ASM: tl.constexpr = tl.constexpr(_levels_asm())
INT8_LEVELS_ASM: tl.constexpr = tl.constexpr(_int8_levels_asm())
Q_INT: tl.constexpr = tl.constexpr(127 * 128)
LEVEL_STEP: tl.constexpr = tl.constexpr(reference.LEVEL_STEP)


@triton.jit
def _int_levels(codes, lv_ptr, TC: tl.constexpr):
    """uint8 codes [N, D/2] -> (levels of the low nibbles, of the high nibbles) [N, D/2] as fp16 integers: byte
    permutes on the GPU; under the interpreter (no inline assembly) a gather from the 16 levels at lv_ptr."""
    if TC:
        return tl.inline_asm_elementwise(LEVELS_ASM, "=r,=r,=r,=r,r", [codes], dtype=(tl.float16, tl.float16),
                                         is_pure=True, pack=4)
    levels = tl.load(lv_ptr + tl.arange(0, 16))
    c = codes.to(tl.int32)
    lo = tl.reshape(tl.gather(levels, tl.reshape(c & 15, (c.shape[0] * c.shape[1],)), 0), c.shape)
    hi = tl.reshape(tl.gather(levels, tl.reshape(c >> 4, (c.shape[0] * c.shape[1],)), 0), c.shape)
    return lo.to(tl.float16), hi.to(tl.float16)


@triton.jit
def _int8_levels(codes, lv_ptr, TC: tl.constexpr):
    """uint8 codes [N, D/2] -> (levels of the low nibbles, of the high nibbles) [N, D/2] int8."""
    if TC:
        return tl.inline_asm_elementwise(INT8_LEVELS_ASM, "=r,=r,r", [codes], dtype=(tl.int8, tl.int8),
                                         is_pure=True, pack=4)
    lo, hi = _int_levels(codes, lv_ptr, TC)
    return lo.to(tl.int8), hi.to(tl.int8)


@triton.jit
def _int8_dot(a, b, y):
    """(128 a + b) @ y as fp32, for int8 a, b, y: int32 tensor-core sums, exact."""
    return (tl.dot(a, y, out_dtype=tl.int32) * 128 + tl.dot(b, y, out_dtype=tl.int32)).to(tl.float32)


@triton.jit
def _int8_pair(x):
    """x in [-1, 1] -> int8 (a, b) with 128 a + b = round(Q_INT x) (a in -127..127, b in -64..64)."""
    xs = tl.floor(x * Q_INT + 0.5)
    a = tl.floor(xs / 128 + 0.5)
    return a.to(tl.int8), (xs - 128 * a).to(tl.int8)


@triton.jit
def _merge_splits_kernel(op_ptr, ml_ptr, o_ptr, sign_ptr, rot_ptr, cnt_ptr, gate_ptr, Hkv, n_splits, stride_ob,
                         stride_oh, stride_gb, stride_gh,
                         G: tl.constexpr, BG: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, NSP: tl.constexpr,
                         SB: tl.constexpr, UNROTATE: tl.constexpr, GATE: tl.constexpr, RNE_BF16: tl.constexpr,
                         PREC: tl.constexpr, PDL: tl.constexpr):
    """Program (query head, BD coordinates): the splits' weights exp(m_s - M) and the weighted partial outputs.
    A launch that is all latency, so every load is issued at once: all (max, sum) pairs and (SB >= splits, the
    usual case) all partial outputs in one round trip. UNROTATE (TurboQuant): the merged block goes to rot
    (fp32 [query heads, D]) and the program of the KV head's G query heads that finishes last (a counter per KV
    head, zeroed by the split kernel) reads their rows back and rotates them, R^T o = (o H) * signs / sqrt(D).
    (One program per query head doing both, as before, was several times slower: few programs, each reading
    every split's D partials, and a one-row rotation.) GATE: the output times sigmoid(gate) (`_gated`)."""
    pdl_start(PDL)
    row = tl.program_id(0)
    bh = row // G
    g = row % G
    b = bh // Hkv
    h = bh % Hkv
    sp = tl.arange(0, NSP)
    ml = ml_ptr + (bh * n_splits) * 2 * BG + g
    m = tl.load(ml + sp * 2 * BG, mask=sp < n_splits, other=float("-inf"))
    lsum = tl.load(ml + sp * 2 * BG + BG, mask=sp < n_splits, other=0.0)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    parts = op_ptr + ((bh * n_splits) * BG + g) * D + d[None, :]
    sb = tl.arange(0, SB)
    first = tl.load(parts + sb[:, None] * BG * D, mask=(sb < n_splits)[:, None], other=0.0)
    M = tl.max(m, axis=0)
    denom = tl.sum(_split_weight(m, M) * lsum, axis=0)
    ws = tl.load(ml + sb * 2 * BG, mask=sb < n_splits, other=float("-inf"))
    acc = tl.sum(_split_weight(ws, M)[:, None] * first, axis=0)
    for s0 in range(SB, n_splits, SB):  # more splits than one load holds
        s = s0 + sb
        ms = tl.load(ml + s * 2 * BG, mask=s < n_splits, other=float("-inf"))
        part = tl.load(parts + s[:, None] * BG * D, mask=(s < n_splits)[:, None], other=0.0)
        acc += tl.sum(_split_weight(ms, M)[:, None] * part, axis=0)
    acc = acc / denom
    if UNROTATE:
        # the rotation mixes all D coordinates: the program of this KV head's query heads that finishes last
        # rotates all of them at once ([BG, D]: tensor-core shapes; one row at a time was slow)
        tl.store(rot_ptr + row * D + d, acc)
        tl.debug_barrier()  # every thread's part stored before the release
        if tl.atomic_add(cnt_ptr + bh, 1, sem="acq_rel", scope="gpu") == G * (D // BD) - 1:
            gg = tl.arange(0, BG)
            dd = tl.arange(0, D)
            merged = tl.load(rot_ptr + (bh * G + gg[:, None]) * D + dd[None, :], mask=gg[:, None] < G, other=0.0,
                             cache_modifier=".cg")  # the other programs' parts, past L1
            # on tensor cores (tf32x3: fp32 accuracy to a few ulps); as FMAs it took microseconds
            y = _hadamard_rows(merged, D, PREC) * (tl.load(sign_ptr + dd) / tl.sqrt(D * 1.0))[None, :]
            heads = h * G + gg[:, None]
            if GATE:
                y = _gated(y, gate_ptr + b.to(tl.int64) * stride_gb + heads * stride_gh + dd[None, :],
                           gg[:, None] < G, o_ptr.dtype.element_ty, RNE_BF16)
            tl.store(o_ptr + b.to(tl.int64) * stride_ob + heads * stride_oh + dd[None, :],
                     y.to(o_ptr.dtype.element_ty), mask=gg[:, None] < G)
    else:
        if GATE:
            acc = _gated(acc, gate_ptr + b.to(tl.int64) * stride_gb + (h * G + g) * stride_gh + d, d < D,
                         o_ptr.dtype.element_ty, RNE_BF16)
        tl.store(o_ptr + b.to(tl.int64) * stride_ob + (h * G + g) * stride_oh + d, acc.to(o_ptr.dtype.element_ty))


@triton.jit
def _gated(o, gate_ptrs, mask, dt: tl.constexpr, RNE_BF16: tl.constexpr):
    """o * sigmoid(gate) as torch computes `o * torch.sigmoid(gate)` in dtype dt: o, the sigmoid and the product
    each rounded to dt."""
    s = round_to(tl.sigmoid(tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)), dt, RNE_BF16)
    return round_to(round_to(o, dt, RNE_BF16) * s, dt, RNE_BF16)


@triton.jit
def _split_weight(m, M):
    """exp(m - M) for the splits' maxima m; a split that saw no key (m = -inf) weighs nothing."""
    return tl.where(m == float("-inf"), 0.0, tl.exp(m - M))


_LEVEL_TABLES: dict = {}


def _level_table(device) -> torch.Tensor:
    """The 16 integer levels as fp32 on `device` (read by the interpreter path only; made once)."""
    if device not in _LEVEL_TABLES:
        _LEVEL_TABLES[device] = torch.tensor(reference.int_levels(), dtype=torch.float32, device=device)
    return _LEVEL_TABLES[device]


def num_splits(batch_heads: int, visible: int, device, block_n: int = 64, min_per_split: int | None = None,
               per_sm: int = 2, one_wave: bool = False) -> int:
    """Enough splits for about `per_sm` programs per multiprocessor, each with >= `min_per_split` positions
    (default two blocks: at 4k positions and batch 1 many short splits beat a few long ones, the multiprocessors
    busy; benchmarks/results/attention_gpu_sweep_h100.json). `one_wave`: at most that many, never a few more (for a
    kernel that holds `per_sm` programs per SM, splits that spill into a second wave cost a whole wave more;
    benchmarks/results/attention_tq_sweep_h100.json)."""
    min_per_split = min_per_split or 2 * block_n
    sms = num_sms(device)
    want = per_sm * sms // batch_heads if one_wave else triton.cdiv(per_sm * sms, batch_heads)
    return max(1, min(want, triton.cdiv(visible, min_per_split)))


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float,
                     visible: int, window: int | None = None, splits: int | None = None, block_n: int | None = None,
                     k_scale=None, v_scale=None, k_recent=None, v_recent=None, out_dtype=None,
                     unrotate: bool = False, num_warps: int = 4, num_stages: int | None = None,
                     rows: torch.Tensor | None = None, gate: torch.Tensor | None = None,
                     int8_products: int = INT8_PRODUCTS, merge_elems: int = MERGE_ELEMS,
                     cuda_kernel: bool = True, table: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, D] (one query per sequence, at positions[b], int32 or int64 [B] on the device: it sees the keys
    at positions <= positions[b]); dense k, v [P, Hkv, capacity, D], or with k_scale etc. the TurboQuant layout: k
    codes [P, Hkv, capacity, D/2] uint8, v codes [P, Hkv, capacity/4, D/2, 4] (`turboquant.reference.interleave`),
    k_scale, v_scale [P, Hkv, capacity] fp32, k_recent, v_recent [P, Hkv, RECENT, D] exact (rotated; the codec's
    levels are built in). The cache tensors are a pool of P rows: query b reads row rows[b] (int32 or int64 [B] on
    the device, each < P, not checked: nothing is read on the host), or row b without `rows` (P >= B). A ring
    (slot = position % capacity) when window is set. `visible`: a bound on the keys any query sees (a host int:
    sizes the splits without a sync; a loose one, e.g. the capacity, is correct, the splits past a query's keys
    weigh 0). Returns [B, Hq, D] in out_dtype (default q's); with `unrotate` (TurboQuant) rotated back out of the
    codec's domain by the merge kernel; with `gate` ([B, Hq, D] in out_dtype, unit last stride) o * sigmoid(gate)
    as torch rounds it (the gated attention's output gate, applied by the merge kernel). int8_products (TurboQuant,
    the Triton split kernel), merge_elems (the merge's load size) and cuda_kernel (TurboQuant: the CUDA C split
    kernel where it applies, else the Triton one) default to what the H100 sweeps chose; tests and benchmarks pass
    others.

    Paged (`table`, int32 [rows, max blocks] on the device, `cache/blocks.py`): the cache tensors are blocks
    [N, Hkv, page, D] of `page` positions each (the capacity dim is the page; TurboQuant: the codes and scales
    [N, Hkv, page, D/2], [N, Hkv, page/4, D/2, 4], [N, Hkv, page], the exact ring still one per row,
    [rows, Hkv, RECENT, D]), and query b's position j sits in block table[rows[b] (or b), j // page] at slot
    j % page. No window."""
    B, Hq, D = q.shape
    P, Hkv, cap = k.shape[:3]
    quant = k_scale is not None
    G = Hq // Hkv
    if Hq % Hkv or D & (D - 1) or D < 16 or D > 256:
        raise ValueError(f"decode attention: Hq={Hq} must be a multiple of Hkv={Hkv}, D={D} a power of two in 16..256")
    for name, index in (("positions", positions), ("rows", rows)):
        if index is not None and (index.shape != (B,) or index.dtype not in (torch.int32, torch.int64)
                                  or not index.is_contiguous()):
            raise ValueError(f"decode attention: {name} must be contiguous int32 or int64 [B={B}], got "
                             f"{index.dtype} {tuple(index.shape)}")
    if rows is None and (P if table is None else table.shape[0]) < B:
        raise ValueError(f"decode attention: {B} queries, {P} cache rows and no `rows`")
    if quant:
        if (k.dtype != torch.uint8 or k.shape[-1] != D // 2 or k.stride(-1) != 1 or k_recent is None or D < 32
                or cap % 4 or v.dtype != torch.uint8 or tuple(v.shape) != (P, Hkv, cap // 4, D // 2, 4)
                or v.stride(-1) != 1 or v.stride(-2) != 4):
            raise ValueError("decode attention: TurboQuant needs uint8 key codes [P, Hkv, cap, D/2] and value codes "
                             "[P, Hkv, cap/4, D/2, 4] (cap a multiple of 4) with D >= 32, scales and the recent ring")
        if k_scale.stride() != v_scale.stride() or k_recent.stride() != v_recent.stride():
            raise ValueError("decode attention: K and V tensors must share their layout")
    elif k.shape[-1] != D or k.stride() != v.stride() or k.stride(-1) != 1:
        raise ValueError(f"decode attention: k, v must be [B, Hkv, cap, {D}] with one layout and unit last strides, "
                         f"got {tuple(k.shape)}")
    if table is not None and (window is not None or table.dim() != 2 or table.dtype != torch.int32
                              or table.stride(-1) != 1):
        raise ValueError("decode attention: a block table (int32 [rows, blocks], unit last stride) is for a cache "
                         "without a window")
    if unrotate and not quant:
        raise ValueError("decode attention: unrotate is for the TurboQuant layout")
    if q.stride(-1) != 1:
        raise ValueError("decode attention: q needs a unit last stride")
    if gate is not None and (gate.shape != (B, Hq, D) or gate.dtype != (out_dtype or q.dtype) or gate.stride(-1) != 1):
        raise ValueError(f"decode attention: gate must be [{B}, {Hq}, {D}] in the output dtype with a unit last "
                         f"stride, got {gate.dtype} {tuple(gate.shape)}")
    # positions per step (the H100 sweeps of benchmarks/attention_gpu.py): K and V tiles of D = 256 rows fill
    # shared memory; the codes are a quarter of the bytes, 128 positions a step unless splits are short (where two
    # blocks of 64 keep more programs busy; benchmarks/results/attention_tq_sweep2_h100.json)
    use_cuda = quant and cuda_kernel and not INTERPRET and tq_cuda.applies(q, k, v, k_scale, v_scale, k_recent,
                                                                           v_recent, positions, rows, table)
    # the launch is planned for the batch rounded up to a power of two: the kernels' compile-time sizes then take
    # a few values whatever the batch (an engine step's decode tokens come in any number; each new size would
    # compile new kernels in the middle of serving)
    Bp = triton.next_power_of_2(B)
    if use_cuda:  # the CUDA C split kernel (cuda.py): same partials, same merge
        n_coded, per_split, ns = tq_cuda.plan(Bp * Hkv, visible, k_recent.shape[2], D, G, k_recent.dtype,
                                              positions.dtype, None if rows is None else rows.dtype, q.device,
                                              splits, paged=table is not None)
    elif quant:
        # one wave of the programs an SM holds (registers: 2 at D = 256, 3 at D = 128)
        ns = splits or num_splits(Bp * Hkv, visible, q.device, block_n or 64, per_sm=3 if D <= 128 else 2,
                                  one_wave=True)
        if block_n is None:
            block_n = 128 if triton.cdiv(visible, ns) >= (256 if D <= 128 else 2048) else 64
            if table is not None:  # tiles within a block
                block_n = math.gcd(block_n, cap)
        if table is not None and (cap % block_n or block_n < 16):
            raise ValueError(f"decode attention: the page ({cap} positions) must be a multiple of {block_n} and 16")
        # long splits stream: a third block in flight hides the loads (short ones lose;
        # benchmarks/results/attention_tq_sweep3_h100.json)
        num_stages = num_stages or (3 if triton.cdiv(visible, ns) >= 2048 else 2)
    else:
        block_n = block_n or (64 if D <= 128 else 32)
        if table is not None:  # a tile within one block: the tile divides the page
            block_n = math.gcd(block_n, cap)
            if block_n < 16:
                raise ValueError(f"decode attention: the page ({cap} positions) must be a multiple of 16")
        ns = splits or num_splits(Bp * Hkv, visible, q.device, block_n)
        num_stages = num_stages or 2
    # int8 tensor cores take 32 values along the summed dim: the scores need D / 2 >= 32, P V block_n >= 32
    if not use_cuda:
        int8 = 0 if not quant or D < 64 else min(int8_products, 2 if block_n >= 32 else 1)
        per_split = triton.cdiv(visible, ns)
        per_split = triton.cdiv(per_split, block_n) * block_n
        ns = triton.cdiv(visible, per_split)
    BG = max(16, triton.next_power_of_2(G))
    op = torch.empty((B * Hkv, ns, BG, D), dtype=torch.float32, device=q.device)
    ml = torch.empty((B * Hkv, ns, 2, BG), dtype=torch.float32, device=q.device)
    dummy = op
    rot = cnt = dummy
    if unrotate and not use_cuda:  # the merged rotated rows and a counter per KV head (zeroed by the split kernel)
        rot = torch.empty((B * Hq, D), dtype=torch.float32, device=q.device)
        cnt = torch.empty((B * Hkv,), dtype=torch.int32, device=q.device)
    ks, vs = (k_scale, v_scale) if quant else (dummy, dummy)
    kr, vr = (k_recent, v_recent) if quant else (dummy, dummy)
    recent = k_recent.shape[2] if quant else 1
    use_pdl = pdl(q.device)
    if use_cuda:
        tq_cuda.decode_split(q, k, v, k_scale, v_scale, k_recent, v_recent, positions, rows, scale, window, op, ml,
                             unrotate, n_coded, per_split, ns, table)
        unrotate = False  # done per split
    else:
        _decode_split_kernel[(B * Hkv, ns)](
            q, k, v, ks, vs, kr, vr, _level_table(q.device) if quant else dummy, positions,
            positions if rows is None else rows, positions if table is None else table, op, ml, cnt, scale, Hkv,
            cap, per_split, ns, 0 if table is None else table.stride(0),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
            ks.stride(0) if quant else 0, ks.stride(1) if quant else 0,
            kr.stride(0) if quant else 0, kr.stride(1) if quant else 0, kr.stride(2) if quant else 0,
            G=G, BG=BG, D=D, BLOCK_N=block_n, QUANT=quant, RING=window is not None, WINDOW=window or 0,
            RECENT=recent, INT8=int8, TC=not INTERPRET, ZERO_CNT=unrotate, HAS_ROWS=rows is not None,
            PAGED=table is not None, PDL=use_pdl,
            launch_pdl=use_pdl, num_warps=num_warps, num_stages=num_stages)
    o = torch.empty((B, Hq, D), dtype=out_dtype or q.dtype, device=q.device)
    # the merge: coordinate blocks small enough that one load holds every split's partials (<= 64 KB a program);
    # with unrotate the blocks of a KV head's query heads meet through `rot` and the KV head's counter
    nsp = triton.next_power_of_2(ns)
    BD = min(D, 64, max(16, merge_elems // nsp))
    while BD > 16 and Bp * Hq * (D // BD) < num_sms(q.device) // 2:  # few heads (batch 1): narrower blocks
        BD //= 2
    sb = min(nsp, max(1, merge_elems // BD))
    signs = _tables(D, q.device)[0] if unrotate else dummy
    # a warp per 2048 values loaded at once: the merge is one round trip, and fewer warps start sooner (measured
    # on the merge alone at 32k, batch 1, both head dims);
    # with unrotate the last program also rotates G rows of D on tensor cores, which wants 4-8 warps
    warps = (8 if sb * BD >= 8192 else 4) if unrotate else max(1, min(8, sb * BD // 2048))
    g = o if gate is None else gate
    _merge_splits_kernel[(B * Hq, D // BD)](op, ml, o, signs, rot, cnt, g, Hkv, ns, o.stride(0), o.stride(1),
                                            g.stride(0), g.stride(1), G=G, BG=BG, D=D, BD=BD, NSP=nsp, SB=sb,
                                            UNROTATE=unrotate, GATE=gate is not None, RNE_BF16=INTERPRET,
                                            PREC="ieee" if INTERPRET else "tf32x3", PDL=use_pdl,
                                            launch_pdl=use_pdl, num_warps=warps)
    return o
