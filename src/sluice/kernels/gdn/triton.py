"""Triton kernels of the gated delta rule (Gated DeltaNet), checked against `reference.py`.

`fused_recurrent_gated_delta_rule` (decode, and a few tokens): one program per (sequence, value head, block of BV
value columns) holds its [K, BV] slice of the fp32 state in registers and walks the tokens:

    g = -exp(A_log) * softplus(a + dt_bias),  beta = sigmoid(b)     (the gates, from the raw projections)
    q, k = l2norm(q), l2norm(k);  q *= scale
    S *= exp(g);  v' = beta * (v - S^T k);  S += k v'^T;  o = S^T q

The state lives in the cache ([slots, Hv, K, V], fp32) and is updated in place; sequence i uses slot
state_indices[i] (a negative index skips the sequence: a padded batch entry). Value head h reads key head
h // (Hv / Hk) straight from q and k: nothing is repeated in memory. Every program recomputes the l2 norms of its
q and k rows (K elements: cheaper than a launch), so a decode step is one launch whatever the batch. Given the
layer's z and norm weight it also applies the gated RMSNorm that follows (`gated_rms_norm`'s math on the stored
o; its bits but for the order a GPU sums a row's squares in): in registers when one program holds a whole head,
else by the head's last program to finish (a per-(sequence, head) counter, acq_rel, reset to zero by that program).

`chunk_gated_delta_rule` (prefill): the chunk-parallel WY form of `reference.chunk_gated_delta_rule`, chunks of
C = 64 tokens, in two launches and without a host synchronisation:
1. `_chunk_prep_kernel`, program (chunk, value head), everything that does not depend on the state: the gates,
   G = the in-chunk cumsum of g, 1/|k|, A = beta_i (kn_i . kn_j) exp(G_i - G_j) by one dot, (I + A)^-1
   (the four 16x16 diagonal blocks by forward substitution all at once, the blocks below by block products,
   through scratch memory), w = (I + A)^-1 (beta exp(G) kn), u = (I + A)^-1 (beta v), the intra-chunk
   attention P = scale tril((qn kn^T) exp(G_i - G_j)), and qs = scale qn (once per key head, stored beside w);
2. `_chunk_scan_kernel`, program (value block, value head, sequence), launched with PDL: walks the sequence's
   chunks with its slice of the state in fp32 registers: [w; qs] S in one product (three tensor-core products
   per chunk step: the step is a chain of them), v_new = u - w S, o = exp(G) (qs S) + P v_new,
   S = exp(G_last) S + (kn exp(G_last - G))^T v_new. Neither v_new nor the per-chunk states reach memory (FLA
   writes both and reads them back in a third pass).
q and k are read raw (bf16) and their norms applied as factors, so q k^T and k k^T are exact bf16 products; w, qs,
u and P are stored in bf16 and the dots take bf16 operands (fp32 accumulation), as FLA's. Exponents are always
differences of cumsums that are <= 0 where used; rows past a sequence's end have g = 0 and are masked to zero
before any product (so exp of garbage can never make 0 * inf). Several sequences packed in one call (cu_seqlens)
never share a chunk.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# the rest of a GDN layer's kernels, so that the layer finds them all here
from sluice.kernels.conv1d.triton import causal_conv1d, causal_conv1d_update  # noqa: F401
from sluice.kernels.launch import capability, pdl, pdl_start
from sluice.kernels.norm.triton import (  # noqa: F401
    gated_rms_norm,
    gated_rms_norm_rows,
    weight_product_dtype,
)
from sluice.kernels.qmatmul import triton as qmm


def projection_conv(x: torch.Tensor, qt, conv_weight: torch.Tensor, conv_state: torch.Tensor,
                    rows: torch.Tensor) -> torch.Tensor | None:
    """A decode step's in-projection [B, N] with the conv (and its state update) in the same launch
    (`qmm.qgemv_conv`), for x [B, K] and the in-projection's QuantizedTensor qt; None when that launch does not fit
    (more rows than its GEMV takes, unsupported bits): the caller projects and convolves apart."""
    if (x.shape[0] > qmm.GEMV_MAX_ROWS or qt.weight.dim() != 2 or qt.bits not in qmm.SUPPORTED_BITS
            or qt.group_size not in qmm.SUPPORTED_GROUPS or conv_state.dtype != x.dtype):
        return None
    return qmm.qgemv_conv(x, qt, conv_weight, conv_state, rows)

MAX_HEAD_DIM = 256
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # its bf16 tl.dot is wrong (Triton 3.9): fp32 operands there


@triton.jit
def _softplus(x):
    """torch.nn.functional.softplus (beta 1, threshold 20)."""
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _recurrent_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, s_ptr, idx_ptr, o_ptr,
                      z_ptr, nw_ptr, cnt_ptr, T, scale, eps,
                      stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                      stride_vb, stride_vt, stride_vh, stride_ab, stride_at, stride_bb, stride_bt,
                      stride_ss, stride_sh, stride_ob, stride_ot, stride_oh, stride_zb, stride_zt, stride_zh,
                      RATIO: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      RAW_GATES: tl.constexpr, L2NORM: tl.constexpr, HAS_IDX: tl.constexpr,
                      GATED_NORM: tl.constexpr, BLOCK_V: tl.constexpr, H_DTYPE: tl.constexpr,
                      RNE_BF16: tl.constexpr, PDL: tl.constexpr):
    """Program (value block, value head, sequence). RAW_GATES: a, b are the raw projections and the gates are
    computed here; otherwise a is g (log decay) and b is beta. GATED_NORM: o is replaced by the gated RMSNorm
    (w * rmsnorm(o)) * silu(z) of each (token, head) row, with the math of `norm.triton.gated_rms_norm_rows` on o
    as rounded to its dtype (as the recurrent kernel followed by `gated_rms_norm`): one program per head
    (BV >= V) in registers; otherwise each program stores its raw columns, counts itself done on the (sequence,
    head) counter (acq_rel), and the last of the head's programs reads the rows back, normalises them in place
    and resets the counter to 0 for the next launch. BLOCK_V: V to a power of two."""
    pdl_start(PDL)
    pid_v = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.program_id(2)
    slot = n
    if HAS_IDX:
        slot = tl.load(idx_ptr + n)
    if slot >= 0:
        offs_k = tl.arange(0, BK)
        offs_v = pid_v * BV + tl.arange(0, BV)
        k_ok, v_ok = offs_k < K, offs_v < V
        kh = h // RATIO
        s_tile = (s_ptr + slot.to(tl.int64) * stride_ss + h * stride_sh + offs_k[:, None] * V + offs_v[None, :])
        s_mask = k_ok[:, None] & v_ok[None, :]
        S = tl.load(s_tile, mask=s_mask, other=0.0)
        if RAW_GATES:
            neg_a = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
            dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
        q_row = q_ptr + n.to(tl.int64) * stride_qb + kh * stride_qh
        k_row = k_ptr + n.to(tl.int64) * stride_kb + kh * stride_kh
        v_row = v_ptr + n.to(tl.int64) * stride_vb + h * stride_vh
        o_row = o_ptr + n.to(tl.int64) * stride_ob + h * stride_oh
        z_row = z_ptr + n.to(tl.int64) * stride_zb + h * stride_zh
        a_row = a_ptr + n.to(tl.int64) * stride_ab + h
        b_row = b_ptr + n.to(tl.int64) * stride_bb + h
        if GATED_NORM and BV >= V:
            nw = tl.load(nw_ptr + offs_v, mask=v_ok, other=0.0).to(tl.float32)
        for t in range(T):
            q = tl.load(q_row + t * stride_qt + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            k = tl.load(k_row + t * stride_kt + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            v = tl.load(v_row + t * stride_vt + offs_v, mask=v_ok, other=0.0).to(tl.float32)
            a = tl.load(a_row + t * stride_at).to(tl.float32)
            b = tl.load(b_row + t * stride_bt).to(tl.float32)
            if RAW_GATES:
                g = neg_a * _softplus(a + dt_bias)
                beta = tl.sigmoid(b)
            else:
                g = a
                beta = b
            if L2NORM:
                q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
                k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
            q = q * scale
            S = S * tl.exp(g)
            delta = (v - tl.sum(S * k[:, None], axis=0)) * beta
            S = S + k[:, None] * delta[None, :]
            o = tl.sum(S * q[:, None], axis=0)
            if GATED_NORM and BV >= V:  # the whole row here: o as stored and read back, normalised at once
                x = o.to(o_ptr.dtype.element_ty).to(tl.float32)
                z = tl.load(z_row + t * stride_zt + offs_v, mask=v_ok, other=0.0).to(tl.float32)
                y = gated_rms_norm_rows(x[None, :], z[None, :], nw, V, eps, o_ptr.dtype.element_ty, H_DTYPE,
                                        RNE_BF16)
                tl.store(o_row + t * stride_ot + offs_v[None, :], y.to(o_ptr.dtype.element_ty), mask=v_ok[None, :])
            else:
                tl.store(o_row + t * stride_ot + offs_v, o.to(o_ptr.dtype.element_ty), mask=v_ok)
        tl.store(s_tile, S, mask=s_mask)
        if GATED_NORM and BV < V:  # the head's last program to finish normalises its rows
            tl.debug_barrier()  # every thread's columns stored before the release
            cnt = cnt_ptr + n * tl.num_programs(1) + h
            if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
                cols = tl.arange(0, BLOCK_V)
                ok = cols < V
                nw = tl.load(nw_ptr + cols, mask=ok, other=0.0).to(tl.float32)
                for t in range(T):
                    x = tl.load(o_row + t * stride_ot + cols, mask=ok, other=0.0,
                                cache_modifier=".cg").to(tl.float32)  # the other programs' columns, past L1
                    z = tl.load(z_row + t * stride_zt + cols, mask=ok, other=0.0).to(tl.float32)
                    y = gated_rms_norm_rows(x[None, :], z[None, :], nw, V, eps, o_ptr.dtype.element_ty, H_DTYPE,
                                            RNE_BF16)
                    tl.store(o_row + t * stride_ot + cols[None, :], y.to(o_ptr.dtype.element_ty), mask=ok[None, :])
                tl.store(cnt, 0)  # zero again for the next launch (a graph replays the same counters)


# ---------------------------------------------------------------------------------------------------- prefill

CHUNK = 64  # tokens per chunk; four 16-row blocks in the solve


@triton.jit
def _gates(a_ptr, b_ptr, alog_ptr, dtb_ptr, h, rows, ok, stride_at, stride_bt, RAW_GATES: tl.constexpr):
    """(g, beta) of `rows` for value head h, zero on rows past the end (they then change nothing)."""
    a = tl.load(a_ptr + rows * stride_at + h, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + rows * stride_bt + h, mask=ok, other=0.0).to(tl.float32)
    if RAW_GATES:
        g = -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * _softplus(a + tl.load(dtb_ptr + h).to(tl.float32))
        beta = tl.sigmoid(b)
    else:
        g = a
        beta = b
    return tl.where(ok, g, 0.0), tl.where(ok, beta, 0.0)


@triton.jit
def _load_rows(ptr, rows, ok, head, stride_t, stride_h, offs, offs_ok):
    """[rows, offs] of one head in the stored dtype, zero past the end. `ptr` already points at the chunk's first
    token and `rows` are int32 offsets from it (64-bit offsets per element cost registers)."""
    return tl.load(ptr + rows[:, None] * stride_t + head * stride_h + offs[None, :],
                   mask=ok[:, None] & offs_ok[None, :], other=0.0)


@triton.jit
def _store_rows(ptr, rows, ok, head, stride_t, stride_h, offs, offs_ok, x):
    tl.store(ptr + rows[:, None] * stride_t + head * stride_h + offs[None, :],
             x.to(ptr.dtype.element_ty), mask=ok[:, None] & offs_ok[None, :])


@triton.jit
def _rnorm(x, L2NORM: tl.constexpr):
    """1 / ||row|| of a [rows, K] tile (eps 1e-6 on the sum of squares, as HF and FLA); 1 without L2NORM."""
    if L2NORM:
        xf = x.to(tl.float32)
        return tl.rsqrt(tl.sum(xf * xf, axis=1) + 1e-6)
    return tl.full((x.shape[0],), 1.0, dtype=tl.float32)


@triton.jit
def _dot(a, b, PREC: tl.constexpr, BF16: tl.constexpr):
    """a @ b with fp32 accumulation. BF16: bf16 operands (exact for operands that are bf16 already: the raw q, k
    and the stored w, u); otherwise fp32 operands at PREC (the interpreter's bf16 dot is wrong)."""
    if BF16:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)


@triton.jit
def _chunk_bounds(c, cu_ptr, first_ptr, N, T, NC, C: tl.constexpr, VARLEN: tl.constexpr, NP2: tl.constexpr):
    """(first token, rows) of chunk c. VARLEN: sequence i spans cu[i]..cu[i+1] and owns the chunks from first[i]
    on (found by counting the first[1..N] <= c); the grid may hold more programs than chunks (rows <= 0 then).
    Otherwise the B sequences are T tokens each, NC chunks per sequence."""
    if VARLEN:
        i = tl.arange(0, NP2)
        seq = tl.sum((tl.load(first_ptr + 1 + i, mask=i < N, other=2 ** 30) <= c).to(tl.int32), axis=0)
        valid = seq < N
        start = tl.load(cu_ptr + seq, mask=valid, other=0) + (c - tl.load(first_ptr + seq, mask=valid, other=0)) * C
        end = tl.load(cu_ptr + seq + 1, mask=valid, other=0)
        return start, tl.minimum(end - start, C)
    seq = c // NC
    start = seq * T + (c % NC) * C
    return start, tl.minimum(T - (c % NC) * C, C)


@triton.jit
def _prefetch_l1(ptrs):
    """Ask L1 for the lines at `ptrs` without waiting."""
    tl.inline_asm_elementwise("prefetch.global.L1 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def _discard_l2(ptrs):
    """Drop the 128-byte L2 lines at `ptrs` without writing them back (their contents become undefined)."""
    tl.inline_asm_elementwise("discard.global.L2 [$1], 128; // $0", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _block(scr, bi: tl.constexpr, bj: tl.constexpr):
    """The [16, 16] block (bi, bj) of a [64, 64] fp32 matrix in scratch memory."""
    r = tl.arange(0, 16)
    return tl.load(scr + (16 * bi + r[:, None]) * 64 + 16 * bj + r[None, :])


@triton.jit
def _put_block(scr, bi: tl.constexpr, bj: tl.constexpr, x):
    r = tl.arange(0, 16)
    tl.store(scr + (16 * bi + r[:, None]) * 64 + 16 * bj + r[None, :], x)


@triton.jit
def _chunk_prep_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, cu_ptr, first_ptr,
                       G_ptr, rk_ptr, wq_ptr, u_ptr, p_ptr, scr_ptr, N, T, NC, scale,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt,
                       stride_Gt, stride_rt, stride_wt, stride_wh, stride_ut, stride_uh, stride_pt, stride_ph,
                       HV: tl.constexpr, RATIO: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                       BV: tl.constexpr, VARLEN: tl.constexpr, NP2: tl.constexpr, RAW_GATES: tl.constexpr,
                       L2NORM: tl.constexpr, PREC: tl.constexpr, BF16: tl.constexpr, PDL: tl.constexpr,
                       ASM: tl.constexpr):
    """Program (chunk, value head) on one axis, the heads of a chunk next to each other (they share q and k):
    everything of a chunk that does not depend on the state, with kn = k / |k|, qn = q / |q| (raw q, k are read;
    their norms enter as factors, so the bf16 products are exact):
        G = the in-chunk cumsum of the gates g,  A[i, j] = beta_i (kn_i . kn_j) exp(G_i - G_j)  (i > j)
        w = (I + A)^-1 (beta exp(G) kn),  u = (I + A)^-1 (beta v)           (the WY vectors)
        P = scale tril_incl((qn kn^T) exp(G_i - G_j))                       (the intra-chunk attention)
        qs = scale qn                                                        (what meets the state)
    Per token and key head, the w of its RATIO value heads and qs lie side by side ([token, key head, RATIO + 1,
    K]; qs stored by the first value head): the scan multiplies its w and qs by the state in one product.
    (I + A)^-1 goes through scratch memory: A there (one dot for all of it), the four 16x16 diagonal blocks
    inverted at once by forward substitution (a row read back per step), the blocks below from
    X_ij = -X_ii sum_{j<=m<i} A_im X_mj, then read back whole for the w and u products. The first value head of
    each key head stores 1/|k| for the scan. ASM (on a GPU; faster on the H100 at long prompts): v is prefetched
    into L1 at the start (it is needed only after the solve) and the dead
    scratch lines are dropped from L2 at the end instead of being written back to memory."""
    c = tl.program_id(0) // HV
    h = tl.program_id(0) % HV
    kh = h // RATIO
    start, n = _chunk_bounds(c, cu_ptr, first_ptr, N, T, NC, 64, VARLEN, NP2)
    if n > 0:
        t0 = start.to(tl.int64)
        q_ptr += t0 * stride_qt
        k_ptr += t0 * stride_kt
        v_ptr += t0 * stride_vt
        a_ptr += t0 * stride_at
        b_ptr += t0 * stride_bt
        G_ptr += t0 * stride_Gt
        rk_ptr += t0 * stride_rt
        wq_ptr += t0 * stride_wt
        u_ptr += t0 * stride_ut
        p_ptr += t0 * stride_pt
        scr = scr_ptr + tl.program_id(0).to(tl.int64) * 4096
        rows = tl.arange(0, 64)
        ok = rows < n
        if ASM:  # v is needed only after the solve: ask L1 for it now
            LINE: tl.constexpr = 128 // v_ptr.dtype.element_ty.primitive_bitwidth * 8
            lines = tl.arange(0, (BV + LINE - 1) // LINE) * LINE
            _prefetch_l1(v_ptr + tl.minimum(rows, n - 1)[:, None] * stride_vt + h * stride_vh + lines[None, :])
        offs_k = tl.arange(0, BK)
        k_ok = offs_k < K
        k = _load_rows(k_ptr, rows, ok, kh, stride_kt, stride_kh, offs_k, k_ok)
        q = _load_rows(q_ptr, rows, ok, kh, stride_qt, stride_qh, offs_k, k_ok)
        rk, rq = _rnorm(k, L2NORM), _rnorm(q, L2NORM)
        if L2NORM and h % RATIO == 0:
            tl.store(rk_ptr + rows * stride_rt + kh, rk, mask=ok)
        g, beta = _gates(a_ptr, b_ptr, alog_ptr, dtb_ptr, h, rows, ok, stride_at, stride_bt, RAW_GATES)
        G = tl.cumsum(g, axis=0)  # rows past the end have g = 0: their G is the last row's, every exp below <= 1
        tl.store(G_ptr + rows * stride_Gt + h, G, mask=ok)
        diff = G[:, None] - G[None, :]
        # qs and P first, so that q is dead before A and the solve (registers)
        if h % RATIO == 0:
            _store_rows(wq_ptr + RATIO * K, rows, ok, kh, stride_wt, stride_wh, offs_k, k_ok,
                        q.to(tl.float32) * (rq * scale)[:, None])
        qk = _dot(q, tl.trans(k), "ieee", BF16)
        decay = tl.exp(tl.where(rows[:, None] >= rows[None, :], diff, -float("inf")))
        _store_rows(p_ptr, rows, ok, h, stride_pt, stride_ph, rows, rows < 64,
                    (rq * scale)[:, None] * qk * rk[None, :] * decay)
        kk = _dot(k, tl.trans(k), "ieee", BF16)
        A = (beta * rk)[:, None] * kk * rk[None, :] * tl.exp(tl.where(rows[:, None] > rows[None, :], diff,
                                                                      -float("inf")))
        tl.store(scr + rows[:, None] * 64 + rows[None, :], A)
        tl.debug_barrier()
        # (I + A_bb)^-1 of the four diagonal blocks at once, [row, col, block]: row i = e_i - sum_{j<i} A[i, j] row j
        r = tl.arange(0, 16)
        blk = tl.arange(0, 4)
        diag_rows = scr + blk[None, :] * (16 * 64 + 16) + r[:, None]  # [col j, block b] of row 0 of block b
        inv = tl.where((r[:, None, None] == r[None, :, None]) & (blk[None, None, :] >= 0), 1.0, 0.0)
        for i in tl.static_range(1, 16):
            a_i = tl.load(diag_rows + i * 64, mask=(r[:, None] < i) & (blk[None, :] * 16 + i < n), other=0.0)
            new = (r[:, None] == i).to(tl.float32) - tl.sum(a_i[:, None, :] * inv, axis=0)
            inv = tl.where(r[:, None, None] == i, new[None, :, :], inv)
        even, odd = tl.split(tl.reshape(inv, (16, 16, 2, 2)))  # block 2 * b1 + b0: split takes b0 apart
        X00, X22 = tl.split(even)
        X11, X33 = tl.split(odd)
        A10, A20, A21 = _block(scr, 1, 0), _block(scr, 2, 0), _block(scr, 2, 1)
        A30, A31, A32 = _block(scr, 3, 0), _block(scr, 3, 1), _block(scr, 3, 2)
        X10 = -_dot(X11, _dot(A10, X00, PREC, False), PREC, False)
        X21 = -_dot(X22, _dot(A21, X11, PREC, False), PREC, False)
        X20 = -_dot(X22, _dot(A20, X00, PREC, False) + _dot(A21, X10, PREC, False), PREC, False)
        X32 = -_dot(X33, _dot(A32, X22, PREC, False), PREC, False)
        X31 = -_dot(X33, _dot(A31, X11, PREC, False) + _dot(A32, X21, PREC, False), PREC, False)
        X30 = -_dot(X33, _dot(A30, X00, PREC, False) + _dot(A31, X10, PREC, False) + _dot(A32, X20, PREC, False),
                    PREC, False)
        tl.debug_barrier()  # every thread has read A before (I + A)^-1 overwrites it
        _put_block(scr, 0, 0, X00)
        _put_block(scr, 1, 0, X10)
        _put_block(scr, 1, 1, X11)
        _put_block(scr, 2, 0, X20)
        _put_block(scr, 2, 1, X21)
        _put_block(scr, 2, 2, X22)
        _put_block(scr, 3, 0, X30)
        _put_block(scr, 3, 1, X31)
        _put_block(scr, 3, 2, X32)
        _put_block(scr, 3, 3, X33)
        tl.debug_barrier()
        ai = tl.load(scr + rows[:, None] * 64 + rows[None, :], mask=rows[:, None] // 16 >= rows[None, :] // 16,
                     other=0.0)
        # bf16 operands, as FLA: tf32 here made the kernel slower on the H100 for no better output error
        w = _dot(ai, k.to(tl.float32) * (beta * tl.exp(G) * rk)[:, None], PREC, BF16)
        _store_rows(wq_ptr + (h % RATIO) * K, rows, ok, kh, stride_wt, stride_wh, offs_k, k_ok, w)
        offs_v = tl.arange(0, BV)
        v_ok = offs_v < V
        v = _load_rows(v_ptr, rows, ok, h, stride_vt, stride_vh, offs_v, v_ok)
        u = _dot(ai, v.to(tl.float32) * beta[:, None], PREC, BF16)
        _store_rows(u_ptr, rows, ok, h, stride_ut, stride_uh, offs_v, v_ok, u)
        if ASM:  # the scratch is dead: drop its dirty lines from L2 instead of writing them back to memory
            tl.debug_barrier()
            _discard_l2(scr + tl.arange(0, 128) * 32)  # its 64 x 64 fp32 = 128 lines of 32
    if PDL:  # the scan may launch once every program is here (it waits for this whole kernel before reading)
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _chunk_scan_kernel(k_ptr, wq_ptr, u_ptr, p_ptr, G_ptr, rk_ptr, s_ptr, idx_ptr, cu_ptr, o_ptr, T,
                       stride_kt, stride_kh, stride_wt, stride_wh, stride_ut, stride_uh,
                       stride_pt, stride_ph, stride_Gt, stride_rt, stride_ss, stride_sh, stride_ot, stride_oh,
                       RATIO: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       C: tl.constexpr, VARLEN: tl.constexpr, HAS_IDX: tl.constexpr, L2NORM: tl.constexpr,
                       PREC: tl.constexpr, BF16: tl.constexpr, PDL: tl.constexpr):
    """Program (value block, value head, sequence): walks the sequence's chunks with its [K, BV] slice of the
    state in fp32 registers; per chunk (S the state at its start; w, qs, u, P from the prep kernel):
        [w; qs] S = [w S; qs S]    (one product, the chunk's 64 w rows and 64 qs rows stacked)
        v_new = u - w S,  o = exp(G) (qs S) + P v_new
        S = exp(G_last) S + (kn exp(G_last - G))^T v_new
    k is read raw and its norm applied as a row factor. Neither v_new nor the chunk states ever reach memory.
    The final state is written in place. With PDL it launches while the prep kernel's last programs finish."""
    pdl_start(PDL)
    pid_v = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.program_id(2)
    slot = n
    if HAS_IDX:
        slot = tl.load(idx_ptr + n)
    if slot >= 0:
        kh = h // RATIO
        if VARLEN:
            bos = tl.load(cu_ptr + n)
            eos = tl.load(cu_ptr + n + 1)
        else:
            bos = n * T
            eos = bos + T
        offs_k = tl.arange(0, BK)
        offs_v = pid_v * BV + tl.arange(0, BV)
        k_ok, v_ok = offs_k < K, offs_v < V
        s_tile = s_ptr + slot.to(tl.int64) * stride_ss + h * stride_sh + offs_k[:, None] * V + offs_v[None, :]
        s_mask = k_ok[:, None] & v_ok[None, :]
        S = tl.load(s_tile, mask=s_mask, other=0.0)
        rows = tl.arange(0, C)
        rows2 = tl.arange(0, 2 * C)  # [w; qs]: row r of token r % C, plane h % RATIO (w) or RATIO (qs)
        plane = tl.where(rows2 < C, h % RATIO, RATIO)
        for j in range(tl.cdiv(eos - bos, C)):
            t0 = (bos + j * C).to(tl.int64)
            n_rows = tl.minimum(eos - bos - j * C, C)
            ok = rows < n_rows
            k = _load_rows(k_ptr + t0 * stride_kt, rows, ok, kh, stride_kt, stride_kh, offs_k, k_ok)
            wq_off = (rows2 % C)[:, None] * stride_wt + kh * stride_wh + (plane * K)[:, None] + offs_k[None, :]
            wq = tl.load(wq_ptr + t0 * stride_wt + wq_off, mask=((rows2 % C) < n_rows)[:, None] & k_ok[None, :],
                         other=0.0)
            u = _load_rows(u_ptr + t0 * stride_ut, rows, ok, h, stride_ut, stride_uh, offs_v, v_ok)
            p = _load_rows(p_ptr + t0 * stride_pt, rows, ok, h, stride_pt, stride_ph, rows, rows < C)
            G_last = tl.load(G_ptr + (t0 + n_rows - 1) * stride_Gt + h)
            G = tl.load(G_ptr + (t0 + rows) * stride_Gt + h, mask=ok, other=0.0)
            G = tl.where(ok, G, G_last)
            if L2NORM:
                rk = tl.load(rk_ptr + (t0 + rows) * stride_rt + kh, mask=ok, other=0.0)
            else:
                rk = tl.full((C,), 1.0, dtype=tl.float32)
            ws, qs = tl.split(tl.permute(tl.reshape(_dot(wq, S, PREC, BF16), (2, C, BV)), (1, 2, 0)))
            v_new = u.to(tl.float32) - ws
            o = qs * tl.exp(G)[:, None] + _dot(p, v_new, PREC, BF16)
            _store_rows(o_ptr + t0 * stride_ot, rows, ok, h, stride_ot, stride_oh, offs_v, v_ok, o)
            v_new = v_new * tl.where(ok, rk * tl.exp(G_last - G), 0.0)[:, None]
            S = S * tl.exp(G_last) + _dot(tl.trans(k), v_new, PREC, BF16)
        tl.store(s_tile, S, mask=s_mask)


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] -> [B*T, ...] (a view when the batch is laid out like time, as in a projection's output)."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def chunk_offsets(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The chunk offsets [N+1] int32 of device cu_seqlens [N+1] (sequence i owns the chunks first[i] ..
    first[i+1]-1), computed on the device: `chunk_gated_delta_rule(chunk_first=)` takes them made once for all the
    layers of a forward."""
    cu = cu_seqlens.to(torch.int32)
    counts = torch.div(cu[1:] - cu[:-1] + (CHUNK - 1), CHUNK, rounding_mode="floor")
    return torch.cat([counts.new_zeros(1), counts.cumsum(0, dtype=torch.int32)])


def _sequence_tables(cu_seqlens, T: int, device, first: torch.Tensor | None = None):
    """cu_seqlens -> (N, cu [N+1], first [N+1] chunk offsets, chunk-grid size), on the device without a host sync:
    a tensor already on the device is taken as it is (checking it would need a sync), `first` computed there
    (unless given: `chunk_offsets`) and the grid sized for the worst case; a host list (or a tensor elsewhere) is
    checked and copied once, from pinned memory."""
    C = CHUNK
    if torch.is_tensor(cu_seqlens) and cu_seqlens.device == device:
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"gated delta rule: cu_seqlens must be int32/int64 [N+1], got {cu_seqlens.dtype} "
                             f"{tuple(cu_seqlens.shape)}")
        N = cu_seqlens.shape[0] - 1
        if first is None:
            first = chunk_offsets(cu_seqlens)
        elif first.shape != (N + 1,) or first.dtype != torch.int32 or first.device != device:
            raise ValueError(f"gated delta rule: chunk_first must be int32 [N+1] = [{N + 1}] on {device}, got "
                             f"{first.dtype} {tuple(first.shape)}")
        return N, cu_seqlens.to(torch.int32), first, triton.cdiv(T, C) + N
    cu = [int(c) for c in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != T or any(x > y for x, y in zip(cu, cu[1:])):
        raise ValueError(f"gated delta rule: cu_seqlens must rise from 0 to T = {T} with B = 1, got "
                         f"{cu[:4]}...{cu[-2:]}")
    first = [0]
    for i in range(len(cu) - 1):
        first.append(first[-1] + -(-(cu[i + 1] - cu[i]) // C))
    host = torch.tensor(cu + first, dtype=torch.int32, pin_memory=device.type == "cuda")
    both = host.to(device, non_blocking=True)
    N = len(cu) - 1
    return N, both[:N + 1], both[N + 1:], first[-1]


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                           state: torch.Tensor, A_log: torch.Tensor | None = None,
                           dt_bias: torch.Tensor | None = None, state_indices: torch.Tensor | None = None,
                           cu_seqlens=None, scale: float | None = None, use_qk_l2norm: bool = True,
                           block_v: int | None = None, num_warps: tuple[int, int] | None = None,
                           num_stages: int | None = None, out: torch.Tensor | None = None,
                           chunk_first: torch.Tensor | None = None) -> torch.Tensor:
    """Prefill: the chunk-parallel form, same arguments and result as `fused_recurrent_gated_delta_rule` (the
    state updated in place), plus `cu_seqlens` ([N + 1] offsets: a host list or CPU tensor, checked, or a CUDA
    tensor, taken as it is; then B must be 1 and the T tokens hold N sequences back to back, sequence i using
    state slot state_indices[i] or i; a device cu_seqlens may also start past 0 and leave tokens out, whose output
    is not written; `chunk_first`: its `chunk_offsets`, when already made). `out`: the output tensor to write into
    (contiguous [B, T, Hv, V] in v's dtype). Two launches, no host synchronisation."""
    B, T, Hk, K = q.shape
    Hv, V = v.shape[-2:]
    raw = A_log is not None
    dev = v.device
    C = CHUNK
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"gated delta rule: cu_seqlens needs B = 1, got B = {B}")
        N, cu_t, first_t, n_chunks = _sequence_tables(cu_seqlens, T, dev, chunk_first)
    else:
        N, n_chunks = B, B * triton.cdiv(T, C)
        cu_t = first_t = torch.empty(1, dtype=torch.int32, device=dev)  # placeholders
    _check(q, k, v, a, b, state, A_log, dt_bias, state_indices, sequences=N)
    o = _output(out, (B, T, Hv, V), v)
    if B * T == 0:
        return o
    q2, k2, v2, a2, b2, o2 = (_tokens(x) for x in (q, k, v, a, b, o))
    bf16 = q.dtype == k.dtype == v.dtype == torch.bfloat16
    inter = torch.bfloat16 if bf16 else torch.float32  # w and u (FLA keeps them in the inputs' dtype too)
    dot16 = bf16 and not INTERPRET
    prec = "ieee" if v.dtype == torch.float32 else "tf32"
    wq = torch.empty((B * T, Hk, Hv // Hk + 1, K), dtype=inter, device=dev)  # w of each value head, qs: side by side
    u = torch.empty((B * T, Hv, V), dtype=inter, device=dev)
    p = torch.empty((B * T, Hv, C), dtype=inter, device=dev)  # the intra-chunk attention, row t of its chunk
    G = torch.empty((B * T, Hv), dtype=torch.float32, device=dev)
    rk = torch.empty((B * T, Hk), dtype=torch.float32, device=dev)  # 1/|k| per token and key head
    scratch = torch.empty((n_chunks, Hv, C * C), dtype=torch.float32, device=dev)  # A, then (I + A)^-1
    BK, BV = triton.next_power_of_2(K), triton.next_power_of_2(V)
    varlen = cu_seqlens is not None
    scale = K ** -0.5 if scale is None else scale
    use_pdl = pdl(dev)
    w_prep, w_scan = num_warps or (4, 4)  # measured on the H100 (prep with 8 warps: slower)
    _chunk_prep_kernel[(n_chunks * Hv,)](
        q2, k2, v2, a2, b2, A_log if raw else a2, dt_bias if raw else a2, cu_t, first_t,
        G, rk, wq, u, p, scratch, N, T, triton.cdiv(T, C), scale,
        q2.stride(0), q2.stride(1), k2.stride(0), k2.stride(1), v2.stride(0), v2.stride(1), a2.stride(0),
        b2.stride(0), G.stride(0), rk.stride(0), wq.stride(0), wq.stride(1), u.stride(0), u.stride(1),
        p.stride(0), p.stride(1),
        HV=Hv, RATIO=Hv // Hk, K=K, V=V, BK=BK, BV=BV, VARLEN=varlen, NP2=triton.next_power_of_2(N),
        RAW_GATES=raw, L2NORM=use_qk_l2norm, PREC=prec, BF16=dot16, PDL=use_pdl,
        ASM=_cache_hints(dev), num_warps=w_prep)
    bv = block_v or min(32 if BK <= 128 else 16, BV)  # K = 256: shared memory
    idx = state_indices if state_indices is not None else cu_t
    _chunk_scan_kernel[(triton.cdiv(V, bv), Hv, N)](
        k2, wq, u, p, G, rk, state, idx, cu_t, o2, T,
        k2.stride(0), k2.stride(1), wq.stride(0), wq.stride(1), u.stride(0), u.stride(1),
        p.stride(0), p.stride(1), G.stride(0), rk.stride(0), state.stride(0), state.stride(1), o2.stride(0),
        o2.stride(1),
        RATIO=Hv // Hk, K=K, V=V, BK=BK, BV=bv, C=C, VARLEN=varlen, HAS_IDX=state_indices is not None,
        L2NORM=use_qk_l2norm, PREC=prec, BF16=dot16, PDL=use_pdl, launch_pdl=use_pdl, num_warps=w_scan,
        # 3 stages measured best on the H100 at long prompts; K = 256 fits only 2 in shared
        # memory. Stages 1 with bf16 dots gave illegal addresses there (Triton 3.6): not used
        num_stages=num_stages or ((3 if BK <= 128 else 2) if dot16 else 1))
    return o


def _cache_hints(device) -> bool:
    """The prep kernel's inline PTX cache hints (`discard.global.L2` needs sm_80): NVIDIA Ampere or newer, not the
    interpreter."""
    return (device.type == "cuda" and not INTERPRET and torch.version.hip is None
            and capability(device.index or 0)[0] >= 8)


def _value_block(V: int, programs_per_block: int, device) -> int:
    """Value columns per decode program: 64, halved (down to 16) while that leaves most multiprocessors idle
    (measured on the H200: 64 is best at batch 32, 16 at batch 1)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    bv = min(64, triton.next_power_of_2(V))
    while bv > 16 and programs_per_block * triton.cdiv(V, bv) < 2 * sms:
        bv //= 2
    return bv


_HEAD_COUNTERS: dict = {}  # device -> its int32 counter buffers of the fused gated norm, the newest last


def _head_counters(n: int, device: torch.device) -> torch.Tensor:
    """At least n int32 counters on `device`, zero between launches (the last program of a head resets its own).
    Made on an eager call (a decode graph's warm-up runs before its capture), never during a capture: its zeros
    would only be a captured memset. A bigger buffer replaces an outgrown one, which stays alive: graphs captured
    with it still use it."""
    held = _HEAD_COUNTERS.setdefault(device, [])
    if not held or held[-1].numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"gated delta rule: the gated norm needs {n} head counters on {device}; run the step "
                               "eagerly once before capturing it")
        held.append(torch.zeros(max(4096, triton.next_power_of_2(n)), dtype=torch.int32, device=device))
    return held[-1]


def fused_recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                                     b: torch.Tensor, state: torch.Tensor, A_log: torch.Tensor | None = None,
                                     dt_bias: torch.Tensor | None = None, state_indices: torch.Tensor | None = None,
                                     scale: float | None = None, use_qk_l2norm: bool = True,
                                     z: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                                     norm_eps: float = 1e-6, block_v: int | None = None,
                                     num_warps: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Run T tokens of B sequences through the recurrence, the state updated in place; returns o [B, T, Hv, V]
    in v's dtype.

    q, k [B, T, Hk, K]; v [B, T, Hv, V] (any strides with a unit last one: views into the projection output);
    with A_log and dt_bias [Hv]: a, b [B, T, Hv] are the raw gate projections (g = -exp(A_log) softplus(a +
    dt_bias), beta = sigmoid(b)); without them a is g (log decay, <= 0) and b is beta. state: fp32 [slots, Hv, K,
    V], sequence i using slot state_indices[i] (default i; negative: skipped, its output left unwritten).
    With z [B, T, Hv, V] (unit last stride) and norm_weight [V]: returns `gated_rms_norm(o, z, norm_weight,
    norm_eps)` instead, from the same launch (its bits under the interpreter; on a GPU a row's sum of squares may
    be reduced in another order: an ulp of the output at times). `out`: a [B, T, Hv, V] tensor in v's dtype (unit
    last stride, any other strides) to write into; a skipped sequence's rows keep what they held."""
    B, T, Hk, K = q.shape
    Hv, V = v.shape[-2:]
    raw = A_log is not None
    _check(q, k, v, a, b, state, A_log, dt_bias, state_indices)
    gated_norm = z is not None or norm_weight is not None
    if gated_norm:
        _check_gated_norm(z, norm_weight, v)
        norm_weight = norm_weight if norm_weight.stride(0) == 1 else norm_weight.contiguous()
    o = _output(out, (B, T, Hv, V), v, contiguous=False)
    if B == 0 or T == 0:
        return o
    bv = block_v or _value_block(V, B * Hv, v.device)
    idx = state_indices if state_indices is not None else q  # a placeholder pointer when unused
    counters = _head_counters(B * Hv, v.device) if gated_norm and bv < V else o  # o: a placeholder
    z = z if gated_norm else o
    _recurrent_kernel[(triton.cdiv(V, bv), Hv, B)](
        q, k, v, a, b, A_log if raw else a, dt_bias if raw else a, state, idx, o,
        z, norm_weight if gated_norm else o, counters, T, K ** -0.5 if scale is None else scale, norm_eps,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        state.stride(0), state.stride(1), o.stride(0), o.stride(1), o.stride(2), z.stride(0), z.stride(1), z.stride(2),
        RATIO=Hv // Hk, K=K, V=V, BK=triton.next_power_of_2(K), BV=bv, RAW_GATES=raw, L2NORM=use_qk_l2norm,
        HAS_IDX=state_indices is not None, GATED_NORM=gated_norm, BLOCK_V=triton.next_power_of_2(V),
        H_DTYPE=weight_product_dtype(norm_weight.dtype, v.dtype) if gated_norm else tl.float32, RNE_BF16=INTERPRET,
        PDL=pdl(v.device), launch_pdl=pdl(v.device),
        num_warps=num_warps or (4 if bv * triton.next_power_of_2(K) >= 4096 else 2))
    return o


def _output(out: torch.Tensor | None, shape: tuple, v: torch.Tensor, contiguous: bool = True) -> torch.Tensor:
    """The output tensor: `out` checked (shape, dtype, device, layout), or a new one."""
    if out is None:
        return torch.empty(shape, dtype=v.dtype, device=v.device)
    if (tuple(out.shape) != shape or out.dtype != v.dtype or out.device != v.device or out.stride(-1) != 1
            or (contiguous and not out.is_contiguous())):
        raise ValueError(f"gated delta rule: out must be a {v.dtype} {shape} tensor on {v.device} with a unit last "
                         f"stride{' (contiguous)' if contiguous else ''}, got {out.dtype} {tuple(out.shape)}")
    return out


def _check_gated_norm(z, norm_weight, v) -> None:
    what = "gated delta rule: the gated norm"
    if z is None or norm_weight is None:
        raise ValueError(f"{what} needs z and norm_weight together")
    if z.shape != v.shape or z.stride(3) != 1 or not z.is_floating_point():
        raise ValueError(f"{what}: z must be a float {tuple(v.shape)} tensor (v's shape) with a unit last stride, got "
                         f"{z.dtype} {tuple(z.shape)}")
    V = v.shape[-1]
    floats = (torch.bfloat16, torch.float16, torch.float32)
    if norm_weight.shape != (V,) or norm_weight.dtype not in floats:
        raise ValueError(f"{what}: norm_weight must be a bf16/fp16/fp32 [{V}] tensor, got {norm_weight.dtype} "
                         f"{tuple(norm_weight.shape)}")
    if v.dtype not in floats:
        raise ValueError(f"{what}: v must be bf16, fp16 or fp32, got {v.dtype}")
    if z.device != v.device or norm_weight.device != v.device:
        raise ValueError(f"{what}: all tensors must be on the same device")


def _check(q, k, v, a, b, state, A_log, dt_bias, state_indices, sequences=None) -> None:
    """Clear errors before any launch: a wrong state would be silently misread otherwise."""
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"gated delta rule: q, k must be [B, T, Hk, K] and v [B, T, Hv, V], got q{tuple(q.shape)} "
                         f"k{tuple(k.shape)} v{tuple(v.shape)}")
    B, T, Hk, K = q.shape
    Hv, V = v.shape[-2:]
    N = B if sequences is None else sequences
    if Hv % Hk:
        raise ValueError(f"gated delta rule: {Hv} value heads is not a multiple of {Hk} key heads")
    if not (1 <= K <= MAX_HEAD_DIM and 1 <= V <= MAX_HEAD_DIM):
        raise ValueError(f"gated delta rule: head dims up to {MAX_HEAD_DIM} are supported, got K={K}, V={V}")
    for name, x in (("a", a), ("b", b)):
        if x.shape != (B, T, Hv) or x.stride(2) != 1:
            raise ValueError(f"gated delta rule: {name} must be [B, T, Hv] = {(B, T, Hv)} with a unit last stride, "
                             f"got {tuple(x.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(3) != 1 or not x.is_floating_point():
            raise ValueError(f"gated delta rule: {name} must be a float tensor with a unit last stride")
    if (A_log is None) != (dt_bias is None):
        raise ValueError("gated delta rule: pass A_log and dt_bias together (raw gates) or neither (g and beta)")
    if A_log is not None and (A_log.shape != (Hv,) or dt_bias.shape != (Hv,)):
        raise ValueError(f"gated delta rule: A_log and dt_bias must be [{Hv}], got {tuple(A_log.shape)} and "
                         f"{tuple(dt_bias.shape)}")
    if (state.dtype != torch.float32 or state.dim() != 4 or state.shape[1:] != (Hv, K, V)
            or state.stride(3) != 1 or state.stride(2) != V):
        raise ValueError(f"gated delta rule: the state must be a contiguous fp32 [slots, {Hv}, {K}, {V}] tensor, got "
                         f"{state.dtype} {tuple(state.shape)}")
    if state_indices is None:
        if state.shape[0] < N:
            raise ValueError(f"gated delta rule: {N} sequences but the state has {state.shape[0]} slots")
    elif state_indices.shape != (N,) or state_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"gated delta rule: state_indices must be int32/int64 [{N}], got {state_indices.dtype} "
                         f"{tuple(state_indices.shape)}")
    tensors = [q, k, v, a, b, state] + [x for x in (A_log, dt_bias, state_indices) if x is not None]
    if any(x.device != v.device for x in tensors):
        raise ValueError("gated delta rule: all tensors must be on the same device")
